"""``batchfit recommend``: the batch size (and rate) that trains best for a budget, from
branched training (measured), formula priors (free) and the noise scale (biased), each shown
on its own.

    priors.py   Step Law and Power Lines: formulas, never measurements
    branch.py   the parent run and its exact branches (model, optimizer, RNG, data position)
    jobs.py     a branch as a job of the executors (runs/executors.py), its row in the runs store
    layout.py   the plan fitted to the budget and grid: window, branch points, which batch sizes, or the sweep
    engine.py   RecommendConfig -> Plan (every check before training) -> the parent, the branches
    read.py     the critical batch size, the extrapolation, the recommendation and its cost
    result.py   the answer, its interval, the evidence table, the cost (no torch)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchfit.recommend.engine import RecommendConfig, plan_recommend, run_recommend
    from batchfit.recommend.result import RecommendResult

_LAZY = {"RecommendConfig": "engine", "plan_recommend": "engine", "run_recommend": "engine",
         "RecommendResult": "result"}

__all__ = ["RecommendConfig", "RecommendResult", "plan_recommend", "run_recommend"]


def __getattr__(name: str):
    """Imported when first used: the engine loads torch, the CLI's help does not need it."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"batchfit.recommend.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'batchfit.recommend' has no attribute '{name}'")
