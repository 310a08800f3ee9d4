"""difflib's SequenceMatcher with a longest-match search that does not grow with the stream squared.

``trace/stream.py`` diffs the allocation streams of two depths with difflib (no junk, no
autojunk). Its ``get_matching_blocks`` asks ``find_longest_match`` for the longest common
run of two ranges, then recurses on the two sides; each call visits every pair of equal
events in its ranges. A stream of few distinct events (a GRPO step's generation loop
repeats the same few sizes once per token and block) makes that a count of pairs per call,
and the recursion peels the blocks one at a time: about n^2 per call, n^3 in all (32 new
tokens: 18 s per diff; 144: half an hour).

:class:`FastMatcher` keeps difflib's recursion and answers each call from an index of the
*long* common runs of the two whole sequences (each maximal run of equal events along a
diagonal ``j - i``, at least ``2 * window - 1`` events long), built once from windows of
``a`` sampled every ``window`` events. A call's answer is the longest of those runs clipped
to its ranges, ties going to the smallest ``i`` then ``j`` as difflib's loop order gives;
when no indexed run gives ``2 * window - 1`` events there (a short range, or ranges with
little in common) difflib's own search runs, on that small call only. So the opcodes are
difflib's, event for event (``tests/test_matching.py`` compares them on seeded streams).
"""

from __future__ import annotations

import difflib
from collections.abc import Hashable, Sequence

WINDOW = 32
"""Events per sampled window: runs of 63 events or more are indexed."""


class FastMatcher(difflib.SequenceMatcher):
    """``difflib.SequenceMatcher(None, a, b, autojunk=False)`` with an indexed ``find_longest_match``."""

    def __init__(self, a: Sequence[Hashable], b: Sequence[Hashable], *, window: int = WINDOW) -> None:
        super().__init__(None, a, b, autojunk=False)
        self.window = window
        self.min_indexed = 2 * window - 1
        self._runs = _long_runs(a, b, window)  # (length, i, j), longest first

    def find_longest_match(self, alo: int = 0, ahi: int | None = None, blo: int = 0,
                           bhi: int | None = None) -> difflib.Match:
        ahi = len(self.a) if ahi is None else ahi
        bhi = len(self.b) if bhi is None else bhi
        best_n, best_i, best_j = 0, 0, 0
        for length, i, j in self._runs:
            if length < best_n:
                break  # clipping only shortens a run: none after this one can tie
            shift = j - i
            start = max(i, alo, blo - shift)
            n = min(i + length, ahi, bhi - shift) - start
            if n > best_n or (n == best_n and n > 0 and (start, start + shift) < (best_i, best_j)):
                best_n, best_i, best_j = n, start, start + shift  # ties: the smallest i, then j
        if best_n >= self.min_indexed:
            return difflib.Match(best_i, best_j, best_n)
        # Every run of min_indexed events or more is indexed, so the answer here is shorter: difflib's
        return super().find_longest_match(alo, ahi, blo, bhi)


def _long_runs(a: Sequence[Hashable], b: Sequence[Hashable], window: int) -> list[tuple[int, int, int]]:
    """Every maximal run ``a[i:i + n] == b[j:j + n]`` (not extendable either way) with ``n >= 2 *
    window - 1``, as (n, i, j), longest first. Such a run covers a whole window of ``a`` starting
    at a multiple of ``window``, so looking each sampled window up among ``b``'s finds them all."""
    ids: dict[Hashable, int] = {}
    a_ids = [ids.setdefault(x, len(ids)) for x in a]
    b_ids = [ids.setdefault(x, len(ids)) for x in b]
    sampled: dict[tuple[int, ...], list[int]] = {}
    for q in range(0, len(a_ids) - window + 1, window):
        sampled.setdefault(tuple(a_ids[q:q + window]), []).append(q)
    last: dict[int, tuple[int, int]] = {}  # diagonal j - i -> the last run found on it, as (i, n)
    runs = []
    for j in range(len(b_ids) - window + 1):
        for q in sampled.get(tuple(b_ids[j:j + window]), ()):
            diagonal = j - q
            i, n = last.get(diagonal, (0, 0))
            if i <= q < i + n:  # a window of the run found last here (q only grows along a diagonal)
                continue
            start, end = q, q + window
            while start > 0 and start + diagonal > 0 and a_ids[start - 1] == b_ids[start - 1 + diagonal]:
                start -= 1
            while end < len(a_ids) and end + diagonal < len(b_ids) and a_ids[end] == b_ids[end + diagonal]:
                end += 1
            last[diagonal] = (start, end - start)
            if end - start >= 2 * window - 1:
                runs.append((end - start, start, start + diagonal))
    runs.sort(key=lambda run: -run[0])
    return runs
