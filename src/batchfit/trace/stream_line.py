"""A fresh process's allocation stream at another batch size, written from the line through two traced ones.

Each reserved probe replays the allocation stream of a fresh process (the model's build and its
first two steps) through the caching allocator model (``trace/allocator.py``). Tracing that stream
costs two steps at each of the shallow depths (Llama-3.1-70B under fsdp+cp8: about 7 s a size, most
of a plan's candidate). What the step allocates depends only on the shapes it is given (fake tensors
have no values), and each allocation is a tensor with the batch as a dimension or none of it, so its
requested bytes are affine in the batch: where two fresh streams at sizes ``b1 < b2`` have the same
events (the same mallocs and frees, in the same order, on the same streams, with the same step
starts), each malloc's bytes at another size are the line through its two sizes.

The line is used only after a third traced stream matched it event for event, and only between the
smallest and the largest traced size it was checked against: a size outside them is traced (and checked
again). What could differ inside them is a step whose events change with the batch size without showing
at the three traced ones (a kernel or a chunk count chosen by size that flips twice between them): none
is known on the traced paths (a chunked loss's chunk count only grows with the batch, and a count equal
at both ends is the same between them). The allocator model then replays the written stream exactly as a
traced one; the sizes written this way are named in the plan's JSON and report.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

Stream = tuple[list[tuple[str, int, int]], tuple[int, ...], Mapping[int, int]]
"""(events, where each step after the build starts, ident -> side stream): ``plan.deep``'s fresh stream."""


def _line(known: dict[int, Stream], size: int) -> Stream | None:
    """The stream at ``size`` from the line through the smallest and the largest of ``known``; None
    where they differ in anything but malloc sizes, or a size at ``size`` is not a whole number of bytes."""
    (b1, (e1, starts1, sides1)), (b2, (e2, starts2, sides2)) = min(known.items()), max(known.items())
    if len(e1) != len(e2) or starts1 != starts2 or dict(sides1) != dict(sides2):
        return None
    events = []
    for (kind, ident, n1), (kind2, ident2, n2) in zip(e1, e2):
        if kind != kind2 or ident != ident2:
            return None
        if n1 == n2:
            events.append((kind, ident, n1))
            continue
        step, left = divmod((n2 - n1) * (size - b1), b2 - b1)
        if left or n1 + step < 0:
            return None
        events.append((kind, ident, n1 + step))
    return events, starts1, dict(sides1)


@dataclass
class StreamLine:
    """Fresh streams traced at batch sizes, and the line through them once a third matched it."""

    traced: dict[int, Stream] = field(default_factory=dict)
    """The fresh streams traced so far, by size: of each shape (events but their sizes), the smallest,
    the largest and the two newest between them (a batch of one often has fewer events: a copy of a
    tensor whose batch dimension is 1 can be a view)."""
    checked: tuple[int, ...] = ()
    """The sizes the line was drawn through and checked at (the smallest, the largest, the others);
    empty until a third size of one shape matched it."""
    written: list[int] = field(default_factory=list)
    """Sizes whose stream was written from the line, in the order asked."""
    _shapes: dict[int, int] = field(default_factory=dict)

    def add(self, size: int, stream: Stream) -> None:
        """A traced fresh stream: the line through the smallest and the largest of its shape, checked at
        the others kept (the two newest between them)."""
        self.traced[size], self._shapes[size] = stream, _shape(stream)
        alike = [b for b in self.traced if self._shapes[b] == self._shapes[size]]  # in the order traced
        ends = (min(alike), max(alike))
        between = [b for b in alike if b not in ends]
        for b in between[:-2]:
            del self.traced[b], self._shapes[b]
        line = {b: self.traced[b] for b in ends}
        checks = between[-2:]
        self.checked = ()
        if checks and all(_line(line, b) == _normal(self.traced[b]) for b in checks):
            self.checked = (*ends, *checks)

    def alike(self, size: int) -> int:
        """How many sizes traced so far have the same shape as ``size``'s stream."""
        return sum(shape == self._shapes.get(size) for shape in self._shapes.values())

    def at(self, size: int) -> Stream | None:
        """The stream at ``size`` written from the checked line; None outside its sizes or before it is checked."""
        if not self.checked or not min(self.checked) <= size <= max(self.checked):
            return None
        found = _line({b: self.traced[b] for b in self.checked[:2]}, size)
        if found is not None:
            self.written.append(size)
        return found

    def summary(self) -> dict:
        """The JSON's: the sizes written, and the traced ones the line was drawn through and checked at."""
        return {"written": list(self.written), "through": list(self.checked[:2]), "checked_at": list(self.checked[2:])}


def _shape(stream: Stream) -> int:
    """A digest of a stream's events but their sizes, its step starts and side streams."""
    events, starts, sides = stream
    return hash((tuple((kind, ident) for kind, ident, _ in events), tuple(starts), tuple(sorted(dict(sides).items()))))


def _normal(stream: Stream) -> Stream:
    events, starts, sides = stream
    return list(events), tuple(starts), dict(sides)
