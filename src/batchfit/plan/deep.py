"""Rank 0 of a deep model traced at three small depths and extrapolated to its full depth.

Tracing Llama-3.1-8B's 32 blocks on a fake process group costs about 33 s per local batch;
``estimate`` avoids that by tracing the model cut to 2, 3 and 4 blocks (``trace/depth.py``)
and checking that every phase's peak and breakdown lies on one line. A sharded step is the
same stack of blocks, so the same holds for rank 0's memory, its FLOPs and its parameter
counts; its collectives are a list that repeats once per block (FSDP's all-gather and
reduce-scatter of each block, TP's all-reduces in each block), written out here as the
depth-2 list with one block's calls inserted once per extra block, and checked against the
traces at depths 3 and 4 call for call. Anything that is not exactly regular (DDP's
gradient buckets are cut by size, not by block: regular only where each block fills its own
buckets, as a large model's do) is traced whole instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from batchfit.distributed.parallelisms import degree_keys, degree_of, runs_experts
from batchfit.trace import depth, stream
from batchfit.trace.forked import ForkedWorker, can_fork, claim_core, release_core
from batchfit.trace.stream_line import StreamLine, refusal, rounds_by_batch

if TYPE_CHECKING:
    from batchfit.plan.sharded import Collective, ShardedPoint, Strategy


def _side_streams(session) -> dict[int, int]:
    """The side stream of each malloc of a session's fresh stream (none for a session that does
    not name them: the tests' stand-in)."""
    return getattr(session, "fresh_streams", {})


def collectives_at(lists: list[tuple[Collective, ...]], blocks: int) -> tuple[Collective, ...] | None:
    """The collectives at ``blocks`` from those traced at ``depth.DEPTHS`` (2, 3, 4).

    Each place where depth 3 calls more than depth 2 (the forward's blocks, the backward's
    blocks in reverse, the recomputation) gets its extra block's calls once per extra block;
    None unless that rule writes the depth-3 and depth-4 lists exactly."""
    c2, c3, c4 = lists
    matcher = difflib.SequenceMatcher(None, c2, c3, autojunk=False)
    pieces: list[tuple[tuple, bool]] = []  # (calls, repeats once per block)
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "equal":
            pieces.append((c2[i1:i2], False))
        elif op == "insert":
            pieces.append((c3[j1:j2], True))
        else:
            return None

    def write(d: int) -> tuple[Collective, ...]:
        return tuple(call for calls, per_block in pieces
                     for call in (calls * (d - depth.DEPTHS[0]) if per_block else calls))

    if write(depth.DEPTHS[1]) != c3 or write(depth.DEPTHS[2]) != c4:
        return None
    return write(blocks)


def extrapolate(points: list[ShardedPoint], blocks: int) -> ShardedPoint | None:
    """Rank 0's point at ``blocks`` from points traced at ``depth.DEPTHS``, or None."""
    memory = depth.extrapolate(points, blocks)
    collectives = collectives_at([p.collectives for p in points], blocks)
    counts = {name: depth.line_at([getattr(p, name) for p in points], blocks)
              for name in ("flops", "params", "params_per_rank")}
    if memory is None or collectives is None or None in counts.values():
        return None
    return dataclasses.replace(memory, collectives=collectives, **counts)


