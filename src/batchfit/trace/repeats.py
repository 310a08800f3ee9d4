"""Fold the written micro-batches of an accumulating step out of a stream, and write them back.

A traced step of N accumulated micro-batches runs two and writes 3..N as copies of the
second's events (``MemoryTracker.repeat_micro_batch``). Extending a stream to the model's
full depth (``trace/stream.py``) compares streams of three small depths; with all N
micro-batches in them that comparison (difflib, about quadratic in the length) costs minutes
at N = 16. So the extension runs on the streams *folded*: each written run of copies replaced
by two marks, ``('begin', -1, 0)`` where the second micro-batch began and ``('repeat', -1, n)``
where its n copies were, and the frees that named the last copy's survivors naming the
second's again. Marks ride through the extension as fixed events outside the block runs (one
per micro-batch, never one per block), and ``unfold`` writes the copies back into the
full-depth stream with the tracker's own rule: each copy allocates and frees what the second
did, freeing what the copy before it left where the second freed what the first left (matched
in allocation order, one for one), and later events free the last copy's survivors.
``fold`` checks its own work: the stream it gives back, unfolded, must be the traced one.
"""

from __future__ import annotations

from batchfit.trace import stream

Event = tuple[str, int, int]

MARKS = ("begin", "repeat")
"""The kinds of the two mark events; their ident is -1 (never an allocation's)."""


class NotFolded(Exception):
    """The stream's repeats cannot be folded or written back exactly."""


def fold(events: list[Event], repeats: list[tuple[int, int, int]]) -> list[Event]:
    """``events`` with each repeat ``(second micro-batch's start, copies' start, copies)``
    (positions in ``events``, in order) folded into marks. Raises NotFolded when the folded
    stream, unfolded, is not ``events`` (renamed idents aside)."""
    out: list[Event] = []
    back: dict[int, int] = {}  # the last copy's malloc ident -> the second micro-batch's
    done = 0
    for start, at, times in repeats:
        if not done <= start < at:
            raise NotFolded("repeats out of order")
        out += [(kind, back.get(ident, ident) if kind == "free" else ident, n) for kind, ident, n in events[done:start]]
        period = events[start:at]
        out += [("begin", -1, 0), *((kind, back.get(ident, ident) if kind == "free" else ident, n)
                                    for kind, ident, n in period), ("repeat", -1, times)]
        last = events[at + (times - 1) * len(period):at + times * len(period)]
        if len(last) != len(period):
            raise NotFolded("the written copies run past the stream")
        back.update({copy[1]: mine[1] for copy, mine in zip(last, period) if mine[0] == "malloc"})
        done = at + times * len(period)
    out += [(kind, back.get(ident, ident) if kind == "free" else ident, n) for kind, ident, n in events[done:]]
    if stream._canonical(unfold(out)) != stream._canonical(events):  # idents renamed in allocation order, marks kept
        raise NotFolded("the folded stream does not write the traced one back")
    return out


def unfold(events: list[Event]) -> list[Event]:
    """The stream with each ``begin`` ... ``repeat n`` span followed by its n copies, marks
    removed: what ``MemoryTracker.repeat_micro_batch`` wrote. Raises NotFolded when what a
    span frees from before it does not match, one for one in bytes, what it leaves alive."""
    if not any(kind in MARKS for kind, _, _ in events):
        return events
    fresh = max((ident for _, ident, _ in events), default=0)
    out: list[Event] = []
    nbytes: dict[int, int] = {}
    rename: dict[int, int] = {}  # a survivor of a second micro-batch -> its last copy's ident
    begin: int | None = None
    for kind, ident, n in events:
        if kind == "begin":
            begin = len(out)
            continue
        if kind == "free":
            ident = rename.pop(ident, ident)
        elif kind == "malloc":
            nbytes[ident] = n
        if kind != "repeat":
            out.append((kind, ident, n))
            continue
        if begin is None:
            raise NotFolded("a repeat mark with no begin mark")
        period, begin = out[begin:], None
        made = {i for k, i, _ in period if k == "malloc"}
        freed = {i for k, i, _ in period if k == "free"}
        before = [i for k, i, _ in period if k == "free" and i not in made]
        left = [i for k, i, _ in period if k == "malloc" and i not in freed]  # in allocation order
        order = {i: p for p, (k, i, _) in enumerate(out) if k == "malloc"}
        before.sort(key=lambda i: order.get(i, -1))
        if len(before) != len(left) or any(nbytes.get(a) != nbytes[b] for a, b in zip(before, left)):
            raise NotFolded("what the second micro-batch frees from before it is not what it leaves")
        stands_for = dict(zip(before, left))
        current = {i: i for i in left}
        for _ in range(n):
            ident_of: dict[int, int] = {}
            for k, i, size in period:
                if k == "malloc":
                    fresh += 1
                    ident_of[i] = fresh
                    out.append(("malloc", fresh, size))
                else:
                    out.append(("free", ident_of.pop(i) if i in ident_of else current[stands_for[i]], 0))
            current = {i: ident_of[i] for i in left}
        rename.update(current)
    return out
