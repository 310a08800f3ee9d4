"""The point measurement every engine shares: a traced step as a GPU would report it.

``MemoryPoint`` is one traced batch size as ``torch.cuda.max_memory_allocated()`` would show
it (the step's tensors plus the cuBLAS workspaces). ``TracedCurve`` traces a workload at the
batch sizes asked for, fits the memory curve through them, and finds the largest batch
under a limit by tracing it and the next size up, so every answer is a traced one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from batchfit.devices import Device
from batchfit.search import SearchResult, Trial, guided
from batchfit.trace.curve import MemoryCurve, fit_curve
from batchfit.trace.session import TracePoint, TraceSession
from batchfit.workload import StepOptions, Workload


@dataclass
class MemoryPoint:
    """One traced batch size."""

    batch_size: int
    peak_bytes: int
    """Traced peak plus the cuBLAS workspace: what max_memory_allocated() would show."""
    breakdown: dict[str, int]
    phase: str
    peak_by_phase: dict[str, int]
    top: list[dict]

    def to_json(self) -> dict:
        return {"batch_size": self.batch_size, "peak_bytes": self.peak_bytes,
                "breakdown": self.breakdown, "phase": self.phase,
                "peak_by_phase": self.peak_by_phase, "largest_tensors": self.top}


def allocated_point(traced: TracePoint, workspace_bytes: int) -> MemoryPoint:
    """A traced step as ``max_memory_allocated()`` would show it: plus the cuBLAS workspace."""
    snap = traced.snapshot
    return MemoryPoint(
        batch_size=traced.batch_size, peak_bytes=snap.peak_bytes + workspace_bytes,
        breakdown={**snap.breakdown, "workspace": workspace_bytes}, phase=snap.phase,
        peak_by_phase={k: v + workspace_bytes for k, v in snap.peak_by_phase.items()},
        top=snap.top,
    )


class TracedCurve:
    """A workload on fake tensors, traced at batch sizes on demand (each size once)."""

    def __init__(self, workload: Workload, options: StepOptions, device: Device,
                 say: Callable[[str], None] | None = None) -> None:
        self.device = device
        self.say = say or (lambda message: None)
        self.say(f"building {workload.name} on fake tensors")
        self.session = TraceSession(workload, options)
        self.points: dict[int, MemoryPoint] = {}

    def point(self, batch_size: int) -> MemoryPoint:
        if batch_size not in self.points:
            self.say(f"tracing batch size {batch_size}")
            traced = self.session.trace(batch_size)
            self.points[batch_size] = allocated_point(traced, self.device.workspace_bytes)
        return self.points[batch_size]

    def curve(self) -> MemoryCurve:
        return fit_curve({b: p.peak_by_phase for b, p in self.points.items()})

    def max_batch(self, limit_bytes: int, *, lo: int, hi: int, multiple_of: int) -> SearchResult:
        """The largest multiple of ``multiple_of`` in [lo, hi] whose traced peak is under
        ``limit_bytes``: the curve predicts it, tracing it and the next size up confirms it."""

        def probe(batch_size: int) -> Trial:
            peak = self.point(batch_size).peak_bytes
            return Trial(batch_size, "ok" if peak <= limit_bytes else "oom", peak_allocated_bytes=peak)

        known = [probe(b) for b in self.points]
        return guided(probe, lambda trials: self.curve().max_batch_size(limit_bytes, multiple_of),
                      lo=lo, hi=hi, multiple_of=multiple_of, known=known)

    def close(self) -> None:
        self.session.close()

    def __enter__(self) -> TracedCurve:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
