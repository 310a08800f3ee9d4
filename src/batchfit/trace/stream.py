"""Extend an allocation stream traced at three small depths to the model's full depth.

Reserved memory is not affine in depth (the caching allocator reuses and splits segments),
so it needs the whole allocation stream of a fresh process, replayed through the allocator
model. Tracing a 32-layer model whole costs ten seconds; its stream can instead be written
down from three shallow ones, because a stack of identical blocks makes a stream of
*runs*: at each place where the step loops over the blocks (forward, recompute, backward,
each foreach op of the optimizer over the blocks' parameters) the same events repeat once
per block, and everything else (embeddings, head, loss) is the same at any depth.

The stream at depth ``d + 1`` is the one at depth ``d`` with one more period inserted into
each run. What ties the runs together is which allocation each free releases: block ``k``'s
backward frees what block ``k``'s forward saved (in a run that goes the other way), block
``k`` frees block ``k - 1``'s output, the last block's output is freed by the head. (Where only
the adapters train, as with LoRA, runs meet with nothing between them: a loop up the blocks
and one back down make a single insertion, split at their junction; and two loops whose
events look alike abut, the later one starting where the earlier ends.) Each
free is written as a rule that holds at every depth: the same copy index plus an offset, the
mirrored copy index plus an offset, or a fixed allocation outside the runs; the first and the
last copy of a run may have rules of their own (the edges of the stack). Rules are learnt at
the largest depth (where every run has an interior) and narrowed by the middle one; the
streams they write for the two smaller depths must be the traced ones, event for event. Anything
else returns None, and the caller traces the model whole.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from batchfit.trace.matching import FastMatcher

Event = tuple[str, int, int]
"""('malloc', ident, requested bytes) or ('free', ident, 0), as MemoryTracker records them; or a
mark ('begin' / 'repeat', -1, n) where written micro-batches were folded (``trace/repeats.py``),
which the extension keeps in place as a fixed event outside the runs."""


@dataclass(frozen=True)
class Run:
    start: int
    """Index of the run's first event in its stream."""
    period: int
    """Events per copy (one block's worth)."""
    copies: int


class NotRegular(Exception):
    """The streams are not runs of identical blocks with depth-independent rules."""


def _tokens(events: list[Event]) -> list[tuple[str, int]]:
    """What the allocator sees of each event: a malloc of n bytes, or a free of n bytes."""
    sizes: dict[int, int] = {}
    tokens = []
    for kind, ident, nbytes in events:
        if kind == "malloc":
            sizes[ident] = nbytes
        tokens.append((kind, sizes[ident] if kind == "free" else nbytes))
    return tokens


def _canonical(events: list[Event]) -> list[tuple[str, int]]:
    """A stream with its idents renamed in order of allocation: two equal canonical streams
    drive the allocator model identically."""
    order: dict[int, int] = {}
    out = []
    for kind, ident, nbytes in events:
        if kind == "malloc":
            order[ident] = len(order)
            out.append((kind, nbytes))
        elif kind == "free":
            out.append((kind, order[ident]))
        else:
            out.append((kind, nbytes))
    return out


