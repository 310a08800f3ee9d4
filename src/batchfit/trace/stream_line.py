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
at the three traced ones (a kernel or a chunk count chosen by size that flips twice between them). Three
guards:

- a size whose stream has other events than the line's, traced between its ends, leaves the line
  unchecked: its events do not stay the same between them;
- a step that chooses a chunk by the batch and not monotonically is refused by name (:func:`refusal`):
  the fused-linear loss cuts its rows in chunks of a power of two (``train/losses.py: _chunk_size``), so
  its chunks are 3 at 3, 5, 6 and 9 to 12, 4 at 4, 7, 8 and 13 to 16 (rows of 128 tokens, vocab 4 x hidden),
  and the line through 3 and 9, checked at 5, wrote chunks of 320 rows at 6 where the step has 256
  (benchmarks/stream_line_families.py);
- where the step rounds a count from the batch (:func:`rounds_by_batch`: an MoE's tokens per expert,
  ``balanced`` with a remainder or ``capacity:F``; ``ep``'s tokens // ranks; the fused RMSNorm's
  weight-gradient partials, ceil(rows / 32), ``trace/cuda_norm.py``), a size is written only where
  ``size - min`` is a multiple of the traced sizes' differences' greatest common divisor ``d``. Such a
  count lies on the line only where the line is a whole number of its units: with the three traced counts
  on one line, it is at each such size (its slope times ``d`` is), and the rounded value lies within one
  of the unrounded function between the ends (it does at each end, and the difference is affine), so it
  is the line's value there. Qwen3-MoE with 8 experts at 99 tokens (198 routed a sample): through 2 and 10,
  checked at 6, the line gave an expert 99.5 tokens at 4 (1,592 bytes of indices) where the step routes
  99 (1,584), and 8's replay differed (benchmarks/stream_line_families.py). Bytes alone cannot tell such
  a count from a plain one (a ``[b, k]`` tensor's ``k b`` bytes are ``4k ceil((b - 2) / 4) + 2k`` at 2, 6
  and 10 too), so the rule is by the step's kind.

The allocator model then replays the written stream exactly as a traced one; the sizes written this way
are named in the plan's JSON and report.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from batchfit.trace.written import line_value

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
        nbytes = line_value(n1, n2, b1, b2, size)
        if nbytes is None:
            return None
        events.append((kind, ident, nbytes))
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
    refused: str | None = None
    """Why no size is written (:func:`refusal`): the step chooses a chunk by the batch that no line follows."""
    lattice: bool = False
    """The step rounds a count from the batch (:func:`rounds_by_batch`): sizes written only on the traced
    sizes' lattice."""
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
        if any(ends[0] < b < ends[1] for b in self.traced if self._shapes[b] != self._shapes[size]):
            return  # other events inside the line's sizes: they do not stay the same between its ends
        if checks and all(_line(line, b) == _normal(self.traced[b]) for b in checks):
            self.checked = (*ends, *checks)

    def at(self, size: int) -> Stream | None:
        """The stream at ``size`` written from the checked line; None outside its sizes, before it is checked,
        off the traced sizes' lattice where the step rounds by the batch (:attr:`lattice`), or refused."""
        if self.refused or not self.checked or not min(self.checked) <= size <= max(self.checked):
            return None
        if self.lattice and (size - min(self.checked)) % math.gcd(*(b - min(self.checked) for b in self.checked)):
            return None  # a count rounded from the batch need not be on the line here
        found = _line({b: self.traced[b] for b in self.checked[:2]}, size)
        if found is not None:
            self.written.append(size)
        return found

    def summary(self) -> dict:
        """The JSON's: the sizes written, and the traced ones the line was drawn through and checked at."""
        return {"written": list(self.written), "through": list(self.checked[:2]), "checked_at": list(self.checked[2:])}


def refusal(options) -> str | None:
    """Why a step under ``options`` (a ``workload.StepOptions``) cannot be written from a line, or None."""
    if str(getattr(options, "loss", "")).startswith("fused-linear"):
        return ("the fused-linear loss cuts its rows in chunks of a power of two chosen by the batch: its chunk "
                "count goes up and down between sizes")
    return None


def rounds_by_batch(*, moe: bool, expert_parallel: bool, tokens_per_sample: int | None, split: int = 1) -> bool:
    """Whether a step rounds a count from the batch: an MoE's experts (tokens per expert), expert parallelism
    (tokens // ranks), or a rank's tokens a sample perhaps not a multiple of 32 (the fused RMSNorm's partials,
    ceil(rows / 32) rows): ``split`` bounds the ranks a sample's tokens are cut over (cp's degree divides it);
    unknown tokens count as rounding."""
    return moe or expert_parallel or tokens_per_sample is None or tokens_per_sample % (32 * split) != 0


def _shape(stream: Stream) -> int:
    """A digest of a stream's events but their sizes, its step starts and side streams."""
    events, starts, sides = stream
    return hash((tuple((kind, ident) for kind, ident, _ in events), tuple(starts), tuple(sorted(dict(sides).items()))))


def _normal(stream: Stream) -> Stream:
    events, starts, sides = stream
    return list(events), tuple(starts), dict(sides)
