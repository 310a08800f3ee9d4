"""Training runs: the batch-size sweep (``batchfit sweep``) and the gradient noise scale
(``batchfit noise``).

    budget.py     exact token/sample budgets, the schedule in tokens, learning rate per batch size
    data.py       text -> token ids (cached, memory-mapped), batches in a seeded order
    store.py      the SQLite store every worker writes to
    run.py        one training run: accumulation, checkpoint and resume
    executors.py  this process, local worker processes, or Ray
    engine.py     SweepConfig -> Plan -> runs -> SweepResult
    result.py     the result read back from the store
    noise.py      B_simple from gradient norms at two batch sizes (McCandlish et al. 2018)
"""

from batchfit.sweep.budget import Budget, Schedule
from batchfit.sweep.engine import SweepConfig, plan_sweep, run_sweep
from batchfit.sweep.noise import NoiseResult, gradient_noise_scale
from batchfit.sweep.result import SweepResult, read_result

__all__ = ["Budget", "NoiseResult", "Schedule", "SweepConfig", "SweepResult", "gradient_noise_scale",
           "plan_sweep", "read_result", "run_sweep"]
