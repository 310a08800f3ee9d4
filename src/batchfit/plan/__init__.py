"""``batchfit plan``: strategies on a fake process group, a time model, launch configs.

    engine.py      plan(): trace each strategy x GPU count, fit, search, time, recommend
    candidates.py  --strategies auto: every combination worth tracing, the ones that cannot apply with why
    ranking.py     every combination ranked by predicted tokens/s, with its memory (report and JSON 'ranking')
    world.py       --gpus / --nodes / --gpus-per-node, --tokens
    time_model.py  computed step time: FLOPs / (peak x MFU) + collective bytes / bandwidth
    emit.py        --emit: the chosen numbers as YAML + torchrun, or an Accelerate config
    sharded.py     the sharded tracer (rank 0 of DDP / FSDP2 / HSDP / TP on a fake process group)

Light on import: the tracer (and torch.distributed with it) is imported when a plan runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchfit.plan.engine import PlanResult, StrategyPlan, plan
    from batchfit.plan.time_model import TimeModel
    from batchfit.plan.world import World, parse_worlds

_LAZY = {"plan": "engine", "PlanResult": "engine", "StrategyPlan": "engine", "TimeModel": "time_model",
         "World": "world", "parse_worlds": "world"}

# Written out (not sorted(_LAZY)) so linters see the TYPE_CHECKING imports above as re-exports.
__all__ = ["PlanResult", "StrategyPlan", "TimeModel", "World", "parse_worlds", "plan"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"batchfit.plan.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'batchfit.plan' has no attribute '{name}'")
