"""One training run of a sweep: a batch size, a learning rate, exactly the budget.

Each step is ``TrainingStep.step`` (``batchfit.train.step``), the one training step: a batch larger
than what fits runs as ``accumulation_steps`` micro-batches whose losses are weighted by their
share of the batch, so the summed gradient is the full batch's mean gradient
(``test_sweep_run`` checks it against one big backward). fp16-mixed scales the loss with a
GradScaler; a step the scaler skips (inf/nan gradients, its scale then halves) still consumes
its batch, as in any fp16 run, and the progress line counts such steps. Every
``checkpoint_every`` units the model, the optimizer, the GradScaler, the step (the schedule is
a function of it), the data position (samples consumed) and the RNG states go to one file,
written whole and then renamed, so a ``kill -9`` leaves either the old checkpoint or the new
one. A resumed run drops the curve points recorded after its checkpoint and recomputes them:
on a CPU the numbers are the same as a run that was never stopped.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from batchfit.runs.budget import Budget, Schedule
from batchfit.runs.data import BatchSource
from batchfit.runs.store import Store
from batchfit.train.oom import NonFiniteLoss
from batchfit.train.step import TrainingStep
from batchfit.workload import StepOptions, Workload


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """Everything a worker needs to train one run (picklable, for worker processes)."""

    run_id: int
    batch_size: int
    lr: float
    micro_batch: int
    budget: Budget
    schedule: Schedule
    seed: int
    eval_every: int
    """In the budget's unit: evaluate each time this much more has been trained on."""
    checkpoint_every: int
    eval_samples: int = 64
    eval_batch: int | None = None
    """Validation in pieces of this many samples, the same in every run of a sweep (so the
    validation losses of two runs differ by their models, not by how the sum was split);
    default the micro-batch."""
    grad_clip: float | None = 1.0
    precision: str = "fp32"

    @property
    def steps(self) -> int:
        return self.budget.steps(self.batch_size)

    @property
    def accumulation_steps(self) -> int:
        return self.batch_size // self.micro_batch

    def to_json(self) -> dict:
        return asdict(self)

    def train(self, workload: Workload, source: BatchSource, store: Store, checkpoints: Path, device: torch.device,
              progress: Callable[[str], None] | None = None) -> dict:
        """The executors' entry (``runs/executors.py``): :func:`train_run`."""
        return train_run(workload, source, self, store, checkpoints, device, progress)


class Evaluator:
    def __init__(self, workload: Workload, source: BatchSource, micro_batch: int, device: torch.device,
                 autocast: Callable) -> None:
        self.workload, self.source, self.micro_batch, self.device, self.autocast = (
            workload, source, micro_batch, device, autocast)

    def __call__(self, model: torch.nn.Module) -> float:
        """Mean validation loss per sample over the fixed validation set."""
        was_training = model.training
        model.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for size, batch in self.source.validation(self.micro_batch, self.device):
                with self.autocast():
                    total += self.workload.loss_fn(model, batch).item() * size
                count += size
        model.train(was_training)
        return total / count


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_path(folder: Path, run_id: int) -> Path:
    return folder / f"run-{run_id}.pt"


