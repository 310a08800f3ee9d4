"""Branched training (Merrill, Arora, Groeneveld, Hajishirzi 2025, "Critical batch size
revisited", arXiv:2505.23971): one parent run at a small batch; at a few points of it, copies
of the exact state train a short window at k times the batch.

A branch starts from the parent's exact state: the model, the optimizer state (Adam's moments
and step count), the RNG state, and the data position (samples consumed: the data order is a
function of the seed and that one integer, ``batchfit.runs.data``). So a branch at k = 1 with
the parent's learning rate repeats the parent's next steps bit for bit on a CPU
(``tests/test_recommend.py`` checks it). Every step is the one training step
(``TrainingStep.step``), with micro-batches of the size the caller sized (traced), so a
branch at a large batch accumulates instead of running out of memory.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from batchfit.runs.budget import Schedule
from batchfit.runs.data import BatchSource
from batchfit.train.oom import NonFiniteLoss
from batchfit.train.step import TrainingStep
from batchfit.workload import Workload


@dataclass(kw_only=True)
class Snapshot:
    """The parent's whole state at a branch point."""

    samples: int
    """Data position: samples consumed."""
    model: dict
    optimizer: dict
    rng: torch.Tensor


@dataclass(kw_only=True)
class Curve:
    """One run or branch: per step its training loss, and validation points."""

    batch_size: int
    lr: float
    start_samples: int
    train: list[tuple[int, float]] = field(default_factory=list)
    """(samples consumed after the step, training loss of the step)."""
    val: list[tuple[int, float]] = field(default_factory=list)
    """(samples consumed, validation loss)."""

    def to_json(self, per_sample: int) -> dict:
        return {"batch_size": self.batch_size, "lr": self.lr, "start": self.start_samples * per_sample,
                "train": [[s * per_sample, loss] for s, loss in self.train],
                "val": [[s * per_sample, loss] for s, loss in self.val]}


class Trainer:
    """The one training step around a model, and what a branch needs to copy it."""

    def __init__(self, trainer: TrainingStep, source: BatchSource, schedule: Schedule, *, per_sample: int,
                 grad_clip: float | None, evaluate: Callable[[torch.nn.Module], float]) -> None:
        self.step_, self.source, self.schedule, self.per_sample = trainer, source, schedule, per_sample
        self.grad_clip, self.evaluate = grad_clip, evaluate

    def snapshot(self, samples: int) -> Snapshot:
        return Snapshot(samples=samples, model=copy.deepcopy(self.step_.model.state_dict()),
                        optimizer=copy.deepcopy(self.step_.optimizer.state_dict()), rng=torch.get_rng_state())

    def restore(self, snap: Snapshot) -> None:
        self.step_.model.load_state_dict(snap.model)
        self.step_.optimizer.load_state_dict(copy.deepcopy(snap.optimizer))
        torch.set_rng_state(snap.rng)

    def factor(self, position: int, cooldown_from: int | None, end: int) -> float:
        """The schedule's rate factor after a step that ends at ``position`` (samples); from
        ``cooldown_from`` on, a straight line from the schedule's factor there down to its final
        one (``min_lr_ratio``) at ``end``."""
        if cooldown_from is None or position <= cooldown_from:
            return self.schedule.factor(position * self.per_sample)
        high = self.schedule.factor(cooldown_from * self.per_sample)
        share = (position - cooldown_from) / (end - cooldown_from)
        return high + (self.schedule.min_lr_ratio - high) * share

    def train(self, curve: Curve, *, start: int, samples: int, micro: int, eval_at: set[int] = frozenset(),
              stop: Callable[[], None] | None = None, cooldown_from: int | None = None) -> int:
        """Train ``samples`` samples at ``curve.batch_size`` from data position ``start``;
        validate when the position reaches a value in ``eval_at``; from ``cooldown_from`` (a
        position) the rate decays linearly to the schedule's final one. Returns the new position."""
        b, device = curve.batch_size, self.step_.device
        position = start
        while position < start + samples:
            lr = curve.lr * self.factor(position + b, cooldown_from, start + samples)
            pieces = [(micro, self.source.train(position + i * micro, micro, device)) for i in range(b // micro)]
            result = self.step_.step(pieces, b, lr=lr, max_grad_norm=self.grad_clip)
            position += b
            curve.train.append((position, _finite(result.loss, "training", position, curve)))
            if position in eval_at:
                curve.val.append((position, _finite(self.evaluate(self.step_.model), "validation", position, curve)))
            if stop is not None:
                stop()
        return position


def _finite(loss: float, what: str, position: int, curve: Curve) -> float:
    """``loss``, or NonFiniteLoss: the runs store keeps a NaN as NULL, which its curve refuses."""
    if not math.isfinite(loss):
        raise NonFiniteLoss(f"the {what} loss is not finite ({loss}) at sample {position:,} (batch {curve.batch_size}, "
                            f"lr {curve.lr:.3g}): the run diverged; lower `lrs`, or keep `grad_clip`")
    return loss


def evaluator(workload: Workload, source: BatchSource, micro: int, device: torch.device, autocast
               ) -> Callable[[torch.nn.Module], float]:
    def evaluate(model: torch.nn.Module) -> float:
        model.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for size, batch in source.validation(micro, device):
                with autocast():
                    total += workload.loss_fn(model, batch).item() * size
                count += size
        model.train()
        return total / count
    return evaluate