def _run_at(longer: list[tuple[str, int]], j1: int, j2: int) -> Run:
    """The run holding the period inserted at ``[j1, j2)``, rotated to its leftmost start."""
    period, start = j2 - j1, j1
    while start > 0 and longer[start - 1] == longer[start - 1 + period]:
        start -= 1  # the leftmost rotation: the same rule at every depth
    end = start + period
    while end < len(longer) and longer[end] == longer[end - period]:
        end += 1
    return Run(start, period, (end - start) // period)


def _split_runs(longer: list[tuple[str, int]], j1: int, j2: int) -> list[Run]:
    """Two runs that meet at the insertion: one block's events of a loop that goes up the
    blocks and, right after it, of one that comes back down (a foreach op over the adapters
    alone allocates one result per block, then frees them in reverse, with nothing between):
    the deeper stream inserts one period of each at their junction ``s``, which ends the left
    run and starts the right one. The split covering the most events wins; None fits when
    either side repeats less than twice."""
    best: tuple[int, list[Run]] = (0, [])
    for s in range(j1 + 1, j2):
        left, start = s - j1, j1
        while start > 0 and longer[start - 1] == longer[start - 1 + left]:
            start -= 1
        right, end = j2 - s, j2
        while end < len(longer) and longer[end] == longer[end - right]:
            end += 1
        copies = ((s - start) // left, (end - s) // right)
        if min(copies) >= 2 and copies[0] * left + copies[1] * right > best[0]:
            best = (copies[0] * left + copies[1] * right,
                    [Run(s - copies[0] * left, left, copies[0]), Run(s, right, copies[1])])
    return best[1]


def _after(previous: Run, run: Run, longer: list[tuple[str, int]]) -> Run:
    """``run`` starting where ``previous`` ends, when its leftmost rotation reached into it:
    two loops back to back whose events look alike (the optimizer's frees of one foreach op's
    results, in reverse, then of the adapters' gradients) are two runs, not one."""
    start = previous.start + previous.period * previous.copies
    end = run.start + run.period * run.copies
    while end < len(longer) and longer[end] == longer[end - run.period]:
        end += 1
    if start >= end:
        raise NotRegular("runs overlap")
    return Run(start, run.period, (end - start) // run.period)


def _runs(shorter: list[tuple[str, int]], longer: list[tuple[str, int]]) -> list[Run]:
    """The runs of ``longer``: where it has one more period than ``shorter``."""
    runs = []
    # difflib's opcodes (no junk), with its longest-match search indexed: difflib alone takes
    # about n^3 on a generation loop's stream of few distinct events (trace/matching.py)
    for tag, _, _, j1, j2 in FastMatcher(shorter, longer).get_opcodes():
        if tag == "equal":
            continue
        if tag != "insert":
            raise NotRegular("the deeper stream is not the shallower one with insertions")
        run = _run_at(longer, j1, j2)
        for found in [run] if run.copies >= 2 else (_split_runs(longer, j1, j2) or [run]):
            if runs and runs[-1].start + runs[-1].period * runs[-1].copies > found.start:
                found = _after(runs[-1], found, longer)
            runs.append(found)
    if any(a.start + a.period * a.copies > b.start for a, b in zip(runs, runs[1:])):
        raise NotRegular("runs overlap")
    return runs


@dataclass(frozen=True)
class _Shape:
    """A stream's layout: base events and runs in order, which every depth shares."""

    layout: tuple[tuple[str, int], ...]
    """('base', count of base events) and ('run', run number), in stream order."""
    periods: tuple[tuple[tuple[str, int], ...], ...]
    """Each run's period, as tokens."""
    copies_offset: tuple[int, ...]
    """Each run's copies minus the depth (a backward run may hold one block fewer)."""
    base_tokens: tuple[tuple[str, int], ...]


def _labels(events: list[Event], runs: list[Run], depth: int) -> tuple[_Shape, list[tuple]]:
    """Each event's place: ('base', i) or ('run', run, copy, offset); and the stream's shape."""
    tokens = _tokens(events)
    labels: list[tuple] = [None] * len(events)  # type: ignore[list-item]
    for r, run in enumerate(runs):
        for i in range(run.period * run.copies):
            labels[run.start + i] = ("run", r, i // run.period, i % run.period)
            if tokens[run.start + i][0] not in ("malloc", "free"):
                raise NotRegular("a micro-batch mark inside a run of blocks")
    layout: list[tuple[str, int]] = []
    base = 0
    for i, label in enumerate(labels):
        if label is None:
            labels[i] = ("base", base)
            base += 1
            if layout and layout[-1][0] == "base":
                layout[-1] = ("base", layout[-1][1] + 1)
            else:
                layout.append(("base", 1))
        elif label[2] == 0 and label[3] == 0:
            layout.append(("run", label[1]))
    shape = _Shape(
        layout=tuple(layout),
        periods=tuple(tuple(tokens[run.start:run.start + run.period]) for run in runs),
        copies_offset=tuple(run.copies - depth for run in runs),
        base_tokens=tuple(t for t, label in zip(tokens, labels) if label[0] == "base"),
    )
    return shape, labels


def _encodings(src: tuple, dst: tuple, copies: tuple[int, ...]) -> set[tuple]:
    """Every depth-independent way to name the allocation ``dst`` that ``src`` frees."""
    if dst[0] == "base":
        return {("base", dst[1])}
    _, run, k_dst, offset = dst
    m = copies[run]
    if src[0] == "base":
        return {("first", run, offset, k_dst), ("last", run, offset, m - 1 - k_dst)}
    k = src[2]
    return {("same", run, offset, k_dst - k), ("mirror", run, offset, k_dst - (m - 1 - k))}


def _may_repeat(encoding: tuple, run: int) -> bool:
    """Whether ``encoding`` can name what every interior copy of ``run`` frees at a full depth
    (ten blocks or more). Not a fixed allocation: it can be freed only once. Not the mirrored
    copy of the same run: copy ``k`` can free only a copy allocated before it, ``m - 1 - k + v
    <= k`` for every interior ``k``, which no ``v`` meets once the run has more than four
    copies. (At depth 4 a run may hold two copies, its first an edge: without this, a fixed
    free of the first copy ties with the second copy's rule.)"""
    return encoding[0] == "same" or (encoding[0] == "mirror" and encoding[1] != run)


def _rules(events: list[Event], labels: list[tuple], copies: tuple[int, ...]) -> dict[tuple, dict]:
    """For each free slot (a base event, or an offset of a run), the encodings its frees
    admit: ``interior`` for the run's copies, ``first``/``last`` for an edge that differs."""
    where: dict[int, tuple] = {}
    seen: dict[tuple, list[tuple[int, set]]] = {}
    for (kind, ident, _), label in zip(events, labels):
        if kind == "malloc":
            where[ident] = label
            continue
        if kind != "free":  # a mark: frees nothing
            continue
        slot = label[:2] if label[0] == "base" else ("run", label[1], label[3])
        seen.setdefault(slot, []).append((label[2] if label[0] == "run" else 0,
                                          _encodings(label, where[ident], copies)))
    rules = {}
    for slot, frees in seen.items():
        if slot[0] == "base":
            rules[slot] = {"interior": frees[0][1], "first": None, "second": None, "last": None, "second_last": None}
            continue
        n = copies[slot[1]]
        counts = Counter(e for _, encodings in frees for e in encodings if _may_repeat(e, slot[1]))
        best = max(counts.values(), default=0)
        interior = {e for e, c in counts.items() if c == best}
        edges = {k: enc for k, enc in frees if not enc & interior}
        rules[slot] = {"interior": interior, **_edge_rules(edges, n, slot)}
    return rules


EDGE_PARTS = (("first", lambda k, n: k == 0), ("second", lambda k, n: k == 1),
              ("last", lambda k, n: k == n - 1), ("second_last", lambda k, n: k == n - 2))
"""A rule's edge parts and the copies they name, in the order ``_write`` tries them."""


def _edge_rules(edges: dict[int, set], n: int, slot: tuple) -> dict[str, set | None]:
    """The parts of a rule for the copies of a run whose frees the interior rule does not write.

    Usually only the first and the last copy (the edges of the stack). A run can also free,
    in the opposite order, what another run with fewer copies allocated plus the copies that
    run left outside itself: under FSDP2 the optimizer's ``zero_grad`` frees each block's
    reduce-scattered gradient shard in block order, but the backward's run holds two blocks
    fewer (the last two blocks to run backward wait on no prefetch and differ), so copies 0
    and 1 free fixed allocations outside the runs. Two copies at each end may have their own
    rule, while at least one copy follows the interior one (so that it is seen, not guessed);
    the streams the rules write at the smaller depths are still checked event for event."""
    if not set(edges) - {0, n - 1}:
        return {"first": edges.get(0), "second": None, "last": edges.get(n - 1) if n > 1 else None,
                "second_last": None}
    if set(edges) - {0, 1, n - 2, n - 1} or n - len(edges) < 1:
        raise NotRegular(f"a free rule breaks inside a run ({slot})")
    return {"first": edges.get(0), "second": edges.get(1), "last": edges.get(n - 1),
            "second_last": edges.get(n - 2)}


def _agree(smaller: dict[tuple, dict], larger: dict[tuple, dict]) -> dict[tuple, dict]:
    """One encoding for each part of each rule: those of the larger depth (whose runs show
    their interior), narrowed by what the smaller depth admits where several fit."""
    if set(smaller) != set(larger):
        raise NotRegular("the free slots differ between depths")
    agreed = {}
    for slot, rule in larger.items():
        admitted = set().union(*(e for e in smaller[slot].values() if e))
        agreed[slot] = {}
        for part, encodings in rule.items():
            if encodings is not None and len(encodings) > 1:
                encodings = encodings & admitted
            if encodings is not None and len(encodings) != 1:
                raise NotRegular(f"{'no' if not encodings else 'more than one'} rule fits {slot}")
            agreed[slot][part] = next(iter(encodings)) if encodings else None
    return agreed


def _write(shape: _Shape, rules: dict[tuple, dict], depth: int) -> list[Event]:
    """The stream at ``depth``, its idents numbered in order of allocation."""
    copies = tuple(depth + c for c in shape.copies_offset)
    if min(copies, default=1) < 0:
        raise NotRegular("a run would have fewer than no copies")
    idents: dict[tuple, int] = {}  # live allocations by label
    events: list[Event] = []

    def malloc(label: tuple, nbytes: int) -> None:
        idents[label] = len(events) + 1  # unique: one event per index
        events.append(("malloc", idents[label], nbytes))

    def free(encoding: tuple, k: int) -> None:
        kind = encoding[0]
        if kind == "base":
            target = ("base", encoding[1])
        else:
            _, run, offset, value = encoding
            m = copies[run]
            k_dst = {"same": k + value, "mirror": m - 1 - k + value, "first": value, "last": m - 1 - value}[kind]
            if not 0 <= k_dst < m:
                raise NotRegular("a rule points outside its run")
            target = ("run", run, k_dst, offset)
        if target not in idents:
            raise NotRegular("a rule frees what was never allocated")
        events.append(("free", idents.pop(target), 0))

    base = 0
    for kind, value in shape.layout:
        if kind == "base":
            for i in range(base, base + value):
                token = shape.base_tokens[i]
                if token[0] == "malloc":
                    malloc(("base", i), token[1])
                elif token[0] == "free":
                    free(rules[("base", i)]["interior"], 0)
                else:
                    events.append((token[0], -1, token[1]))
            base += value
            continue
        run, n = value, copies[value]
        for k in range(n):
            for offset, token in enumerate(shape.periods[run]):
                if token[0] == "malloc":
                    malloc(("run", run, k, offset), token[1])
                    continue
                rule = rules[("run", run, offset)]
                edge = next((rule.get(part) for part, names in EDGE_PARTS if names(k, n) and rule.get(part)), None)
                free(edge or rule["interior"], k)
    return events


def without_cut(events: list[Event], cut: tuple[int, int] | None) -> list[Event]:
    """The stream of a model built at its cut depth: without the blocks cut away after the
    build (``depth.at_depth``), whose allocations and frees a real build would not have."""
    if cut is None:
        return events
    start, end = cut
    gone = {ident for _, ident, _ in events[start:end]}
    return [e for i, e in enumerate(events) if not (start <= i < end or e[1] in gone)]


def _checked_depths(shape: _Shape, depths: tuple[int, int, int]) -> tuple[int, ...]:
    """The depths whose traced streams the rules must write, event for event: the two smaller
    ones. Where a run has no copy at the smallest depth (FSDP2's backward run holds two blocks
    fewer than the depth: at depth 2 it is empty, and a fixed free that names its last copy at
    depths 3 and 4 frees something else there), the smallest is left out and the largest, the
    one the rules were learnt at, is written too; the middle one must always be written."""
    d0, d1, d2 = depths
    if min((d1 + c for c in shape.copies_offset), default=1) < 1:
        raise NotRegular(f"a run has no copy at depth {d1}: nothing checks its rules")
    if min((d0 + c for c in shape.copies_offset), default=1) >= 1:
        return d0, d1
    return d1, d2


def extend(streams: dict[int, list[Event]], depth: int) -> list[Event] | None:
    """The stream of the model at ``depth`` blocks from streams traced at three consecutive
    small depths (fresh processes, cut blocks removed), or None when it cannot be written
    from them exactly (the caller then traces the whole model)."""
    d0, d1, d2 = sorted(streams)
    if (d1, d2) != (d0 + 1, d0 + 2):
        raise ValueError(f"three consecutive depths are needed, got {d0}, {d1}, {d2}")
    tokens = {d: _tokens(streams[d]) for d in (d0, d1, d2)}
    try:
        shapes, rules = [], []
        for d in (d1, d2):
            runs = _runs(tokens[d - 1], tokens[d])
            shape, labels = _labels(streams[d], runs, d)
            shapes.append(shape)
            rules.append(_rules(streams[d], labels, tuple(r.copies for r in runs)))
        if shapes[0] != shapes[1]:
            raise NotRegular("the two depths have different layouts")
        agreed = _agree(*rules)
        for d in _checked_depths(shapes[0], (d0, d1, d2)):
            if _canonical(_write(shapes[0], agreed, d)) != _canonical(streams[d]):
                raise NotRegular(f"the rules do not write the stream traced at depth {d}")
        return _write(shapes[0], agreed, depth)
    except NotRegular:
        return None


SIDE_STREAMS = 64
"""Side streams a tagged size can name (FSDP2 uses two: all-gather copy-in, reduce-scatter)."""


def tag_streams(events: list[Event], streams: Mapping[int, int]) -> list[Event]:
    """``events`` with the size of each malloc made on a side stream (``MemoryTracker.streams``)
    written as ``-(nbytes * SIDE_STREAMS + stream)``: a token of its own, so :func:`extend`
    never mistakes it for a default-stream malloc of the same size and carries the stream into
    every copy it writes. :func:`untag_streams` reads it back."""
    if not streams:
        return events
    return [(kind, ident, -(nbytes * SIDE_STREAMS + streams[ident]))
            if kind == "malloc" and ident in streams else (kind, ident, nbytes)
            for kind, ident, nbytes in events]


def untag_streams(events: list[Event]) -> tuple[list[Event], dict[int, int]]:
    """(the events with their sizes back, ident -> side stream) of a :func:`tag_streams` stream."""
    out, streams = [], {}
    for kind, ident, nbytes in events:
        if kind == "malloc" and nbytes < 0:
            nbytes, streams[ident] = divmod(-nbytes, SIDE_STREAMS)
        out.append((kind, ident, nbytes))
    return out, streams
