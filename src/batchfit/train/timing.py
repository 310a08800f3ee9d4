"""The timed-step loop that probe and bench share: real steps on a real device.

Every CUDA call names the device (``cuda:1`` must reset and read cuda:1's statistics, not
the current device's). Whole steps are timed with the device synchronised only around
each step, never inside it, so the step runs as it would in training; phases are timed
in separate steps by whoever passes ``hooks``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from batchfit.train.oom import NonFiniteLoss
from batchfit.train.step import StepHooks, TrainingStep


@dataclass
class TimedSteps:
    """What ``run_timed_steps`` saw."""

    times_s: list[float]
    """Wall time of each timed step, the device synchronised before and after it."""
    loss: float | None
    """The last step's loss."""
    peak_allocated_bytes: int | None = None
    """``max_memory_allocated(device)`` over the warm-up and timed steps (cuda only)."""
    peak_reserved_bytes: int | None = None
    """``max_memory_reserved(device)`` over the warm-up and timed steps (cuda only)."""


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_timed_steps(step: TrainingStep, batch_size: int, *, steps: int, warmup: int = 0,
                    hooks: StepHooks | None = None, stop_on_nan: bool = False) -> TimedSteps:
    """``warmup`` untimed steps, then ``steps`` timed ones, on ``step.device``."""
    device = step.device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    loss_value = None
    for _ in range(warmup):
        loss_value = float(step.run(batch_size))  # float() waits for the step on a GPU
    times = []
    for _ in range(steps):
        _synchronize(device)
        started = time.perf_counter()
        loss = step.run(batch_size, hooks=hooks)
        _synchronize(device)
        times.append(time.perf_counter() - started)
        loss_value = float(loss)
        if stop_on_nan and not math.isfinite(loss_value):
            raise NonFiniteLoss(f"the loss is {loss_value} at batch size {batch_size}")
    return TimedSteps(
        times, loss_value,
        peak_allocated_bytes=torch.cuda.max_memory_allocated(device) if cuda else None,
        peak_reserved_bytes=torch.cuda.max_memory_reserved(device) if cuda else None,
    )
