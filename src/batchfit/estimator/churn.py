"""Allocator churn over a run's steps (``estimate --data --replay-steps K``).

A batch whose worst step fits in a fresh process can still run out later: as the lengths
change from step to step, the caching allocator splits and caches blocks of one size that the
next step cannot use, reserving more until it cannot place a block. So the first K steps of the
run, at their own shapes in the data's order, run on fake tensors one after another in one
process (one model, one optimizer: step 0 makes its state, as a real run's first step does),
and the whole allocation stream, from the model's build on, goes through the allocator model
(``trace/allocator.py``, only called here) twice: with the user's ``PYTORCH_ALLOC_CONF`` and
with ``expandable_segments:True``. Reserved memory is read at every step.

The verdict: ``fits``; ``fits only with expandable_segments`` (the default allocator cannot
place a block at some step, the expandable one can); or ``does not fit`` (from that step on).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from batchfit.devices import Device
from batchfit.estimator.batching import Shape
from batchfit.trace.allocator import AllocatorConfig, AllocatorOutOfMemory
from batchfit.trace.point import new_allocator
from batchfit.workload import StepOptions

EXPANDABLE = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
EXPANDABLE_COST = ("expandable segments cannot be shared with another process over CUDA IPC (torch.multiprocessing "
                   "sending CUDA tensors: PyTorch refuses them) and are not used by CUDA graphs' private memory pools")


@dataclass
class StepMemory:
    """One step of the replay, as torch.cuda.memory_stats would show it."""

    step: int
    rows: int
    length: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    reserved_bytes: int
    """Reserved at the step's end."""
    fragmentation_bytes: int
    """Reserved but not allocated at the step's end (the cache)."""
    routing: str | None = None
    """The MoE routing this step ran with, where ``--routing`` varies by step (None: one routing for all)."""


@dataclass
class Replay:
    """The allocation stream of K steps through one allocator configuration."""

    config: str
    steps: list[StepMemory] = field(default_factory=list)
    first_oom_step: int | None = None
    oom: str | None = None

    def to_json(self) -> dict:
        return {"config": self.config, "steps": [dataclasses.asdict(s) for s in self.steps],
                "first_oom_step": self.first_oom_step, "oom": self.oom}


@dataclass
class Churn:
    batch_size: int
    default: Replay
    expandable: Replay
    order: str = "data"
    """The steps' order: the data's, or one of :data:`ORDERS` (``--replay-order worst``)."""

    @property
    def verdict(self) -> str:
        if self.default.first_oom_step is None:
            return "fits"
        if self.expandable.first_oom_step is None:
            return f"fits only with {EXPANDABLE}"
        return f"does not fit, first at step {self.default.first_oom_step}"

    @property
    def peak(self) -> StepMemory | None:
        """The step with the largest allocated peak (the first of equals) of the replay with the user's settings."""
        return max(self.default.steps, key=lambda s: s.peak_allocated_bytes, default=None)

    def line(self) -> str:
        replay = self.default
        steps = len(replay.steps) + (replay.first_oom_step is not None)
        worst = max(replay.steps, key=lambda s: s.fragmentation_bytes, default=None)
        order = "" if self.order == "data" else f" in {self.order} order"
        text = f"allocator replay of {steps} steps at batch {self.batch_size}{order}: {self.verdict}"
        if worst is not None:
            text += (f"; reserved {replay.steps[0].reserved_bytes / 2**30:.2f} GiB after step 0, "
                     f"{replay.steps[-1].reserved_bytes / 2**30:.2f} GiB after step {replay.steps[-1].step}; "
                     f"most cached but unallocated {worst.fragmentation_bytes / 2**30:.2f} GiB (step {worst.step})")
        peak = self.peak
        if peak is not None and peak.routing is not None:
            text += (f"; the run's peak is step {peak.step}'s, {peak.peak_allocated_bytes / 2**30:.2f} GiB allocated "
                     f"(--routing {peak.routing} there)")
        if self.default.first_oom_step is not None and self.expandable.first_oom_step is None:
            text += f" (its cost: {EXPANDABLE_COST})"
        return text

    def to_json(self) -> dict:
        peak = self.peak
        return {"batch_size": self.batch_size, "order": self.order, "verdict": self.verdict,
                "first_oom_step": self.default.first_oom_step,
                "peak_step": peak.step if peak else None, "peak_bytes": peak.peak_allocated_bytes if peak else None,
                "default": self.default.to_json(), "expandable_segments": self.expandable.to_json()}


