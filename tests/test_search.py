"""The search and the curve are pure: property-tested with synthetic probes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchfit.search import Trial, guided_search
from batchfit.trace.curve import fit_curve, fit_line


def threshold_probe(limit: int, seen: list[int]):
    def probe(b: int) -> Trial:
        seen.append(b)
        return Trial(b, b <= limit, b * 1000)

    return probe


@given(limit=st.integers(0, 5000), guess=st.integers(-10, 10000), m=st.sampled_from([1, 2, 8, 16]),
       cap=st.integers(16, 6000))
def test_guided_search_answer_was_probed_and_the_next_size_failed(limit, guess, m, cap):
    seen: list[int] = []
    result = guided_search(threshold_probe(limit, seen), lambda trials: guess, multiple_of=m, cap=cap)
    best = result.max_batch_size
    top = max(cap // m * m, m)
    assert best == min(limit // m * m, top)  # exact
    assert all(m <= b <= top and b % m == 0 for b in seen)
    if best:
        assert best in seen
    if result.capped:
        assert best == top
    else:
        assert best + m in seen


def test_a_good_prediction_costs_two_probes():
    seen: list[int] = []
    result = guided_search(threshold_probe(193, seen), lambda trials: 193, cap=4096)
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
