"""The Hugging Face Trainer integration, under its public name ``batchfit.transformers`` (it lives in
``batchfit.integrations.transformers``)."""

from batchfit.integrations.transformers import PeakCheck, TrainerFit, fit_training, fit_training_args, hf_model_workload

__all__ = ['hf_model_workload', 'TrainerFit', 'fit_training', 'fit_training_args', 'PeakCheck']
