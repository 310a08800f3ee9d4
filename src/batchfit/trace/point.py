"""The point measurement every engine shares: a traced step as a GPU would report it.

``MemoryPoint`` is one traced batch size as ``torch.cuda.max_memory_allocated()`` would show
it (the step's tensors plus the cuBLAS workspaces), and, where asked, as
``max_memory_reserved()`` would: the traced allocations of a fresh process at that batch
size (model build, first step, second step) replayed through the model of the CUDA caching
allocator (``trace/allocator.py``), which frees its cache and retries before it runs out,
as the real one does. ``TracedCurve`` traces a workload at the batch sizes asked for, fits
the memory curve through them, and finds the largest batch under a limit by tracing it and
the next size up, so every answer is a traced one.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from batchfit.devices import Device
from batchfit.search import (
    SearchResult,
    curve_search,
    host_fits,  # noqa: F401 - estimator/ imports it from here
)
from batchfit.trace import cache as trace_cache
from batchfit.trace import depth, forked, repeats, stream, written
from batchfit.trace.allocator import AllocatorConfig, AllocatorOutOfMemory, CachingAllocator
from batchfit.trace.approximation import Approximation
from batchfit.trace.curve import MemoryCurve, fit_curve
from batchfit.trace.deferred import resolved
from batchfit.trace.snapshot import TracePoint

if TYPE_CHECKING:  # the tracer (torch) is imported where something is traced: a cached answer needs none
    from batchfit.trace.session import TraceSession
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
    peak_by_part: dict[str, int] = field(default_factory=dict)
    """Each phase's peak by part ('backward:last'; ``memory.PARTS``), for ``trace.depth``."""
    breakdown_by_part: dict[str, dict[str, int]] = field(default_factory=dict)
    peak_reserved_bytes: int | None = None
    """What max_memory_reserved() would show (allocator model); None when not replayed."""
    reserved_oom: str | None = None
    """The allocator model's out-of-memory message, when the step cannot reserve its memory."""
    reserved_ratio: float | None = None
    """Reserved over allocated: at the peak, or (when it ran out) what it held and asked for
    over what was allocated then; the search predicts the next size with it."""
    host_peak_bytes: int = 0
    """Host bytes the step holds at once for ``--offload`` (pinned, rounded to powers of two as
    PyTorch's host allocator does); 0 without offload."""
    host_reserved_bytes: int = 0
    """Pinned host memory the process holds after the step (the host allocator caches its blocks):
    what ``--host-memory`` is checked against."""
    offloaded_bytes: int = 0
    """Bytes the step copies to the host (and, for activations, back): the transfer time's bytes."""
    paged_bytes: int = 0
    """Paged optimizer state (bitsandbytes' paged optimizers): CUDA unified memory, outside the
    caching allocator, so not in ``peak_bytes``; it takes device memory while there is room and
    spills to the host when there is not (``trace/bnb_fake.py``)."""

    def to_json(self) -> dict:
        return {"batch_size": self.batch_size, "peak_bytes": self.peak_bytes,
                "peak_reserved_bytes": self.peak_reserved_bytes, "reserved_oom": self.reserved_oom,
                "breakdown": self.breakdown, "phase": self.phase,
                "peak_by_phase": self.peak_by_phase, "largest_tensors": self.top,
                "host_peak_bytes": self.host_peak_bytes, "host_reserved_bytes": self.host_reserved_bytes,
                "offloaded_bytes": self.offloaded_bytes, "paged_bytes": self.paged_bytes}


def allocated_point(traced: TracePoint, workspace_bytes: int) -> MemoryPoint:
    """A traced step as ``max_memory_allocated()`` would show it: plus the cuBLAS workspace."""
    snap = traced.snapshot
    return MemoryPoint(
        batch_size=traced.batch_size, peak_bytes=snap.peak_bytes + workspace_bytes,
        breakdown={**snap.breakdown, "workspace": workspace_bytes}, phase=snap.phase,
        peak_by_phase={k: v + workspace_bytes for k, v in snap.peak_by_phase.items()},
        top=snap.top,
        breakdown_by_phase={k: {**v, "workspace": workspace_bytes} for k, v in snap.breakdown_by_phase.items()},
        peak_by_part={k: v + workspace_bytes for k, v in snap.peak_by_part.items()},
        breakdown_by_part={k: {**v, "workspace": workspace_bytes} for k, v in snap.breakdown_by_part.items()},
        host_peak_bytes=snap.host_peak_bytes, host_reserved_bytes=snap.host_reserved_bytes,
        offloaded_bytes=snap.offloaded_bytes,
        paged_bytes=traced.paged_bytes,
    )