def train_run(workload: Workload, source: BatchSource, spec: RunSpec, store: Store, checkpoints: Path,
              device: torch.device, progress: Callable[[str], None] | None = None) -> dict:
    """Train one run to the end of its budget (from its checkpoint when there is one),
    writing its curve and results to ``store``; returns the run's row."""
    say = progress or (lambda message: None)
    started = time.perf_counter()
    b, micro, steps = spec.batch_size, spec.micro_batch, spec.steps
    per_sample, tokens_per_sample = spec.budget.per_sample, spec.budget.tokens_per_sample
    torch.manual_seed(spec.seed)  # the same initial model at every batch size and learning rate
    trainer = TrainingStep(workload, StepOptions(precision=spec.precision), device)
    model, optimizer, scaler = trainer.model, trainer.optimizer, trainer.scaler
    model.train()
    evaluate = Evaluator(workload, source, spec.eval_batch or micro, device, trainer.forward_autocast)
    path = checkpoint_path(checkpoints, spec.run_id)
    state = {"step": 0, "samples": 0, "train_sum": 0.0, "train_samples": 0, "best_val": math.inf,
             "initial_val": None, "last_train": None, "last_val": None, "seconds": 0.0}
    if path.exists():
        saved = torch.load(path, map_location=device, weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        if scaler is not None and "scaler" in saved:
            scaler.load_state_dict(saved["scaler"])
        state = saved["state"]
        _set_rng_state(saved["rng"])
        store.drop_points_after(spec.run_id, state["step"])
        say(f"batch {b}, lr {spec.lr:g}: resuming at step {state['step']:,}/{steps:,}")
    else:
        store.drop_points_after(spec.run_id, -1)
    store.update_run(spec.run_id, status="running", steps=steps, micro_batch=micro,
                     accumulation_steps=b // micro, started=time.time(), error=None, worker=f"pid {os.getpid()}")
    def require_finite(loss: float, what: str, step: int) -> None:
        # SQLite stores NaN as NULL, which the curve refuses: stop the run here with what it is,
        # keeping what was measured before (its curve points, steps and time).
        if not math.isfinite(loss):
            store.update_run(spec.run_id, seconds=state["seconds"] + time.perf_counter() - started)
            raise NonFiniteLoss(f"the {what} loss is not finite ({loss}) at step {step:,} of {steps:,}: the "
                                "run diverged and stopped there (its curve up to step "
                                f"{store.run(spec.run_id)['steps_done'] or 0:,} "
                                "is kept); lower `lrs`, or keep `grad_clip`")

    if state["step"] == 0 and state["initial_val"] is None:
        state["initial_val"] = evaluate(model)
        require_finite(state["initial_val"], "initial validation", 0)
        state["last_val"] = state["initial_val"]
        store.add_point(spec.run_id, 0, "val", 0, 0 if tokens_per_sample else None, state["initial_val"])
        store.update_run(spec.run_id, initial_val_loss=state["initial_val"])

    def consumed(samples: int) -> int:
        return samples * per_sample

    while state["step"] < steps:
        lr = spec.lr * spec.schedule.factor(consumed(state["samples"] + b))
        pieces = [(micro, source.train(state["samples"] + i * micro, micro, device)) for i in range(b // micro)]
        result = trainer.step(pieces, b, lr=lr, max_grad_norm=spec.grad_clip or None)
        del pieces
        loss = result.loss
        require_finite(loss, "training", state["step"] + 1)
        if not result.stepped:  # not an error: the scaler lowered its scale, the next step goes on
            state["skipped"] = state.get("skipped", 0) + 1
        before = consumed(state["samples"])
        state["step"] += 1
        state["samples"] += b
        state["train_sum"] += loss * b
        state["train_samples"] += b
        after = consumed(state["samples"])
        if after // spec.eval_every > before // spec.eval_every or state["step"] == steps:
            state["last_train"] = state["train_sum"] / state["train_samples"]
            state["train_sum"], state["train_samples"] = 0.0, 0
            state["last_val"] = evaluate(model)
            require_finite(state["last_val"], "validation", state["step"])
            state["best_val"] = min(state["best_val"], state["last_val"])
            tokens = state["samples"] * tokens_per_sample if tokens_per_sample else None
            store.add_point(spec.run_id, state["step"], "train", state["samples"], tokens, state["last_train"], lr)
            store.add_point(spec.run_id, state["step"], "val", state["samples"], tokens, state["last_val"], lr)
            store.update_run(spec.run_id, steps_done=state["step"],
                             seconds=state["seconds"] + time.perf_counter() - started)
            say(f"batch {b}, lr {spec.lr:g}: step {state['step']:,}/{steps:,}, "
                f"train {state['last_train']:.4f}, val {state['last_val']:.4f}"
                + (f" ({state['skipped']} steps skipped by the fp16 loss scaler)" if state.get("skipped") else ""))
        if after // spec.checkpoint_every > before // spec.checkpoint_every and state["step"] < steps:
            _save(path, trainer, {**state, "seconds": state["seconds"] + time.perf_counter() - started})
    seconds = state["seconds"] + time.perf_counter() - started
    store.update_run(spec.run_id, status="done", steps_done=steps, samples=state["samples"],
                     tokens=state["samples"] * tokens_per_sample if tokens_per_sample else None,
                     final_train_loss=state["last_train"], final_val_loss=state["last_val"],
                     best_val_loss=min(state["best_val"], state["last_val"]), seconds=seconds,
                     finished=time.time())
    path.unlink(missing_ok=True)
    return store.run(spec.run_id)


def _save(path: Path, trainer: TrainingStep, state: dict) -> None:
    """Write the whole checkpoint to a temporary file, then rename it over the old one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    saved = {"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict(), "state": dict(state),
             "rng": _rng_state()}
    if trainer.scaler is not None:
        saved["scaler"] = trainer.scaler.state_dict()
    torch.save(saved, tmp)
    os.replace(tmp, path)
