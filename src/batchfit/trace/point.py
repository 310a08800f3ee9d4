"""The point measurement every engine shares: a traced step as a GPU would report it.

``MemoryPoint`` is one traced batch size as ``torch.cuda.max_memory_allocated()`` would show
it (the step's tensors plus the cuBLAS workspaces). ``TracedCurve`` traces a workload at the
batch sizes asked for, fits the memory curve through them, and finds the largest batch
under a limit by tracing it and the next size up, so every answer is a traced one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from batchfit.devices import Device
from batchfit.search import SearchResult, Trial, guided
from batchfit.trace import depth
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
    breakdown_by_phase: dict[str, dict[str, int]] = field(default_factory=dict)
    """The breakdown at each phase's own peak (``breakdown`` is the one at the step's peak)."""

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
        breakdown_by_phase={k: {**v, "workspace": workspace_bytes} for k, v in snap.breakdown_by_phase.items()},
    )


class TracedCurve:
    """A workload on fake tensors, traced at batch sizes on demand (each size once).

    A model with a deep stack of identical blocks is traced at depths 1, 2 and 3 and
    extrapolated to its full depth where the three lie exactly on a line (``trace/depth.py``),
    else traced whole: the same bytes, several times faster for a 32-layer model.
    """

    def __init__(self, workload: Workload, options: StepOptions, device: Device,
                 say: Callable[[str], None] | None = None, *, by_depth: bool = True) -> None:
        self.workload, self.options, self.device = workload, options, device
        self.say = say or (lambda message: None)
        self.say(f"building {workload.name} on fake tensors")
        self.points: dict[int, MemoryPoint] = {}
        self.blocks: int | None = None
        """Blocks of the full model, when traced by depth."""
        self.full_traces: list[int] = []
        """Batch sizes traced on the whole model (all of them unless traced by depth)."""
        self._shallow: list[TraceSession] = []
        self._full: TraceSession | None = None
        seen = depth.Depth()
        first = TraceSession(depth.at_depth(workload, depth.DEPTHS[0], seen) if by_depth else workload, options)
        if by_depth and seen.blocks and seen.blocks >= depth.MIN_BLOCKS:
            self.blocks = seen.blocks
            self._shallow = [first] + [TraceSession(depth.at_depth(workload, d, seen), options)
                                       for d in depth.DEPTHS[1:]]
        else:  # nothing was cut: the first session is the whole model
            self._full = first

    @property
    def known_limits(self) -> list[str]:
        """What this model runs that the trace does not mirror, in words for the report."""
        session = self._full or self._shallow[0]
        recurrent = sorted({type(m).__name__ for m in session.step.model.modules() if isinstance(m, nn.RNNBase)})
        if not recurrent:
            return []
        return [f"{', '.join(recurrent)} layers are traced with the CPU kernels (mkldnn_rnn_layer, or a loop "
                "of cells): on a GPU cuDNN runs them and keeps its own workspace and reserve space, which "
                "this trace does not count"]

    @property
    def by_depth(self) -> bool:
        return bool(self._shallow)

    def _count(self, attribute: str) -> int:
        if self._full is not None:
            return getattr(self._full, attribute)
        return depth.line_at([getattr(s, attribute) for s in self._shallow], self.blocks)

    @property
    def params(self) -> int:
        return self._count("params")

    @property
    def trainable_params(self) -> int:
        return self._count("trainable_params")

    def point(self, batch_size: int) -> MemoryPoint:
        if batch_size in self.points:
            return self.points[batch_size]
        workspace = self.device.workspace_bytes
        found = None
        if self._shallow:
            self.say(f"tracing batch size {batch_size} at depths {', '.join(map(str, depth.DEPTHS))} "
                     f"of {self.blocks}")
            shallow = [allocated_point(s.trace(batch_size), workspace) for s in self._shallow]
            found = depth.extrapolate(shallow, self.blocks)
        if found is None:  # not traced by depth, or not affine in depth: the whole model
            if self._full is None:
                self.say(f"memory is not affine in depth here: building the whole {self.workload.name}")
                self._full = TraceSession(self.workload, self.options)
            self.say(f"tracing batch size {batch_size}")
            found = allocated_point(self._full.trace(batch_size), workspace)
            self.full_traces.append(batch_size)
        self.points[batch_size] = found
        return found

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
        for session in [*self._shallow, *([self._full] if self._full else [])]:
            session.close()

    def __enter__(self) -> TracedCurve:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
