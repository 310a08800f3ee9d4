"""A branch as a job of the executors (``runs/executors.py``): local processes or Ray run it,
and its curve lands in the runs store (``runs/store.py``), one row per branch.

The parent's state at a branch point is one file beside the store
(``<store>.checkpoints/point-<n>.pt``: model, optimizer, RNG, data position, the parent's curve
so far), written whole and then renamed, so a ``kill -9`` leaves the old file or the new one.
A branch job loads it, trains its window (``branch.py``) and writes its row and curve to the
store in one transaction; a branch killed mid-way is pending again (``Store.reclaim_stale``) and
is trained again from the point's file, so a resumed recommendation has the numbers of one that
was never stopped (``tests/test_recommend.py``). A Ray task reads the point's file by its path:
on a cluster of several machines that folder must be on storage every node reads (the store
itself stays on the driver, as the sweep's does).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from batchfit.recommend.branch import Curve, Snapshot, Trainer, evaluator
from batchfit.runs.budget import Schedule
from batchfit.runs.data import BatchSource
from batchfit.runs.store import Store
from batchfit.workload import StepOptions, Workload


def point_path(checkpoints: Path, n: int) -> Path:
    return Path(checkpoints) / f"point-{n}.pt"


def save_point(checkpoints: Path, n: int, snap: Snapshot, parent: Curve) -> None:
    path = point_path(checkpoints, n)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save({"samples": snap.samples, "model": snap.model, "optimizer": snap.optimizer, "rng": snap.rng,
                "parent": parent.__dict__}, tmp)
    os.replace(tmp, path)


def load_point(path: Path, device: torch.device | str = "cpu") -> tuple[Snapshot, Curve]:
    data = torch.load(path, map_location=device, weights_only=False)
    snap = Snapshot(samples=data["samples"], model=data["model"], optimizer=data["optimizer"],
                    rng=data["rng"].cpu())
    return snap, Curve(**data["parent"])


def last_point(checkpoints: Path, count: int) -> int | None:
    """The last branch point whose state is saved (None: none)."""
    saved = [n for n in range(count) if point_path(checkpoints, n).exists()]
    return saved[-1] if saved else None


def cooldown_from(start: int, window: int, cooldown: float) -> int | None:
    """Where a window's cooldown starts (a data position), None without one."""
    return start + window - round(cooldown * window) if cooldown > 0 else None


def branch_name(point: int, window: int) -> str:
    """The store's ``branch`` column: the branch point (samples) and the data window."""
    return f"{point}:{window}"


@dataclass(frozen=True, kw_only=True)
class BranchSpec:
    """One branch: from the parent's state at a point, ``window`` samples at ``batch_size``."""

    run_id: int
    batch_size: int
    lr: float
    micro_batch: int
    point: int
    """The branch point (samples the parent consumed): ``snapshot`` holds the state there."""
    start: int
    """The data position the branch starts reading at (the point, or later data windows)."""
    window: int
    eval_at: tuple[int, ...]
    cooldown_from: int | None
    snapshot: str
    schedule: Schedule
    per_sample: int
    tokens_per_sample: int | None
    seed: int
    eval_batch: int
    grad_clip: float | None = 1.0

    @property
    def steps(self) -> int:
        return self.window // self.batch_size

    @property
    def accumulation_steps(self) -> int:
        return self.batch_size // self.micro_batch

    def train(self, workload: Workload, source: BatchSource, store: Store, checkpoints: Path, device: torch.device,
              progress: Callable[[str], None] | None = None) -> dict:
        """The executors' entry: train the window from the point's state, write row and curve."""
        from batchfit.train.step import TrainingStep

        started = time.perf_counter()
        torch.manual_seed(self.seed)
        step = TrainingStep(workload, StepOptions(), device)
        trainer = Trainer(step, source, self.schedule, per_sample=self.per_sample, grad_clip=self.grad_clip,
                          evaluate=evaluator(workload, source, self.eval_batch, device, step.forward_autocast))
        snap, _ = load_point(Path(self.snapshot), device)
        trainer.restore(snap)
        step.model.train()
        store.update_run(self.run_id, status="running", steps=self.steps, micro_batch=self.micro_batch,
                         accumulation_steps=self.accumulation_steps, started=time.time(), error=None,
                         worker=f"pid {os.getpid()}")
        curve = Curve(batch_size=self.batch_size, lr=self.lr, start_samples=self.start)
        trainer.train(curve, start=self.start, samples=self.window, micro=self.micro_batch,
                      eval_at=set(self.eval_at), cooldown_from=self.cooldown_from)
        tokens = (lambda s: s * self.tokens_per_sample) if self.tokens_per_sample else (lambda s: None)
        b = self.batch_size
        points = ([{"step": (s - self.start) // b, "split": "train", "samples": s, "tokens": tokens(s), "loss": loss,
                    "lr": None} for s, loss in curve.train]
                  + [{"step": (s - self.start) // b, "split": "val", "samples": s, "tokens": tokens(s), "loss": loss,
                      "lr": None} for s, loss in curve.val])
        vals = [loss for _, loss in curve.val]
        end = self.start + self.window
        store.write_back({"id": self.run_id, "status": "done", "steps_done": self.steps, "samples": self.window,
                          "tokens": tokens(self.window), "final_train_loss": curve.train[-1][1],
                          "final_val_loss": vals[-1], "best_val_loss": min(vals),
                          "seconds": time.perf_counter() - started, "finished": time.time()}, points)
        if progress is not None:
            progress(f"branch at {self.point:,}, data at {self.start:,}-{end:,}: batch {b}, lr {self.lr:.3g}: "
                     f"val {vals[-1]:.4f}")
        return store.run(self.run_id)


def read_branch(store: Store, run_id: int, start: int) -> Curve:
    """A finished branch's curve, back from the store."""
    row = store.run(run_id)
    curve = Curve(batch_size=row["batch_size"], lr=row["lr"], start_samples=start)
    for p in store.points(run_id):
        (curve.train if p["split"] == "train" else curve.val).append((p["samples"], p["loss"]))
    return curve
