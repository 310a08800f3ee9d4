"""One strategy's step traced at local batch sizes on demand: plan's memory curve and its reserved probes.

``ShardedCurve`` is what ``search.curve_search`` (``estimate``'s search too) asks: a traced point per
size, its reserved peak (rank 0's fresh process replayed through the allocator model,
``plan/reserved.py``), and the fit through the points. Where the session writes a size's stream from
the line through traced ones (``trace/stream_line.py``), the reserved search reads that replay alone
(:class:`ReplayedSize`) and no step is traced at the size unless it becomes an answer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from batchfit.devices import Device
from batchfit.errors import OptionError
from batchfit.plan.result import PlanPoint, plan_point
from batchfit.search import SearchResult, curve_search
from batchfit.trace.curve import MemoryCurve, envelope
from batchfit.workload import StepOptions, Workload


class PointSession:
    """A session over a tracer of one point at a time: ``trace(workload, options, device,
    strategy, local_batch)`` (a stand-in, or a caller's own), and ``replay`` of the same
    arguments for the reserved peak (a ``plan.reserved.ReservedReplay``), when given."""

    def __init__(self, trace: Callable, workload: Workload, options: StepOptions, device: Device, strategy, *,
                 replay: Callable | None = None) -> None:
        self.trace = lambda local_batch: trace(workload, options, device, strategy, local_batch)
        if replay is not None:
            self.reserved = lambda local_batch: replay(workload, options, device, strategy, local_batch)

    def close(self) -> None:
        pass


class ShardedCurve:
    """One strategy's step traced at local batch sizes on demand (each size once), with
    ``estimate``'s fit and confirmation on top."""

    def __init__(self, trace_point: Callable[[int], object], workspace_bytes: int,
                 say: Callable[[str], None], replay: Callable[[int], object] | None = None,
                 replay_first: bool = False, known: Callable[[int, bool], bool] | None = None) -> None:
        self._trace, self._workspace, self._say, self._replay = trace_point, workspace_bytes, say, replay
        self._replay_first = replay_first
        """Replay a size not traced yet before tracing it: the replay's fresh trace gives its
        point too (``DeepSession.replay_gives_point``), one trace of the size instead of two."""
        self._known = known or (lambda local_batch, reserved: False)
        """Whether a size (its trace, or with ``reserved`` its replay) costs nothing here: a row
        derived from another's traces reads them without a progress line."""
        self.points: dict[int, PlanPoint] = {}
        self.replayed_only: dict[int, ReplayedSize] = {}
        """Sizes only replayed, from a stream written by a line (no step traced there yet)."""
        self.first = None
        """The first ShardedPoint traced (its parameter counts)."""

    def point(self, local_batch: int) -> PlanPoint:
        if local_batch not in self.points:
            if not self._known(local_batch, False):
                self._say(f"local batch {local_batch}")
            traced = self._trace(local_batch)
            self.first = self.first or traced
            self.points[local_batch] = plan_point(traced, self._workspace)
        return self.points[local_batch]

    def reserved(self, local_batch: int) -> PlanPoint:
        """The point with its reserved peak: rank 0's fresh process replayed through the
        allocator model (``plan/reserved.py``), once per size. A size not traced yet is
        replayed first where the replay's fresh trace gives its point too (``replay_first``)."""
        only = self.replayed_only.pop(local_batch, None)
        return self._with_replay(local_batch, only.reserved if only else self._replay_new(local_batch))

    def reserved_probe(self, local_batch: int) -> PlanPoint | ReplayedSize:
        """The reserved search's probe: :meth:`reserved`, but where the replay's stream was written
        from a line through traced ones, the replay alone (its step is traced if it becomes an answer)."""
        if local_batch in self.replayed_only:
            return self.replayed_only[local_batch]
        replayed = self._replay_new(local_batch)
        if replayed is not None and replayed.written:
            self.replayed_only[local_batch] = ReplayedSize(local_batch, replayed, self.curve().peak_bytes(local_batch))
            return self.replayed_only[local_batch]
        return self._with_replay(local_batch, replayed)

    def _replay_new(self, local_batch: int):
        """The size's replay, where it comes before its point (``replay_first``); None otherwise."""
        if self._replay is None or not self._replay_first or local_batch in self.points:
            return None
        self._say(f"local batch {local_batch}: reserved memory (allocator model)")
        return self._replay(local_batch)

    def _with_replay(self, local_batch: int, replayed) -> PlanPoint:
        if self._replay is None:
            self.point(local_batch)
            raise OptionError("this tracer cannot replay reserved memory: use `limit` allocated")
        point = self.point(local_batch)
        if point.reserved is None:
            if replayed is None:
                if not self._known(local_batch, True):
                    self._say(f"local batch {local_batch}: reserved memory (allocator model)")
                replayed = self._replay(local_batch)
            point.reserved = replayed
        return point

    def curve(self) -> MemoryCurve:
        """``estimate``'s fit: the upper envelope of one line per phase (under pp<N>, per pipeline
        rank too) through the two largest sizes traced (``trace.curve.envelope``), each fixed (the
        rank's shards of parameters, gradients, optimizer state) plus per sample."""
        return envelope({b: p.curve_peaks for b, p in self.points.items()})

    def max_batch(self, limit_bytes: int, *, lo: int, hi: int, multiple_of: int,
                  reserved: bool = False, host_limit_bytes: int | None = None) -> SearchResult:
        """The largest multiple of ``multiple_of`` in [lo, hi] whose traced peak (reserved with
        ``reserved``, searched at or below the allocated answer) is under ``limit_bytes`` (and whose
        offloaded host bytes are under ``host_limit_bytes``, when given): ``search.curve_search``,
        estimate's search too."""
        return curve_search(self, limit_bytes, lo=lo, hi=hi, multiple_of=multiple_of, reserved=reserved,
                            host_limit_bytes=host_limit_bytes)




@dataclass(frozen=True)
class ReplayedSize:
    """A local batch replayed through the allocator model from a stream written by the line through
    traced ones (``trace/stream_line.py``), its step not traced: what the reserved search reads of it."""

    local_batch: int
    reserved: object
    """The replay (a ``plan.reserved.ReservedReplay``, ``written``)."""
    peak_bytes: int
    """The allocated curve's fit at this size (not traced): what the search solves its next guess on."""

    @property
    def peak_reserved_bytes(self) -> int | None:
        return self.reserved.peak_reserved_bytes

    @property
    def reserved_oom(self) -> str | None:
        return self.reserved.reserved_oom

    @property
    def reserved_ratio(self) -> float:
        return self.reserved.reserved_ratio
