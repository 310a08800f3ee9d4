"""The Lightning callback, under its public name ``batchfit.lightning`` (it lives in
``batchfit.integrations.lightning``)."""

from batchfit.integrations.lightning import BatchFit, lightning_workload

__all__ = ['BatchFit', 'lightning_workload']
