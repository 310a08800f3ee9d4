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
