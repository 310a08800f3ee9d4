"""A call's allocations written into the trace instead of run again: an RL step's generation loop.

Generating 144 tokens runs the model 144 times over a growing cache: 94% of the time tracing seed
003's GRPO step takes, twice per batch size (the warm-up step and the measured one), about ten
seconds each on fake tensors. What the loop allocates depends only on the shapes it is given (fake
tensors have no values: every completion runs to its full length), so:

- the same call at the same shapes (the measured step's generation, after the warm-up step's)
  allocates and frees what it did, in the same order: its recorded allocations are written again;
- at another number of rows, each allocation's size and shape are affine in the rows (a tensor of
  the loop has the rows as a dimension, or no part of them), so the call's allocations are the line
  through two recorded sizes. The line is used only after a third size, traced, matched it event for
  event (every size, shape, op and order), and only between the smallest and the largest size
  recorded; outside them the call runs, and is checked against the line again.

Written allocations go through the tracker's own counting (``MemoryTracker.count``), so peaks,
phases, parts, breakdowns and the allocation stream are what running the call would have made. A call
that does anything else (frees what it did not allocate, changes phase, allocates on a side stream or
the host, leaves alive anything but the tensor it returns) is never written: it runs every time.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # trace/point.py imports this module before anything needs torch (a cached answer never does)
    import torch

Item = tuple
"""("malloc", requested bytes, op, shape, dtype, module), ("free", index of the malloc among the
call's), or ("segment", where the phase's run over the blocks moved to: ``MemoryTracker.set_segment``)."""


@dataclass(frozen=True)
class Recorded:
    """What one call allocated, freed and moved, in order."""

    items: tuple[Item, ...]
    result: int
    """Index (among the call's mallocs) of the storage of the tensor the call returned."""
    segment: int
    """Where the phase's run over the blocks was when the call began."""


@dataclass
class WrittenCalls:
    """The calls of one tracker recorded so far, and how each size's call was had."""

    recorded: dict[Hashable, dict[int, Recorded]] = field(default_factory=dict)
    line_holds: dict[Hashable, bool] = field(default_factory=dict)
    """By call: whether a third traced size matched the line through the first two (absent: not checked yet)."""
    how: dict[int, set[str]] = field(default_factory=dict)
    """By rows: "traced", "repeated" (a recorded call written again) and/or "line" (written from the line)."""
    checked_at: list[int] = field(default_factory=list)
    """Rows traced and compared with the line, event for event."""
    _keys: itertools.count = field(default_factory=lambda: itertools.count(1))

    def summary(self) -> dict:
        """For the result's JSON: which sizes' generation was traced, written again, or written from the line."""
        return summary(self.how, self.checked_at)


def summary(how: Mapping[int, Iterable[str]], checked_at: Iterable[int]) -> dict:
    """``{"traced", "repeated", "line": batch sizes, "checked_at": sizes that checked the line}`` from each
    size's kinds (``WrittenCalls.how``): estimate's ``written_generation``."""
    def sizes(kind: str) -> list[int]:
        return sorted(rows for rows, kinds in how.items() if kind in kinds)
    return {"traced": sizes("traced"), "repeated": sizes("repeated"), "line": sizes("line"),
            "checked_at": sorted(set(checked_at))}


def written_call(tracker, key: Hashable, rows: int, device: torch.device,
                 run: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``run()``, or its allocations written into ``tracker`` where they are known exactly (see the module
    docstring). ``tracker`` is the ``MemoryTracker`` counting the step (this module is below it: not named as a
    type). ``key`` names the call and everything but ``rows`` its allocations depend on (the shapes it is
    given, dtypes, the autocast and grad modes); it returns one tensor on ``device``."""
    if tracker.segment_marks is not None:  # inside a call being recorded
        return run()
    calls = tracker.written = tracker.written or WrittenCalls()
    known = calls.recorded.setdefault(key, {})
    how, written = "repeated", known.get(rows)
    if written is None and calls.line_holds.get(key) and min(known) <= rows <= max(known):
        how, written = "line", _line(known, rows)
    if written is not None and written.segment == tracker._segment:
        calls.how.setdefault(rows, set()).add(how)
        return _write(tracker, written, device, calls)
    out, recorded = _record(tracker, run)
    learn(calls, {key: recorded}, rows)
    return out


def learn(calls: WrittenCalls, recorded: dict[Hashable, Recorded | None], rows: int) -> None:
    """Take the calls traced at ``rows`` (None: one that cannot be written): kept, and checked against
    their line where one is known. Also for calls traced in a forked copy of the session (``trace/point.py``)."""
    calls.how.setdefault(rows, set()).add("traced")
    for key, made in recorded.items():
        known = calls.recorded.setdefault(key, {})
        if made is None:
            continue
        if len(known) >= 2 and calls.line_holds.get(key) is not False and rows not in known:
            calls.line_holds[key] = _line(known, rows) == made
            calls.checked_at.append(rows)
        known.setdefault(rows, made)


def traced_at(calls: WrittenCalls | None, rows: int) -> dict[Hashable, Recorded | None]:
    """The calls traced at ``rows`` (what :func:`learn` takes), e.g. to send from a forked process."""
    if calls is None or "traced" not in calls.how.get(rows, ()):
        return {}
    return {key: known.get(rows) for key, known in calls.recorded.items()}


def run_marked(tracker, run: Callable[[], object]) -> tuple[object, list[tuple[int, int]]]:
    """``run()``, and the segment moves it made (``MemoryTracker.segment_marks``: (event, segment))."""
    tracker.segment_marks = []
    try:
        out = run()
    finally:
        marks, tracker.segment_marks = tracker.segment_marks, None
    return out, marks


def _record(tracker, run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Recorded | None]:
    """Run the call, and what it did where it can be written again (None where it cannot)."""
    import torch

    start_event, start_clock, start_window = len(tracker.events), tracker.clock, len(tracker._window)
    phase, segment = tracker.current_phase, tracker._segment
    out, marks = run_marked(tracker, run)
    events = tracker.events[start_event:]
    if (not isinstance(out, torch.Tensor) or tracker.current_phase != phase
            or tracker.clock - start_clock != len(events)):  # a phase, or host memory (it moves the clock alone)
        return out, None
    records = tracker._window[start_window:]
    index = {record.seq: i for i, record in enumerate(records)}
    mallocs = [ident for kind, ident, _ in events if kind == "malloc"]
    if mallocs != [record.seq for record in records] or any(ident in tracker.streams for ident in mallocs):
        return out, None
    items: list[Item] = []
    marks_at = {}
    for at, moved_to in marks:
        marks_at.setdefault(at - start_event, []).append(moved_to)
    freed = set()
    for i, (kind, ident, requested) in enumerate(events):
        items += [("segment", moved_to) for moved_to in marks_at.get(i, ())]
        if kind == "malloc":
            r = records[index[ident]]
            items.append(("malloc", requested, r.op, r.shape, r.dtype, r.module))
        elif kind == "free" and ident in index:
            items.append(("free", index[ident]))
            freed.add(ident)
        else:  # a free of what the call did not make, or a mark
            return out, None
    items += [("segment", moved_to) for moved_to in marks_at.get(len(events), ())]
    alive = [ident for ident in mallocs if ident not in freed]
    held = tracker._live.get(id(out.untyped_storage()))
    if (len(alive) != 1 or held is None or held.seq != alive[0] or not out.is_contiguous()
            or out.storage_offset() != 0 or out.untyped_storage().nbytes() != out.numel() * out.element_size()):
        return out, None
    return out, Recorded(tuple(items), index[alive[0]], segment)


def _write(tracker, recorded: Recorded, device: torch.device, calls: WrittenCalls) -> torch.Tensor:
    """Count the recorded allocations, frees and moves again; the returned tensor is made for real
    (an empty one of its shape, counted as the op that made it)."""
    import torch

    keys: list[int] = []
    result = None
    try:
        for item in recorded.items:
            if item[0] == "malloc":
                _, requested, op, shape, dtype, module = item
                if len(keys) == recorded.result:
                    result = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                    key = id(result.untyped_storage())
                    made = tracker._live[key]
                    made.op, made.module = op, module
                else:
                    key = -next(calls._keys)  # storages are keyed by id(): positive
                    tracker.count(key, requested, op=op, shape=shape, dtype=dtype, module=module)
                keys.append(key)
            elif item[0] == "free":
                tracker._free(keys[item[1]])
            else:
                tracker.set_segment(item[1])
    except BaseException:  # out of memory on the virtual device: what was written dies, as tensors would
        for key in keys:
            if key < 0:
                tracker._free(key)
        raise
    tracker._block_output = None
    return result


def line_value(v1: int, v2: int, r1: int, r2: int, rows: int) -> int | None:
    """The value at ``rows`` on the line through ``(r1, v1)`` and ``(r2, v2)``; None where it is not a whole,
    non-negative number (bytes, a dimension). Also ``trace/stream_line.py``'s, for a stream's mallocs."""
    step, left = divmod((v2 - v1) * (rows - r1), r2 - r1)
    return None if left or v1 + step < 0 else v1 + step


def _line(known: dict[int, Recorded], rows: int) -> Recorded | None:
    """The call at ``rows`` from the line through the first two recorded sizes; None where they
    differ in anything but sizes, or a size at ``rows`` is not a whole number of bytes."""
    (r1, a), (r2, b) = itertools.islice(known.items(), 2)
    if len(a.items) != len(b.items) or a.result != b.result or a.segment != b.segment:
        return None

    items = []
    for x, y in zip(a.items, b.items):
        if x[0] != "malloc" or x == y:
            if x != y:
                return None
            items.append(x)
            continue
        if y[0] != "malloc" or x[2:3] + x[4:] != y[2:3] + y[4:] or len(x[3]) != len(y[3]):
            return None
        values = [line_value(v1, v2, r1, r2, rows) for v1, v2 in zip((x[1], *x[3]), (y[1], *y[3]))]
        if None in values:
            return None
        items.append(("malloc", values[0], x[2], tuple(values[1:]), x[4], x[5]))
    return Recorded(tuple(items), a.result, a.segment)
