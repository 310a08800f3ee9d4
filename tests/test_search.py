"""The search and the curve are pure: property-tested with synthetic probes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchfit import search
from batchfit.search import Trial, guided
from batchfit.trace.curve import fit_curve, fit_line


def threshold_probe(limit: int, seen: list[int]):
    def probe(b: int) -> Trial:
        seen.append(b)
        return Trial(b, "ok" if b <= limit else "oom", peak_allocated_bytes=b * 1000)

    return probe


@given(limit=st.integers(0, 5000), guess=st.integers(-10, 10000), m=st.sampled_from([1, 2, 8, 16]),
       cap=st.integers(16, 6000))
def test_guided_is_exact_whatever_it_predicts(limit, guess, m, cap):
    seen: list[int] = []
    result = guided(threshold_probe(limit, seen), lambda trials: guess, multiple_of=m, hi=cap)
    top = max(cap // m * m, m)
    assert result.max_batch_size == (min(limit // m * m, top) if limit >= m else 0)
    assert result.exact


def test_a_good_prediction_costs_two_probes():
    seen: list[int] = []
    result = guided(threshold_probe(193, seen), lambda trials: 193, hi=4096)
    assert result.max_batch_size == 193 and seen == [193, 194]


def test_line_fit_is_exact_on_a_line():
    line = fit_line("backward", [(1, 1100), (2, 1200), (10, 2000)])
    assert (line.fixed_bytes, line.bytes_per_sample) == pytest.approx((1000, 100))


def test_curve_is_the_envelope_of_the_phases():
    curve = fit_curve({1: {"optimizer": 5000, "backward": 1100}, 2: {"optimizer": 5000, "backward": 1200}})
    assert curve.peak_bytes(1) == 5000 and curve.peak_bytes(100) == 11000
    assert curve.max_batch_size(10_000) == 90
    assert curve.max_batch_size(10_000, multiple_of=8) == 88
    assert curve.max_batch_size(4000) == 0  # the optimizer step alone does not fit
    pieces = curve.pieces(100)
    assert [p["phase"] for p in pieces] == ["optimizer", "backward"] and pieces[1]["from_batch"] == 40


POLICY_CALLS = {
    "guided": lambda probe, **kw: search.guided(probe, lambda trials: 100, **kw),
    "binsearch": search.binsearch,
    "power": search.power,
    "halving": search.halving,
    "linear": search.linear,
}


@pytest.mark.parametrize("policy", search.POLICIES)
@given(limit=st.integers(0, 3000), m=st.sampled_from([1, 4, 8, 16]), lo=st.integers(1, 64),
       hi=st.integers(64, 4000))
def test_every_policy_answers_with_a_size_that_ran_and_a_failure_or_the_cap_above(policy, limit, m, lo, hi):
    seen: list[int] = []
    result = POLICY_CALLS[policy](threshold_probe(limit, seen), lo=lo, hi=hi, multiple_of=m)
    low, top = max(-(-lo // m) * m, m), max(hi // m * m, max(-(-lo // m) * m, m))
    assert all(low <= b <= top for b in seen)  # never outside [min, max]
    assert len(seen) == len(set(seen))  # never the same size twice
    best = result.max_batch_size
    if best:
        assert best in seen and best <= limit  # it ran, and it fit
    else:
        assert low in seen and low > limit  # even the smallest allowed size failed
    if result.capped:
        assert best == top
    else:
        assert result.next_size in seen and result.next_size > limit  # shown to fail
    if policy in ("guided", "binsearch", "linear"):
        assert result.exact


@st.composite
def known_trials(draw):
    """A true maximum and known trials consistent with it, on and off the grid, some outside [lo, hi]."""
    limit = draw(st.integers(0, 3000))
    sizes = draw(st.lists(st.integers(1, 5000), max_size=6))
    return limit, [Trial(b, "ok" if b <= limit else "oom") for b in sizes]


@pytest.mark.parametrize("policy", search.POLICIES)
@given(case=known_trials(), m=st.sampled_from([1, 4, 8, 16]), lo=st.integers(1, 64), hi=st.integers(64, 4000))
def test_known_trials_end_the_search_on_the_grid(policy, case, m, lo, hi):
    limit, known = case
    seen: list[int] = []
    result = POLICY_CALLS[policy](threshold_probe(limit, seen), lo=lo, hi=hi, multiple_of=m, known=known)
    low = max(-(-lo // m) * m, m)
    top = max(hi // m * m, low)
    assert len(seen) == len(set(seen)) and all(b % m == 0 for b in seen)
    assert all(b not in seen for b in (t.batch_size for t in known))  # never re-probes what it knew
    if policy in ("guided", "binsearch", "linear"):
        assert result.exact
        assert result.max_batch_size == (min(limit // m * m, top) if limit >= low else 0)


def test_a_known_failure_off_the_grid_does_not_hang():
    """The issue: --multiple-of 8 --batch-sizes 8,21 with 21 too large looped forever."""
    seen: list[int] = []
    result = guided(threshold_probe(16, seen), lambda trials: 100, lo=8, hi=4096, multiple_of=8,
                    known=[Trial(8, "ok"), Trial(21, "oom")])
    assert result.max_batch_size == 16 and result.exact and seen == [16]


def test_a_policy_that_makes_no_progress_raises():
    book = search._Book(threshold_probe(10, []), 1, 100, 1, known=[Trial(5, "ok")])
    with pytest.raises(search.NoProgress, match="decided"):
        for _ in range(search._Book.IDLE_LIMIT + 1):
            book.run(3)  # already known to fit: asking again and again is a policy bug