class DeepSession:
    """One strategy's rank 0 traced at local batch after local batch: where the model's stack
    has ``depth.MIN_BLOCKS`` or more identical blocks, at depths 2, 3 and 4 (one sharded
    session each, built once) and extrapolated; the whole model otherwise, or from the first
    local batch whose depths do not extrapolate on.

    ``session(workload, options, device, strategy, **kw)`` opens a sharded session with a
    ``trace(local_batch)`` method (``sharded.ShardedSession`` by default).
    """

    replay_gives_point = True
    """:meth:`reserved` at a size not traced yet leaves its point for :meth:`trace` (``ShardedCurve``)."""

    def __init__(self, workload, options, device, strategy: Strategy, *, session: Callable | None = None,
                 cuda_semantics: bool = True, fork: bool = False) -> None:
        if session is None:
            from batchfit.plan.sharded import ShardedSession as session
        extra = {} if cuda_semantics else {"cuda_semantics": False}  # stand-ins need not take it
        self._open = lambda model_workload: session(model_workload, options, device, strategy, **extra)
        self.workload, self.device = workload, device
        self.blocks: int | None = None
        self.whole_reserved: list[int] = []
        """Local batches whose reserved peak needed the whole model's stream (the depths' were
        not regular enough to write it: ``trace/stream.py``)."""
        self.whole_traces: list[int] = []
        """Local batches traced whole although the model was cut (not regular in depth there)."""
        self._depths: list = []
        self._forked = None
        """With ``fork`` (where a process can be forked): the child that holds the depth-2 and depth-3 sessions
        (:meth:`_fork_shallow`), ``self._depths`` then holding a :class:`_Forked` for each and depth 4's session."""
        self._whole = None
        self._first_fresh: tuple[int, list[tuple[list, tuple[int, ...], dict]] | None] | None = None
        """(local batch, each depth's fresh stream and step starts): the depth sessions' first
        trace is a fresh process's, which a reserved replay at that size reuses; (local batch, None)
        where the whole model's session traced first (its own ``fresh_stream``)."""
        self.line = StreamLine(refused=refusal(options))
        """The fresh full-depth streams replayed so far, and the line through them that writes others
        (``trace/stream_line.py``): a reserved probe between checked sizes traces nothing."""
        self._seeded = False
        """Whether a small size was added to the line's streams (:meth:`_seed_line`, once)."""
        self._fresh_points: dict[int, ShardedPoint] = {}
        """Points a reserved replay traced, fresh, before the size was traced here (and where
        a fresh point is the steady one: no DDP bucket rebuild in it): :meth:`trace` takes them."""
        seen = depth.Depth()
        # every:N checkpoints blocks by position: depths 2-4 say nothing of the whole stack; nor
        # of ZeroRedundancyOptimizer's partition (whole parameters, largest first: at 2-4 blocks
        # on 8 ranks rank 0 owns the same few, at 32 blocks four times as many)
        cut = options.blocks_alike and strategy.shard not in ("zero1", "zero2")
        first = self._open(depth.at_depth(workload, depth.DEPTHS[0], seen) if cut else workload)
        routed = getattr(getattr(first, "session", None), "routed", None)  # the tests' stand-in sessions: none
        split = math.prod(degree_of(strategy, key) for key in degree_keys())  # a bound on the sequence's split
        self.line.lattice = rounds_by_batch(moe=routed is not None, expert_parallel=runs_experts(strategy),
                                            tokens_per_sample=workload.tokens_per_sample, split=split)
        if seen.blocks and seen.blocks >= depth.MIN_BLOCKS:
            self.blocks = seen.blocks
            self._depths = [first]
            try:
                if fork and can_fork():
                    self._fork_shallow(first, seen)
                else:
                    self._depths += [self._open(depth.at_depth(workload, d, seen)) for d in depth.DEPTHS[1:]]
            except BaseException:
                self.close()
                raise
        else:  # the model was not cut: the first session is the whole model
            self._whole = first

    def trace(self, local_batch: int) -> ShardedPoint:
        if local_batch in self._fresh_points:
            return self._fresh_points.pop(local_batch)
        if self._depths:
            first = self._first_fresh is None and getattr(self._depths[0], "fresh_stream", None) is None
            found = extrapolate(self._trace_depths(local_batch), self.blocks)
            if first and all(getattr(s, "fresh_stream", None) is not None for s in self._depths):
                self._first_fresh = (local_batch, [(s.fresh_stream, s.fresh_steps, _side_streams(s))
                                                   for s in self._depths])
            if found is not None:
                return found
            self.whole_traces.append(local_batch)
        if self._whole is None:
            self._whole = self._open(self.workload)
        found = self._whole.trace(local_batch)
        if self._first_fresh is None and getattr(self._whole, "fresh_stream", None) is not None:
            self._first_fresh = (local_batch, None)  # the whole model's first trace: a fresh process too
        return found

    def _fork_shallow(self, first, seen: depth.Depth) -> None:
        """Depths 2 and 3 in a forked child (it keeps this process's depth-2 session as it was forked, and opens
        depth 3), which traces them while this process traces depth 4: the same sessions, each in one process,
        so the same bytes; a session alone on a two-core machine (auto's last, or one strategy) in about 70% of
        the time (Llama-3.1-70B fsdp+cp8: 23.9-27.3 s against 35.6-36.5 s, ``plan_cp8_70-2026-11-29.json``).
        This process's copy of the depth-2 session is closed."""
        def open_at(d: int, seen: depth.Depth):
            return self._open(depth.at_depth(self.workload, d, seen))

        self._forked = ForkedWorker(lambda: (_Shallow([first, open_at(depth.DEPTHS[1], seen)], open_at), None))
        first.close()
        self._depths = [_Forked(), _Forked()]
        self._depths.append(open_at(depth.DEPTHS[2], seen))
        self._forked.result()  # the child's sessions opened (its error raised here)

    def _trace_depths(self, local_batch: int) -> list[ShardedPoint]:
        """Each depth's point at ``local_batch`` (depths 2 and 3 in the forked child, meanwhile, where there is one)."""
        if self._forked is None:
            return [s.trace(local_batch) for s in self._depths]
        self._forked.start("trace", local_batch, doing=f"tracing local batch {local_batch}")
        shallow, deepest = self._beside(lambda: self._depths[-1].trace(local_batch))
        for forked, (_, fresh) in zip(self._depths, shallow):
            if fresh is not None:
                forked.fresh_stream, forked.fresh_steps, forked.fresh_streams = fresh
        return [point for point, _ in shallow] + [deepest]

    def _beside(self, here: Callable):
        """(the forked child's answer to its request, ``here()``): run while the child works where a core is
        idle (``forked.claim_core``), else after its answer (the same results either way)."""
        if not claim_core():
            shallow = self._forked.result()
            return shallow, here()
        try:
            found = here()
            return self._forked.result(), found
        finally:
            release_core()

    def _fresh_depths(self, local_batch: int, points: list) -> list[tuple[list, tuple[int, ...], dict]]:
        """A fresh process's stream at each depth (new sessions), their points appended to ``points``."""
        seen = depth.Depth()
        if self._forked is None:
            return [self._fresh(depth.at_depth(self.workload, d, seen), local_batch, points) for d in depth.DEPTHS]
        self._forked.start("fresh", local_batch, doing=f"tracing local batch {local_batch} in fresh sessions")
        deepest: list = []
        shallow, found = self._beside(lambda: self._fresh(depth.at_depth(self.workload, depth.DEPTHS[-1], seen),
                                                          local_batch, deepest))
        points += [point for *_, point in shallow] + deepest
        return [traced for *traced, _ in shallow] + [found]

    def reserved(self, local_batch: int):
        """Rank 0's reserved peak at ``local_batch`` (a ``plan.reserved.ReservedReplay``): the
        allocation stream of a fresh process (new sessions: what a fresh process allocates is
        what the allocator model starts from), replayed step by step. For a cut model the full
        depth's stream is written from the three depths' (``trace/stream.py``, as ``estimate``
        does: checked event for event against the traced depths) and each step's start is on
        the line through theirs; where it cannot be, the whole model is traced. Between batch
        sizes whose streams lie on one checked line, the stream is written from it
        (``trace/stream_line.py``; the replay says ``written``, and no point is traced for it)."""
        from batchfit.plan.reserved import replay_steps

        written = self.line.at(local_batch)
        if written is None and self._seed_line(local_batch):
            written = self.line.at(local_batch)
        if written is not None:
            events, starts, streams = written
            return replay_steps(events, starts, self.device, streams, written=True)
        found = self._traced_stream(local_batch)
        self.line.add(local_batch, found)
        events, starts, streams = found
        return replay_steps(events, starts, self.device, streams)

    def _traced_stream(self, local_batch: int) -> tuple[list, tuple[int, ...], dict]:
        """A fresh process's stream at ``local_batch``: written from the depths' where they are regular,
        else the whole model traced (fresh sessions either way)."""
        # once the depths' streams were not regular, they will not be at another size either
        found = self._extended(local_batch) if self._depths and not self.whole_reserved else None
        if found is None:
            self.whole_reserved.append(local_batch)
            points = []
            found = self._fresh(self.workload, local_batch, points)
            self._keep_fresh(local_batch, points[0], found[1])
        return found

    def _seed_line(self, local_batch: int) -> bool:
        """Before tracing a probe below two traced sizes that the line does not cover (once): a stream at
        a small size instead, the line's other end, so that this probe and those after it are written. The
        sessions' own first trace where its events are the others' (plan's is at 2, the larger of its first
        two sizes: ``search.trace_first_sizes``); else a fresh trace at 2 (at 1 a copy of a tensor whose batch
        dimension is 1 can be a view: Llama-3.1-70B under fsdp+cp8 has 4 events fewer at 1 than at 2 or 22).
        Not at a search's first two probes: one that ends there (a max local batch of 4) would trace the small
        size for nothing."""
        if (self._seeded or self.line.refused or local_batch <= 2 or len(self.line.traced) < 2
                or local_batch > max(self.line.traced)):
            return False  # (a refused line writes nothing: its small end would be traced for nothing)
        self._seeded = True
        if self._first_fresh is not None and self._first_fresh[0] < local_batch:
            first, depths = self._first_fresh
            if depths is None:  # the whole model's session
                found = self._whole.fresh_stream, self._whole.fresh_steps, _side_streams(self._whole)
            else:
                found = None if self.whole_reserved else self._extended(first)
            if found is not None:
                self.line.add(first, found)
        if not self.line.checked or min(self.line.checked) > local_batch:
            if 2 not in self.line.traced:
                self.line.add(2, self._traced_stream(2))
        return True

    def _keep_fresh(self, local_batch: int, point: ShardedPoint, steps: tuple[int, ...]) -> None:
        """A fresh process's second step is the steady one but under DDP (its bucket rebuild, a third
        step start): the size's point, for :meth:`trace`, unless it was traced already."""
        if len(steps) == 2:
            self._fresh_points[local_batch] = point

    def _fresh(self, workload, local_batch: int, points: list | None = None) -> tuple[list, tuple[int, ...], dict]:
        return _fresh_trace(self._open(workload), local_batch, points)

    def _extended(self, local_batch: int) -> tuple[list, tuple[int, ...], dict] | None:
        if self._first_fresh is not None and self._first_fresh[0] == local_batch and self._first_fresh[1] is not None:
            traced = self._first_fresh[1]  # the depth sessions' own first trace was this fresh process
        else:
            points = []
            traced = self._fresh_depths(local_batch, points)
            if all(len(steps) == 2 for _, steps, _ in traced) and (found := extrapolate(points, self.blocks)):
                self._keep_fresh(local_batch, found, traced[0][1])
        if len({len(steps) for _, steps, _ in traced}) != 1:
            return None
        starts = tuple(depth.line_at([steps[i] for _, steps, _ in traced], self.blocks)
                       for i in range(len(traced[0][1])))
        # each side-stream malloc (FSDP2's) carries its stream through the extension in its size
        tagged = (stream.tag_streams(events, streams) for events, _, streams in traced)
        events = stream.extend(dict(zip(depth.DEPTHS, tagged)), self.blocks)
        if events is None or None in starts:
            return None
        events, streams = stream.untag_streams(events)
        return events, starts, streams

    def close(self) -> None:
        with contextlib.ExitStack() as stack:  # every session closes, even when one raises
            for s in [*([self._forked] if self._forked is not None else []), *self._depths,
                      *([self._whole] if self._whole is not None else [])]:
                stack.callback(s.close)

    def __enter__(self) -> DeepSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _fresh_trace(session, local_batch: int, points: list | None = None) -> tuple[list, tuple[int, ...], dict]:
    """``session`` (just opened) traced at ``local_batch`` and closed: its fresh stream, step starts and side
    streams; its point appended to ``points``."""
    with contextlib.closing(session):
        point = session.trace(local_batch)
        if points is not None:
            points.append(point)
        return session.fresh_stream, session.fresh_steps, _side_streams(session)