def _new_session(workload: Workload, options: StepOptions) -> TraceSession:
    """A trace session (the tracer, and torch with it, imported on the first)."""
    from batchfit.trace.session import TraceSession

    return TraceSession(workload, options)


def config_digest(config: AllocatorConfig) -> str:
    """A short name for an allocator configuration (its fields), for the trace cache's replays."""
    return hashlib.sha256(repr(config).encode()).hexdigest()[:12]


def new_allocator(device: Device, config: AllocatorConfig | None = None) -> CachingAllocator:
    """The allocator model of ``device`` as a training process finds it: the cuBLAS workspaces
    (allocated through the caching allocator, before the step's tensors) already taken."""
    allocator = CachingAllocator(device.usable_bytes, config if config is not None else AllocatorConfig.from_env())
    if device.workspace_bytes:  # (a device without one: a zero-byte request reserves nothing on a GPU)
        allocator.malloc(-1, device.workspace_bytes // 2)
        allocator.malloc(-2, device.workspace_bytes - device.workspace_bytes // 2)
    return allocator


def replay_reserved(events: list[tuple[str, int, int]], device: Device,
                    config: AllocatorConfig | None = None) -> tuple[int | None, str | None, float]:
    """(peak reserved bytes, None, reserved/allocated), or (None, the out-of-memory message,
    (reserved + the segment it asked for) / (allocated + the request)) when the allocator model
    runs out even after freeing its cache."""
    allocator = new_allocator(device, config)
    try:
        allocator.apply(events)
    except AllocatorOutOfMemory as error:
        needed = (error.reserved_bytes + error.segment_bytes) / (error.allocated_bytes + error.requested_bytes)
        return None, str(error), needed
    stats = allocator.stats
    return stats.peak_reserved_bytes, None, stats.peak_reserved_bytes / stats.peak_allocated_bytes


def run_out_at_reserved(session: TraceSession, device: Device,
                        config: AllocatorConfig | None = None) -> CachingAllocator:
    """Make ``session`` a virtual ``device`` that runs out where the caching allocator would:
    the allocator model is fed every allocation as it happens, and raises
    ``torch.OutOfMemoryError`` when it cannot reserve a segment after freeing its cache."""
    import torch

    allocator = new_allocator(device, config)
    allocator.apply(session.tracker.events)  # what building the model allocated

    def on_event(kind: str, ident: int, nbytes: int) -> None:
        message = None
        try:
            allocator.apply([(kind, ident, nbytes)])
        except AllocatorOutOfMemory as error:
            message = str(error)
        if message is not None:  # raised outside the except block: the traceback holds no frames to free
            raise torch.OutOfMemoryError(f"virtual device: {message}")

    session.tracker.on_event = on_event
    return allocator


class TracedCurve:
    """A workload on fake tensors, traced at batch sizes on demand (each size once).

    A model with a deep stack of identical blocks is traced at depths 2, 3 and 4 and
    extrapolated to its full depth where the three lie exactly on a line (``trace/depth.py``),
    else traced whole: the same bytes, several times faster for a 32-layer model.
    """

    def __init__(self, workload: Workload, options: StepOptions, device: Device,
                 say: Callable[[str], None] | None = None, *, by_depth: bool = True,
                 keep_streams: bool = False, parallel: bool = True, cache: bool = False) -> None:
        """``keep_streams``: reserved peaks will be asked for, so a traced size that may fit runs
        as a fresh process at each depth and keeps its allocation stream (one more step per
        batch size, instead of two more steps at each depth for each reserved peak).
        ``parallel``: trace the shallow depths in a forked process where there are two cores
        (``trace/forked.py``; ``BATCHFIT_PROCESSES=1`` turns it off).
        ``cache``: read and write traced sizes and replays in the trace cache (``trace/cache.py``),
        for a workload loaded from a spec; the model is built only when something is not there."""
        self.workload, self.options, self.device = workload, options, device
        self.keep_streams = keep_streams
        self._streams: dict[int, dict[int, list | None]] = {}
        self._whole_streams: dict[int, list | None] = {}
        self.say = say or (lambda message: None)
        self.points: dict[int, MemoryPoint] = {}
        self.blocks: int | None = None
        """Blocks of the full model, when traced by depth."""
        self.full_traces: list[int] = []
        """Batch sizes traced on the whole model (all of them unless traced by depth)."""
        self.whole_reserved: list[int] = []
        """Batch sizes whose reserved peak needed a whole-model trace (the stream was not regular)."""
        self._shallow: list[TraceSession] = []
        """The sessions by depth traced in this process (the deepest ones when some are forked)."""
        self._forked: forked.ForkedSessions | None = None
        """The shallowest depths, traced side by side in a forked process (``trace/forked.py``)."""
        self._params_by_depth: list[tuple[int, int]] = []
        self._full: TraceSession | None = None
        self._first: TraceSession | None = None
        self._seen = depth.Depth()
        self._by_depth, self._parallel = by_depth, parallel
        self._loops: dict[int, dict] = {}
        """By size: how its generation loop was had (:meth:`_loop_at`), traced here or read from the cache."""
        self._ahead: tuple[int, forked.ForkedCall] | None = None
        """A size traced whole, fresh, in a forked copy of the session meanwhile (:meth:`trace_ahead`)."""
        self._stack_repeats = False
        """A phase ran the stack of blocks more than once (generation, its cache growing): no size
        extrapolates (``depth._phase_lines``), so after the first every size is traced whole only."""
        self._cache = (trace_cache.for_curve(workload.cache_key, options.to_json(), by_depth=by_depth)
                       if cache else None)
        facts = self._cache.get("model") if self._cache is not None else None
        if facts is None:
            self._open()
        else:  # the model's traces are cached: it is built only if something is not there
            self.say(f"{workload.name}: reading its traces from the cache (--no-cache traces it again)")
            self.blocks, self._seen.cuts, self._params_by_depth, self._facts = facts

    def _open(self) -> None:
        """Build the model on fake tensors: at depths 2, 3 and 4 where its blocks are alike, else whole."""
        self.workload = resolved(self.workload)  # loaded, where it was known from the cache (``trace/deferred.py``)
        workload, options, seen = self.workload, self.options, self._seen
        self.say(f"building {workload.name} on fake tensors")
        self._params_by_depth = []
        # every:N: blocks differ by position; a compiled trace has no per-block parts. A step that
        # generates runs the stack once per new token, its cache growing: no size of it extrapolates
        # in depth (depth.stack_repeats), so its depths would be traced only to be thrown away (the
        # first size of seed 003's GRPO step: a fifth of its cold estimate). Traced whole, the bytes
        # are the same whatever the depths would have shown.
        by_depth = (self._by_depth and options.blocks_alike and options.compile == "none"
                    and workload.generate is None)
        self._first = first = _new_session(depth.at_depth(workload, depth.DEPTHS[0], seen) if by_depth else workload,
                                           options)
        if by_depth and first.compiled:  # the workload compiles itself: traced whole, as --compile is
            first.close()
            by_depth, self._first = False, (first := _new_session(workload, options))
        if first.compiled:  # what a compiled trace reports depends on dynamo's state too: not cached
            self._cache = None
        if by_depth and seen.blocks and seen.blocks >= depth.MIN_BLOCKS:
            self.blocks = seen.blocks
            if self._parallel and forked.can_fork():
                self._fork_shallow(first)
            else:
                self._shallow = [first] + [_new_session(depth.at_depth(workload, d, seen), options)
                                           for d in depth.DEPTHS[1:]]
            self._params_by_depth += [(s.params, s.trainable_params) for s in self._shallow]
        else:  # nothing was cut: the first session is the whole model
            self._full = first
        self._facts = {"params": self._session_params(), "repeats_micro_batches": first.tracker.repeats_micro_batches}
        if self._cache is not None:
            self._cache.put("model", (self.blocks, dict(seen.cuts), self._params_by_depth, self._facts))

    @property
    def _opened(self) -> bool:
        return self._first is not None

    def _cached(self, name: str, compute: Callable[[], object]) -> object:
        """``compute()`` on the built model, or, while it is not built, the trace cache's ``name``."""
        if not self._opened and self._cache is not None:
            found = self._cache.get(name)
            if found is not None:
                return found
        if not self._opened:
            self._open()
        value = compute()
        if self._cache is not None:
            self._cache.put(name, value)
        return value

    def _fork_shallow(self, first: TraceSession) -> None:
        """Depths 2 and 3 in a forked process (the first session goes with it), depth 4 here."""
        workload, options, seen = self.workload, self.options, self._seen
        middle = depth.DEPTHS[1]

        def build() -> tuple[list[TraceSession], tuple[int, int] | None]:
            return [first, _new_session(depth.at_depth(workload, middle, seen), options)], seen.cuts.get(middle)

        self._forked = forked.ForkedSessions(build)
        try:
            self._shallow = [_new_session(depth.at_depth(workload, d, seen), options) for d in depth.DEPTHS[2:]]
            cut = self._forked.built()
        except BaseException:
            self._forked.close()
            raise
        if cut is not None:
            seen.cuts[middle] = cut
        self._params_by_depth = list(zip(self._forked.params, self._forked.trainable_params))

    def _trace_depths(self, batch_size: int, fresh: bool) -> list[tuple[TracePoint, list | None]]:
        """(traced point, fresh stream) at each depth, the forked ones tracing meanwhile."""
        if not self._opened:
            self._open()
        self.say(f"tracing batch size {batch_size} at depths {', '.join(map(str, depth.DEPTHS))} of {self.blocks}")
        if self._forked is not None:
            self._forked.start(batch_size, fresh=fresh)
        here = [(s.trace(batch_size, fresh=fresh), s.fresh_folded if fresh else None) for s in self._shallow]
        return (self._forked.results() if self._forked is not None else []) + here

    @property
    def known_limits(self) -> list[str]:
        """What this model runs that the trace does not mirror, in words for the report."""
        return self._cached("known_limits", self._known_limits)

    def _known_limits(self) -> list[str]:
        from torch import nn

        session = self._full or self._first
        recurrent = sorted({type(m).__name__ for m in session.step.model.modules() if isinstance(m, nn.RNNBase)})
        if not recurrent:
            return []
        return [f"{', '.join(recurrent)} layers are traced with the CPU kernels (mkldnn_rnn_layer, or a loop "
                "of cells): on a GPU cuDNN runs them and keeps its own workspace and reserve space, which "
                "this trace does not count"]

    @property
    def approximations(self) -> list[Approximation]:
        """Where this trace approximates the step it stands for (a compiled model run as eager)."""
        return self._cached("approximations", self._approximations)

    def _approximations(self) -> list[Approximation]:
        from batchfit.trace.approximation import (
            attention_approximations,
            fast_path_approximations,
            offload_approximations,
            quantize_approximations,
        )
        from batchfit.trace.compiled import (
            COMPILED_TRACED,
            MEMORY_BUDGET_TRACED,
            checkpointed_approximations,
            compile_approximations,
            graph_breaks,
            inductor_fallbacks,
        )
        from batchfit.trace.cuda_float8 import float8_approximations
        from batchfit.trace.hf_packing import packing_approximation
        from batchfit.trace.routing import routing_approximation

        session = self._full or self._first
        fast_path = (fast_path_approximations(session.step.model)
                     + float8_approximations(self.options, traced_compiled=session.compiled)
                     + offload_approximations(self.options.offload_spec, self.options.compile)
                     + attention_approximations(self.options.attention)
                     + quantize_approximations(self.options.quantize)
                     + routing_approximation(session.step.model, self.options.routing_spec)
                     + packing_approximation(session.packing.assumed))
        if not session.compiled:  # nothing compiled (a sharded step is traced by plan's own session)
            return compile_approximations(self.options, session.step.model, self.workload.loss_fn) + fast_path
        asked = (f"--compile {self.options.compile}" if self.options.compile != "none"
                 else f"the workload calls torch.compile itself, on {', '.join(session.compiled_parts)}")
        budget = []
        if self.options.memory_budget is not None:
            asked += f" --memory-budget {self.options.memory_budget:g}"
            budget = [dataclasses.replace(MEMORY_BUDGET_TRACED,
                                          detail="--memory-budget "
                                                 f"{self.options.memory_budget:g}{inductor_fallbacks()}")]
        compiled = graph_breaks()
        if compiled.startswith("0 graphs compiled"):  # dynamo gave every frame up: the step ran eagerly
            return [Approximation(
                what=f"{asked} compiled nothing here: the step was traced eagerly",
                may_differ_by="what inductor would keep or fuse in whatever a GPU run compiles (not measured for "
                              "this model: run it with `batchfit probe --device cuda`)",
                source="docs/tracing/compile.md", detail=compiled)] + fast_path
        return ([dataclasses.replace(COMPILED_TRACED, detail=f"{asked}: {compiled}")] + budget
                + checkpointed_approximations(asked, checkpointing=self.options.checkpointing) + fast_path)

    @property
    def repeats_micro_batches(self) -> bool:
        """Whether a step of several accumulation steps runs two micro-batches and writes the
        rest (``MemoryTracker.repeat_micro_batch``), so that tracing N costs two."""
        return self._facts["repeats_micro_batches"]

    @property
    def by_depth(self) -> bool:
        return self.blocks is not None

    def _session_params(self) -> tuple[int, int]:
        """(parameters, trainable parameters) of the full model, from the built sessions."""
        if self.blocks is None:
            return self._full.params, self._full.trainable_params
        return tuple(depth.line_at([counts[i] for counts in self._params_by_depth], self.blocks) for i in (0, 1))

    @property
    def params(self) -> int:
        return self._facts["params"][0]

    @property
    def trainable_params(self) -> int:
        return self._facts["params"][1]

    def _may_be_replayed(self, batch_size: int) -> bool:
        """Could the reserved search ask for this size? Not when a size no larger, or the
        curve, already puts it over the device (the search replays only sizes that fit as
        allocated). The first size is always traced fresh: its warm-up step is run anyway."""
        if not self.points:
            return True
        usable = self.device.usable_bytes
        if any(p.peak_bytes > usable for b, p in self.points.items() if b <= batch_size):
            return False
        return len(self.points) < 2 or self.curve().peak_bytes(batch_size) <= usable

    def point(self, batch_size: int, *, fresh: bool | None = None) -> MemoryPoint:
        """The traced point at ``batch_size``. With ``fresh`` (default: with ``keep_streams``,
        where the reserved search may replay it) the shallow depths trace as fresh processes
        and keep their allocation streams."""
        if batch_size in self.points:
            return self.points[batch_size]
        if fresh is None:
            fresh = self.keep_streams and self._may_be_replayed(batch_size)
        workspace = self.device.workspace_bytes
        found = None
        warmth = "fresh" if fresh else "warm"  # a warm trace's step follows others: cached apart
        if self.by_depth and not self._stack_repeats:
            traced = self._from_cache(f"depths-{batch_size}-{warmth}", lambda: self._trace_depths(batch_size, fresh))
            if fresh:
                self._streams[batch_size] = {d: events for d, (_, events) in zip(depth.DEPTHS, traced)}
            points = [allocated_point(point, workspace) for point, _ in traced]
            found = depth.extrapolate(points, self.blocks)
            self._stack_repeats = found is None and depth.stack_repeats(points)
        if found is None:  # not traced by depth, or not affine in depth: the whole model
            traced, events = self._from_cache(f"whole-{batch_size}-{warmth}",
                                              lambda: self._trace_whole(batch_size, fresh))
            if self.workload.generate is not None:  # only a step that generates has a loop to say of
                self._loops[batch_size] = self._from_cache(f"loop-{batch_size}-{warmth}",
                                                           lambda: self._loop_at(batch_size))
            found = allocated_point(traced, workspace)
            if fresh:
                self._whole_streams[batch_size] = events
            if batch_size not in self.full_traces:  # traced again, fresh, for its reserved peak
                self.full_traces.append(batch_size)
        self.points[batch_size] = found
        return found

    def _from_cache(self, name: str, trace: Callable[[], object]) -> object:
        """The trace cache's ``name``, else ``trace()``, written there."""
        found = self._cache.get(name) if self._cache is not None else None
        if found is None:
            found = trace()
            if self._cache is not None:
                self._cache.put(name, found)
        return found

    def trace_ahead(self, batch_size: int) -> None:
        """Start tracing ``batch_size`` whole and fresh in a forked copy of the session, on the second core,
        while this process traces another size (``search.trace_first_sizes``): for a step that generates,
        each size a whole generation loop (seed 003: 13 s each). The same bytes as tracing it here after
        the other, which a fresh trace does not see; the loop it records joins this session's
        (``trace/written.py``). Nothing starts where the size is cached, there is one core, or the
        step does not generate; :meth:`point` takes the answer when the size is asked for."""
        if (self.workload.generate is None or not self.keep_streams or not self._parallel or self._ahead is not None
                or not forked.can_fork()):
            return
        if self._cache is not None and self._cache.get(f"whole-{batch_size}-fresh") is not None:
            return
        self._open_for_whole()
        if self._full is None or self.by_depth:
            return
        session = self._full

        def trace() -> tuple:
            traced = session.trace(batch_size, fresh=True)
            calls = session.tracker.written
            how = calls.how.get(batch_size) if calls is not None else None
            return traced, session.fresh_stream, written.traced_at(calls, batch_size), how

        self.say(f"tracing batch size {batch_size} in a second process meanwhile")
        self._ahead = (batch_size, forked.ForkedCall(trace))

    def _trace_whole(self, batch_size: int, fresh: bool) -> tuple[TracePoint, list | None]:
        """(the whole model's traced point, its fresh stream when ``fresh``)."""
        if self._ahead is not None and self._ahead[0] == batch_size and fresh:
            traced, events, calls, how = self._ahead[1].result()
            self._ahead = None
            if how:  # the step generated there: its loop joins this session's
                tracker = self._full.tracker
                tracker.written = tracker.written or written.WrittenCalls()
                written.learn(tracker.written, calls, batch_size)
                tracker.written.how[batch_size] |= how
            return traced, events
        self._open_for_whole()
        if self._full is None:
            self.say(f"memory is not affine in depth here: building the whole {self.workload.name}")
            self._full = _new_session(self.workload, self.options)
        self.say(f"tracing batch size {batch_size}")
        traced = self._full.trace(batch_size, fresh=fresh)
        calls = self._full.tracker.written
        if calls is not None and "line" in calls.how.get(batch_size, ()):
            self.say(f"batch size {batch_size}: its generation written from the traced sizes' line "
                     f"(checked event for event at {', '.join(map(str, calls.checked_at))})")
        return traced, self._full.fresh_stream if fresh else None

    def _loop_at(self, batch_size: int) -> dict:
        """How the generation loop of the step just traced at ``batch_size`` was had (``trace/written.py``):
        {"how": traced / repeated / line, "checked_at": the sizes that checked its line}; {} where none ran."""
        calls = self._full.tracker.written if self._full is not None else None
        how = calls.how.get(batch_size) if calls is not None else None
        return {"how": sorted(how), "checked_at": sorted(calls.checked_at)} if how else {}

    @property
    def written_generation(self) -> dict | None:
        """How each traced size's generation loop was had, where one was written instead of run (the
        shape of ``WrittenCalls.summary``, over this curve's sizes, cached ones too); None where none was."""
        loops = {b: self._loops[b] for b in self.points if self._loops.get(b)}
        found = written.summary({b: loop["how"] for b, loop in loops.items()},
                                [c for loop in loops.values() if "line" in loop["how"] for c in loop["checked_at"]])
        return found if found["repeated"] or found["line"] else None

    def _open_for_whole(self) -> None:
        """Open what a whole-model trace needs: where the traces read from the cache showed the stack
        repeating (generation: no size extrapolates in depth), the whole model alone, not the depth
        sessions that would never trace; otherwise the model as :meth:`_open` builds it."""
        if self._opened:
            return
        if not self._stack_repeats:
            self._open()
            return
        self.workload = resolved(self.workload)
        self.say(f"building the whole {self.workload.name} on fake tensors (no size extrapolates in depth)")
        self._first = self._full = _new_session(self.workload, self.options)

    def reserved(self, batch_size: int) -> MemoryPoint:
        """The point with its reserved peak: the allocation stream of a fresh process, from the
        model's build to the end of the second step, replayed through the allocator model.

        Reserved memory is not affine in depth (segments are reused and split), so the stream
        must be the whole model's: written from the shallow traces' streams where they are
        regular (``trace/stream.py``, checked event for event), else traced whole.
        """
        point = self.point(batch_size)
        if point.peak_reserved_bytes is None and point.reserved_oom is None:
            kept = self._whole_streams if self._stack_repeats else self._streams
            if self.by_depth and batch_size not in kept:  # traced before streams were kept: again, fresh
                self.points.pop(batch_size)
                self.point(batch_size, fresh=True)
            point = self.points[batch_size]
            config = AllocatorConfig.from_env()
            replayed = (f"replay-{batch_size}-{self.device.usable_bytes}-{self.device.workspace_bytes}-"
                        f"{config_digest(config)}")
            peak, oom, ratio, whole = self._from_cache(replayed, lambda: self._replay(batch_size, config))
            if whole:
                self.whole_reserved.append(batch_size)
            point.peak_reserved_bytes, point.reserved_oom, point.reserved_ratio = peak, oom, ratio
        return point

    def replay_is_free(self, batch_size: int) -> bool:
        """Whether the reserved peak at ``batch_size`` (traced) needs no more tracing and no depth
        extension: its whole model's fresh stream is kept. ``search.curve_search`` replays such a size
        as it probes it."""
        return self._whole_streams.get(batch_size) is not None

    def _replay(self, batch_size: int, config: AllocatorConfig) -> tuple[int | None, str | None, float, bool]:
        """``replay_reserved``'s three figures, and whether the stream had to be traced whole (or
        was: a size traced whole, fresh, has its stream, and no depths' streams to extend)."""
        extend = self.by_depth and batch_size in self._streams and self._whole_streams.get(batch_size) is None
        events = self._extended_stream(batch_size) if extend else None
        whole = events is None
        if whole:
            events = self._whole_stream(batch_size)
        self.say(f"replaying batch size {batch_size}'s {len(events):,} allocation events through the allocator model")
        return (*replay_reserved(events, self.device, config), whole)

    def _whole_stream(self, batch_size: int) -> list[tuple[str, int, int]]:
        """The whole model's fresh-process stream at ``batch_size``: kept from its trace, or
        traced fresh in the whole model's session (built once), or, when that session still
        holds something from an earlier step, in a new one."""
        events = self._whole_streams.get(batch_size)
        if events is None:
            self._open_for_whole()
            self.say(f"tracing batch size {batch_size} whole for reserved memory")
            if self._full is None:
                self._full = _new_session(self.workload, self.options)
            self._full.trace(batch_size, fresh=True)
            events = self._full.fresh_stream
        if events is None:
            with _new_session(self.workload, self.options) as session:
                session.trace(batch_size)
                events = session.tracker.events
        return events

    def _extended_stream(self, batch_size: int) -> list[tuple[str, int, int]] | None:
        streams = self._streams[batch_size]
        if any(events is None for events in streams.values()):
            return None
        # folded streams (micro-batches 3..N as marks, trace/repeats.py): extended at two
        # micro-batches' length, then the copies written at full depth
        events = stream.extend({d: stream.without_cut(events, self._seen.cuts.get(d))
                                for d, events in streams.items()}, self.blocks)
        try:
            return None if events is None else repeats.unfold(events)
        except repeats.NotFolded:
            return None

    def curve(self) -> MemoryCurve:
        return fit_curve({b: p.peak_by_phase for b, p in self.points.items()})

    def max_batch(self, limit_bytes: int, *, lo: int, hi: int, multiple_of: int,
                  reserved: bool = False, host_limit_bytes: int | None = None) -> SearchResult:
        """The largest multiple of ``multiple_of`` in [lo, hi] whose traced peak (reserved with
        ``reserved``) is under ``limit_bytes``: ``search.curve_search``, plan's search too."""
        return curve_search(self, limit_bytes, lo=lo, hi=hi, multiple_of=multiple_of, reserved=reserved,
                            host_limit_bytes=host_limit_bytes)

    def close(self) -> None:
        if self._forked is not None:
            self._forked.close()
        if self._ahead is not None:
            self._ahead[1].close()
        opened = [s for s in [self._first, *self._shallow, self._full] if s is not None]
        for session in {id(s): s for s in opened}.values():
            session.close()

    def __enter__(self) -> TracedCurve:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
