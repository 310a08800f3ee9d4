"""``estimate --eval-batch-size N``: the evaluation loop's peak beside the training step's.

A run that fits its training step can still die in its first evaluation: HF Trainer evaluates
with ``per_device_eval_batch_size`` (often larger than the training batch, "no gradients"),
keeps the model's whole output (the logits, ``[batch, tokens, vocab]``) alive through the step,
and with ``compute_metrics`` keeps every step's logits on the device until
``eval_accumulation_steps`` steps are moved to the host. The optimizer state and the model stay
where training left them.

So one process on fake tensors does what the run does: builds the model, runs one training step
at the training answer's worst shape (the optimizer state exists from then on, as in the run),
then the evaluation loop (``TrainingStep.evaluate``) at each deciding eval shape. The eval
window's allocated peak is the tracker's; its reserved peak is the whole stream replayed through
the allocator model (the cache the training step left is what evaluation allocates from).
The largest eval batch that fits is found by bisection when the asked one does not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from batchfit.devices import Device
from batchfit.estimator.batching import Shape, deciding_steps
from batchfit.trace.allocator import AllocatorConfig, AllocatorOutOfMemory
from batchfit.trace.approximation import Approximation
from batchfit.trace.point import new_allocator
from batchfit.workload import StepOptions, Workload

ShapesAt = Callable[[int], list[Shape]]
"""eval batch size -> the shape of every eval step over the data, in its order."""


@dataclass
class EvalPoint:
    """The evaluation loop at one eval batch size: its worst step."""

    batch_size: int
    peak_shape: Shape
    peak_bytes: int
    """Allocated peak of the eval window, with the cuBLAS workspace (max_memory_allocated)."""
    peak_reserved_bytes: int | None
    """Reserved peak of the eval window (None: the allocator model could not place a block)."""
    oom: str | None = None
    expandable_reserved_bytes: int | None = None
    """Where it could not place a block: the reserved peak with ``expandable_segments:True`` (None: nor there)."""

    def fits(self, device: Device, limit: str) -> bool:
        if limit != "reserved":
            return self.peak_bytes <= device.usable_bytes
        return (self.peak_reserved_bytes is not None
                and max(self.peak_bytes, self.peak_reserved_bytes) <= device.usable_bytes)

    def to_json(self) -> dict:
        return {"batch_size": self.batch_size, "peak_rows": self.peak_shape.rows, "peak_length": self.peak_shape.length,
                "peak_bytes": self.peak_bytes, "peak_reserved_bytes": self.peak_reserved_bytes, "oom": self.oom,
                "expandable_reserved_bytes": self.expandable_reserved_bytes}


@dataclass
class EvalPhase:
    """The eval phase beside the train step: rendered by report/ (no torch)."""

    batch_size: int
    """--eval-batch-size (per_device_eval_batch_size)."""
    held_steps: int
    """Eval steps whose logits stay on the device together (eval_accumulation_steps; 1: only the step's own)."""
    train_batch_size: int
    train_shape: Shape
    """The training step run before it (the answer's worst step)."""
    train_peak_bytes: int
    train_peak_reserved_bytes: int | None
    asked: EvalPoint
    max_batch_size: int = 0
    """The largest eval batch (at most the asked one) whose loop fits; 0: not even 1."""
    traced: list[EvalPoint] | None = None

    @property
    def deciding_phase(self) -> str:
        """'eval' when the eval loop allocates more at its peak than the training step, else 'train'
        (allocated: reserved memory only grows, so the eval loop's is never below the step's before it)."""
        return "eval" if self.asked.peak_bytes > self.train_peak_bytes else "train"

    @property
    def fits(self) -> bool:
        return self.max_batch_size == self.batch_size

    def to_json(self) -> dict:
        return {"batch_size": self.batch_size, "held_steps": self.held_steps, "train_batch_size": self.train_batch_size,
                "train_rows": self.train_shape.rows, "train_length": self.train_shape.length,
                "train_peak_bytes": self.train_peak_bytes, "train_peak_reserved_bytes": self.train_peak_reserved_bytes,
                "peak_bytes": self.asked.peak_bytes, "peak_reserved_bytes": self.asked.peak_reserved_bytes,
                "peak_rows": self.asked.peak_shape.rows, "peak_length": self.asked.peak_shape.length,
                "verdict": "fits" if self.fits else "does not fit", "deciding_phase": self.deciding_phase,
                "max_batch_size": self.max_batch_size,
                "traced": [p.to_json() for p in self.traced or []]}


class EvalTracer:
    """One process: the model built, one training step at ``train_shape``, then eval loops on demand.

    ``workload_at(length)`` makes the workload's batches ``length`` tokens long (``estimator.run.Lengths``:
    one model, batches of any length); each eval loop is measured on its own (its window's peak,
    and the stream up to the training step's end plus its own events through the allocator model)."""

    def __init__(self, workload: Workload, set_length: Callable[[int], None], train_shape: Shape,
                 options: StepOptions, device: Device, *, held_steps: int = 1,
                 config: AllocatorConfig | None = None, cuda_semantics: bool = True) -> None:
        """``cuda_semantics=False``: what a CPU step does (the truth test's profiler compares it)."""
        self.set_length, self.device, self.held_steps = set_length, device, held_steps
        self.config = config if config is not None else AllocatorConfig.from_env()
        from batchfit.trace.session import TraceSession  # the tracer (torch): only here

        self.session = TraceSession(workload, options, cuda_semantics=cuda_semantics)
        set_length(train_shape.length)
        with self.session.tracing(f"running a training step at {train_shape.rows} x {train_shape.length} tokens"):
            self.session.step.run(train_shape.rows, hooks=self.session.tracker)
            self.session.tracker.start_window()
            self.session.step.run(train_shape.rows, hooks=self.session.tracker)
            train = self.session.tracker.snapshot()
        self.train_peak_bytes = train.peak_bytes + device.workspace_bytes
        self.after_train = len(self.session.tracker.events)
        self.train_peak_reserved_bytes, _ = self._reserved(self.session.tracker.events, 0)
        self.points: dict[Shape, EvalPoint] = {}

    def _reserved(self, events: list, window_from: int, config: AllocatorConfig | None = None
                  ) -> tuple[int | None, str | None]:
        """The reserved peak of ``events[window_from:]`` after the ones before (None and why: cannot place)."""
        allocator = new_allocator(self.device, config or self.config)
        try:
            allocator.apply(events[:window_from])
            stats = allocator.stats
            stats.peak_allocated_bytes, stats.peak_reserved_bytes = stats.allocated_bytes, stats.reserved_bytes
            allocator.apply(events[window_from:])
        except AllocatorOutOfMemory as error:
            return None, str(error)
        return allocator.stats.peak_reserved_bytes, None

    def point(self, shape: Shape) -> EvalPoint:
        if shape not in self.points:
            tracker = self.session.tracker
            self.set_length(shape.length)
            start = len(tracker.events)
            with self.session.tracing(f"running the eval loop at {shape.rows} x {shape.length} tokens"):
                tracker.start_window()
                self.session.step.evaluate(shape.rows, hooks=tracker, held_steps=self.held_steps)
                peak = tracker.snapshot().peak_bytes + self.device.workspace_bytes
            events = tracker.events[:self.after_train] + tracker.events[start:]
            reserved, oom = self._reserved(events, self.after_train)
            self.points[shape] = EvalPoint(shape.rows, shape, peak, reserved, oom)
            if oom is not None:  # fragmentation, or too much? the same stream with expandable segments
                expandable = dataclasses.replace(self.config, expandable_segments=True)
                self.points[shape].expandable_reserved_bytes = self._reserved(events, self.after_train, expandable)[0]
        return self.points[shape]

    def worst(self, batch_size: int, shapes: list[Shape]) -> EvalPoint:
        """The eval loop's worst step at ``batch_size`` over ``shapes`` (only the deciding ones traced)."""
        points = [self.point(shapes[i]) for i in deciding_steps(shapes)]
        worst = max(points, key=lambda p: (p.peak_reserved_bytes is None, p.peak_reserved_bytes or 0, p.peak_bytes))
        return dataclasses.replace(worst, batch_size=batch_size)

    def close(self) -> None:
        self.session.close()


def eval_phase(workload: Workload, set_length: Callable[[int], None], shapes_at: ShapesAt, batch_size: int,
               train_batch_size: int, train_shape: Shape, options: StepOptions, device: Device, *,
               held_steps: int = 1, limit: str = "reserved", say: Callable[[str], None] | None = None) -> EvalPhase:
    """The eval loop at ``batch_size`` after a training step at ``train_shape``; where it does not
    fit, the largest eval batch that does (bisection: the peak grows with the batch)."""
    say = say or (lambda message: None)
    say(f"tracing the eval loop at eval batch {batch_size}")
    tracer = EvalTracer(workload, set_length, train_shape, options, device, held_steps=held_steps)
    try:
        asked = tracer.worst(batch_size, shapes_at(batch_size))
        phase = EvalPhase(batch_size, held_steps, train_batch_size, train_shape, tracer.train_peak_bytes,
                          tracer.train_peak_reserved_bytes, asked)
        traced = {batch_size: asked}
        if asked.fits(device, limit):
            phase.max_batch_size = batch_size
        else:
            low, high = 0, batch_size  # low fits (0: none known), high does not
            while high - low > 1:
                middle = (low + high) // 2
                traced[middle] = tracer.worst(middle, shapes_at(middle))
                low, high = (middle, high) if traced[middle].fits(device, limit) else (low, middle)
            phase.max_batch_size = low
        phase.traced = [traced[b] for b in sorted(traced)]
        return phase
    finally:
        tracer.close()


def eval_approximations(phase: EvalPhase, options: StepOptions, varying: bool) -> list[Approximation]:
    """Where the traced eval loop is higher than the Trainer's (never lower): held logits at the worst
    step's shape (``varying``: --data), logits the Trainer skips under Liger's fused loss."""
    out = []
    if phase.held_steps > 1 and varying:
        out.append(Approximation(
            what=f"--eval-accumulation-steps {phase.held_steps}: the logits held from earlier eval steps are traced "
                 f"at the worst eval step's shape ({phase.asked.peak_shape.rows} x {phase.asked.peak_shape.length:,} "
                 "tokens)",
            may_differ_by="high by the held steps' logits beyond their own padded length (the Trainer pads the held "
                          "logits to the longest held, so never low)", source="docs/run.md, The eval loop"))
    if options.loss == "fused-linear":
        out.append(Approximation(
            what="--eval-batch-size with --loss fused-linear: the eval step makes the whole logits",
            may_differ_by="high by one eval step's logits (rows x tokens x vocabulary) where the Trainer runs Liger "
                          "without compute_metrics (skip_logits)", source="docs/run.md, The eval loop"))
    return out


def add_eval_phase(result, workload: Workload, batch_size: int, *, held_steps: int = 1, limit: str = "reserved",
                   say: Callable[[str], None] | None = None) -> None:
    """``result.eval_phase`` for one shape (no --data): the eval loop at the workload's length after a
    training step at the answer (nothing when no training batch fits: that is the answer already)."""
    if not result.max_batch_size:
        return
    length = workload.tokens_per_sample or 0
    result.eval_phase = eval_phase(workload, lambda n: None, lambda b: [Shape(b, length)], batch_size,
                                   result.max_batch_size, Shape(result.max_batch_size, length), result.options,
                                   result.device, held_steps=held_steps, limit=limit, say=say)
    result.approximations = [*result.approximations, *eval_approximations(result.eval_phase, result.options, False)]