class _Shallow:
    """In :meth:`DeepSession._fork_shallow`'s child: the depth-2 and depth-3 sessions."""

    def __init__(self, sessions: list, open_at: Callable) -> None:
        self.sessions, self._open_at = sessions, open_at

    def trace(self, local_batch: int) -> list[tuple[ShardedPoint, tuple | None]]:
        """Each session's point, and its fresh stream, step starts and side streams where this was its first trace."""
        traced = []
        for s in self.sessions:
            first = s.fresh_stream is None
            point = s.trace(local_batch)
            traced.append((point, (s.fresh_stream, s.fresh_steps, _side_streams(s)) if first else None))
        return traced

    def fresh(self, local_batch: int) -> list[tuple]:
        """(stream, step starts, side streams, point) of a fresh process at each of the two depths."""
        seen, found = depth.Depth(), []
        for d in depth.DEPTHS[:-1]:
            points: list = []
            found.append((*_fresh_trace(self._open_at(d, seen), local_batch, points), points[0]))
        return found

    def close(self) -> None:
        with contextlib.ExitStack() as stack:  # the last opened closes first
            for s in self.sessions:
                stack.callback(s.close)


class _Forked:
    """This process's view of a depth session in the forked child: its first trace's fresh stream, once traced."""

    def __init__(self) -> None:
        self.fresh_stream: list | None = None
        self.fresh_steps: tuple[int, ...] | None = None
        self.fresh_streams: dict[int, int] = {}

    def close(self) -> None:
        pass


def trace_deep(workload, options, device, strategy: Strategy, local_batch: int, *,
               session: Callable | None = None, cuda_semantics: bool = True) -> ShardedPoint:
    """Rank 0's point at one local batch: a :class:`DeepSession` traced once."""
    with DeepSession(workload, options, device, strategy, session=session, cuda_semantics=cuda_semantics) as deep:
        return deep.trace(local_batch)