def step_streams(at, shapes: list[Shape], options: StepOptions) -> tuple[list[tuple[str, int, int]], list[int]]:
    """The allocation stream of a fresh process that builds the model and runs ``shapes`` in
    order (``at``: ``estimator.run.Lengths``), and where each step's events begin (and the last ends)."""
    from batchfit.trace.session import TraceSession  # the tracer (torch): only here

    with TraceSession(at.varying([s.length for s in shapes]), options) as session:
        marks = [len(session.tracker.events)]
        with session.tracing(f"running {len(shapes)} steps of the run"):
            for step, shape in enumerate(shapes):
                at.length = shape.length
                if session.routed is not None:  # --routing per step: this step's
                    session.routed.routing = options.routing_schedule.at(step)
                session.step.run(shape.rows, hooks=session.tracker)
                marks.append(len(session.tracker.events))
        return list(session.tracker.events), marks


def replay(events: list[tuple[str, int, int]], marks: list[int], shapes: list[Shape], device: Device,
           config: AllocatorConfig, name: str, routings: list[str] | None = None) -> Replay:
    """Reserved memory step by step, and the first step whose block the allocator cannot place
    (``routings``: each step's MoE routing, where it varies)."""
    out = Replay(name)
    try:  # the cuBLAS workspaces and the build, before step 0: running out there is at step 0
        allocator = new_allocator(device, config)
        allocator.apply(events[:marks[0]])
        for step, shape in enumerate(shapes):
            stats = allocator.stats  # reset the peaks, as torch.cuda.reset_peak_memory_stats() does
            stats.peak_allocated_bytes, stats.peak_reserved_bytes = stats.allocated_bytes, stats.reserved_bytes
            allocator.apply(events[marks[step]:marks[step + 1]])
            out.steps.append(StepMemory(step, shape.rows, shape.length, stats.peak_allocated_bytes,
                                        stats.peak_reserved_bytes, stats.reserved_bytes, stats.fragmentation_bytes,
                                        routings[step] if routings else None))
    except AllocatorOutOfMemory as error:
        out.first_oom_step, out.oom = len(out.steps), str(error)
    return out


ORDERS = ("ascending", "alternating")
"""The other orders ``--replay-order worst`` replays the same steps in: ascending length (every step
longer than all before it, so no cached block is large enough and each one reserves anew) and
longest-shortest alternating (the cache split by a long step, then asked for other sizes)."""


def reordered(shapes: list[Shape], order: str) -> list[Shape]:
    """``shapes`` (the same steps) in ``order``: 'data' (as given), or one of :data:`ORDERS`."""
    if order == "data":
        return list(shapes)
    ranked = sorted(shapes, key=lambda s: (s.length, s.rows))
    if order == "ascending":
        return ranked
    out = []
    while ranked:  # the longest, the shortest, the next longest, ...
        out.append(ranked.pop())
        if ranked:
            out.append(ranked.pop(0))
    return out


def badness(run: Churn) -> tuple[int, int]:
    """How badly a replay ends: (0 fits, 1 only with expandable segments, 2 does not fit; the most
    reserved-but-unallocated bytes at a step's end): steps count in each order's own sequence, so
    an earlier failing step is no worse across orders."""
    kind = 0 if run.default.first_oom_step is None else 1 if run.expandable.first_oom_step is None else 2
    return kind, max((s.fragmentation_bytes for s in run.default.steps), default=0)


def worst_order(at, shapes: list[Shape], batch_size: int, options: StepOptions, device: Device,
                config: AllocatorConfig | None = None) -> Churn:
    """``shapes`` replayed in each of :data:`ORDERS`: the one that ends worst (:func:`badness`)."""
    runs = [dataclasses.replace(churn(at, reordered(shapes, order), batch_size, options, device, config), order=order)
            for order in ORDERS]
    return max(runs, key=badness)


def churn(at, shapes: list[Shape], batch_size: int, options: StepOptions, device: Device,
          config: AllocatorConfig | None = None) -> Churn:
    """``shapes`` (the run's first steps at ``batch_size``) replayed with the user's allocator
    settings and with expandable segments."""
    config = config if config is not None else AllocatorConfig.from_env()
    events, marks = step_streams(at, shapes, options)
    schedule = options.routing_schedule
    routings = [str(schedule.at(step)) for step in range(len(shapes))] if schedule.varies else None
    return Churn(batch_size, replay(events, marks, shapes, device, config, "default", routings),
                 replay(events, marks, shapes, device, dataclasses.replace(config, expandable_segments=True),
                        "expandable_segments", routings))
