"""trace/matching.py: FastMatcher gives difflib's opcodes, event for event, on seeded streams.

Checked against difflib's own SequenceMatcher (the opcodes it gives)."""

from __future__ import annotations

import difflib
import random

import pytest

from batchfit.trace.matching import FastMatcher


def _stack(rng: random.Random, depth: int, alphabet: int) -> list[int]:
    """A stream shaped like a traced step's: fixed events around runs of one period per block,
    some periods repeated across the stream (a generation loop's tokens), few distinct events."""
    periods = [[rng.randrange(alphabet) for _ in range(rng.randint(1, 9))] for _ in range(4)]
    out: list[int] = []
    for _ in range(rng.randint(3, 12)):
        out += [rng.randrange(alphabet) for _ in range(rng.randint(0, 6))]
        out += rng.choice(periods) * depth
    return out


def _old(a: list, b: list) -> difflib.SequenceMatcher:
    return difflib.SequenceMatcher(None, a, b, autojunk=False)


@pytest.mark.parametrize("seed", range(40))
def test_opcodes_are_difflibs_on_streams_of_two_depths(seed: int) -> None:
    # the same shape at depths d and d + 1 (what stream.extend diffs), and the pair mutated
    rng = random.Random(seed)
    state = rng.getstate()
    shorter = _stack(rng, 3, alphabet=rng.choice([2, 3, 6]))
    rng.setstate(state)
    longer = _stack(rng, 4, alphabet=rng.choice([2, 3, 6]))
    mutated = [x if rng.random() > 0.02 else -1 for x in longer]
    for a, b in ((shorter, longer), (shorter, mutated), (longer, shorter)):
        for window in (1, 2, 4, 32):  # 1 and 2: nearly every call from the index; 32: nearly none
            assert FastMatcher(a, b, window=window).get_opcodes() == _old(a, b).get_opcodes()


@pytest.mark.parametrize("seed", range(10))
def test_longest_match_is_difflibs_in_any_ranges(seed: int) -> None:
    rng = random.Random(seed)
    a = [rng.randrange(3) for _ in range(300)]
    b = a[:100] + a[60:] + [rng.randrange(3) for _ in range(20)]
    fast, old = FastMatcher(a, b, window=3), _old(a, b)
    for _ in range(200):
        alo, ahi = sorted(rng.sample(range(len(a) + 1), 2))
        blo, bhi = sorted(rng.sample(range(len(b) + 1), 2))
        assert fast.find_longest_match(alo, ahi, blo, bhi) == old.find_longest_match(alo, ahi, blo, bhi)


def test_indexed_runs_are_every_long_run() -> None:
    # a = xxxx ABCDEFG yy, b = ABCDEFG zz ABCDEFG: two runs of 7 with a; window 4 indexes runs >= 7
    a = list("xxxxABCDEFGyy")
    b = list("ABCDEFGzzABCDEFG")
    assert sorted(FastMatcher(a, b, window=4)._runs) == [(7, 4, 0), (7, 4, 9)]
    assert FastMatcher(a, b, window=4).find_longest_match() == (4, 0, 7)  # the first in b, as difflib
