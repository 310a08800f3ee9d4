"""Rank 0's reserved memory: its allocation stream replayed through the caching allocator, step by step.

``plan --limit reserved`` (the default) asks what ``max_memory_reserved()`` would show on rank 0:
the allocation stream of a fresh process (the model's build, the first step, the second step)
is replayed through the model of the CUDA caching allocator (``trace/allocator.py``, the same
replay as ``estimate``'s, ``trace.point.new_allocator``). The stream is cut where each step
starts, so the answer also says *when* the peak happens: some peaks happen once, outside the
steady step (DDP holds every gradient in one bucket in the first step and rebuilds its
buckets at the start of the second: ``distributed.strategy._RebuildsOnce``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from batchfit.devices import Device
from batchfit.trace.allocator import AllocatorOutOfMemory
from batchfit.trace.point import new_allocator

STEPS = ("model build", "first step", "steady step")
"""What the stream's pieces are, in order (plain)."""
DDP_STEPS = ("model build", "first step", "second step: DDP bucket rebuild", "steady step")
"""Under DDP: the second step's start, up to the end of its bucket rebuild, is a piece of its own."""


@dataclass(frozen=True, kw_only=True)
class ReservedReplay:
    """One stream replayed."""

    peak_reserved_bytes: int | None
    """max_memory_reserved() over the whole stream; None when the allocator model ran out."""
    reserved_oom: str | None
    """The allocator model's out-of-memory message, when it could not reserve a segment."""
    reserved_ratio: float
    """Peak reserved over peak allocated; when it ran out, what it held and asked for over
    what was allocated then (the reserved search predicts the next size with it)."""
    peak_step: int
    """Where the reserved peak is first reached (or where it ran out): an index of ``steps``."""
    steps: tuple[str, ...]
    """The names of the stream's pieces (``STEPS`` or ``DDP_STEPS``)."""
    peak_allocated_by_step: tuple[int, ...]
    """Each piece's own allocated peak, the cuBLAS workspace included (pieces not reached: absent)."""
    peak_reserved_by_step: tuple[int, ...]
    """Reserved at the end of each piece's own peak (reserved never shrinks unless the allocator
    frees its cache to retry)."""
    written: bool = False
    """The stream was written from the line through streams traced at other sizes
    (``trace/stream_line.py``), not traced at this one."""

    @property
    def peak_step_name(self) -> str:
        return self.steps[self.peak_step]

    def to_json(self) -> dict:
        return {"peak_reserved_bytes": self.peak_reserved_bytes, "reserved_oom": self.reserved_oom,
                "peak_step": self.peak_step, "peak_step_name": self.peak_step_name,
                "by_step": [{"step": name, "peak_allocated_bytes": a, "peak_reserved_bytes": r}
                            for name, a, r in zip(self.steps, self.peak_allocated_by_step,
                                                  self.peak_reserved_by_step)]}


def replay_steps(events: list[tuple[str, int, int]], starts: tuple[int, ...], device: Device,
                 streams: Mapping[int, int] | None = None, *, written: bool = False) -> ReservedReplay:
    """Replay ``events`` (a fresh process's stream) on ``device``'s allocator model; ``starts``
    are where each piece after the build begins (two, or three under DDP: ``ShardedSession.fresh_steps``);
    ``streams`` names the side stream of each malloc made on one (``MemoryTracker.streams``: FSDP2's
    all-gather and reduce-scatter buffers), whose blocks the allocator keeps apart; ``written``: the
    stream was written from a line through traced ones (:attr:`ReservedReplay.written`)."""
    steps = DDP_STEPS if len(starts) == 3 else STEPS
    bounds = (0, *starts, len(events))
    allocator = new_allocator(device)
    stats = allocator.stats
    allocated: list[int] = []
    reserved: list[int] = []
    for i, (begin, end) in enumerate(zip(bounds, bounds[1:])):
        stats.peak_allocated_bytes, stats.peak_reserved_bytes = stats.allocated_bytes, stats.reserved_bytes
        try:
            allocator.apply(events[begin:end], streams)
        except AllocatorOutOfMemory as error:
            needed = (error.reserved_bytes + error.segment_bytes) / (error.allocated_bytes + error.requested_bytes)
            return ReservedReplay(peak_reserved_bytes=None, reserved_oom=str(error), reserved_ratio=needed,
                                  peak_step=i, steps=steps, peak_allocated_by_step=tuple(allocated),
                                  peak_reserved_by_step=tuple(reserved), written=written)
        allocated.append(stats.peak_allocated_bytes)
        reserved.append(stats.peak_reserved_bytes)
    peak = max(reserved)
    at = reserved.index(peak)
    return ReservedReplay(peak_reserved_bytes=peak, reserved_oom=None, reserved_ratio=peak / max(allocated),
                          peak_step=at, steps=steps, peak_allocated_by_step=tuple(allocated),
                          peak_reserved_by_step=tuple(reserved), written=written)
