"""Training runs: the batch-size sweep (``batchfit sweep``) and the gradient noise scale
(``batchfit noise``). Their store, executors, budgets and data live one floor down in ``runs/``,
shared with ``recommend``: ``runs/budget.py`` (token/sample budgets, the schedule, learning rate
per batch size), ``runs/data.py`` (text -> token ids, batches in a seeded order), ``runs/store.py``
(the SQLite store every worker writes to) and ``runs/executors.py`` (this process, local worker
processes, or Ray).

    run.py        one training run: accumulation, checkpoint and resume
    engine.py     SweepConfig -> Plan -> runs -> SweepResult
    result.py     the result read back from the store
    noise.py      B_simple from gradient norms at two batch sizes (McCandlish et al. 2018)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchfit.runs.budget import Budget, Schedule
    from batchfit.sweep.engine import SweepConfig, plan_sweep, run_sweep
    from batchfit.sweep.noise import NoiseResult, gradient_noise_scale
    from batchfit.sweep.result import SweepResult, read_result

_LAZY = {"Budget": "batchfit.runs.budget", "Schedule": "batchfit.runs.budget", "SweepConfig": "batchfit.sweep.engine",
         "plan_sweep": "batchfit.sweep.engine", "run_sweep": "batchfit.sweep.engine",
         "NoiseResult": "batchfit.sweep.noise",
         "gradient_noise_scale": "batchfit.sweep.noise", "SweepResult": "batchfit.sweep.result",
         "read_result": "batchfit.sweep.result"}

__all__ = ["Budget", "NoiseResult", "Schedule", "SweepConfig", "SweepResult", "gradient_noise_scale",
           "plan_sweep", "read_result", "run_sweep"]


def __getattr__(name: str):
    """Imported when first used: the engine loads torch, the CLI's help does not need it."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'batchfit.sweep' has no attribute '{name}'")
