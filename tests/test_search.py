"""The search and the curve are pure: property-tested with synthetic probes.

Checked against synthetic probes whose answer is known by construction (no torch, no trace)."""

from __future__ import annotations

import contextlib
import signal

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tests.conftest import mlp_workload

from batchfit import search
from batchfit.devices import custom_device
from batchfit.estimator.engine import estimate
from batchfit.search import Trial, guided
from batchfit.trace.curve import fit_curve, fit_line
from batchfit.trace.point import allocated_point
from batchfit.trace.session import TraceSession
from batchfit.workload import StepOptions


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
    # an RL step runs multiples of its group: the pieces start at 8 and step by it (backward passes 5000 at 40)
    grouped = curve.pieces(100, multiple_of=8)
    assert [(p["phase"], p["from_batch"], p["to_batch"]) for p in grouped] == [("optimizer", 8, 32),
                                                                                ("backward", 40, 96)]


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


@contextlib.contextmanager
def deadline(seconds: float):
    """Fail instead of hanging: a search that loops is interrupted by SIGALRM."""
    def expire(signum, frame):
        raise TimeoutError(f"did not end within {seconds} s: a search loops")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def on_grid(limit: int, m: int, lo: int, hi: int) -> tuple[int, int, int]:
    """The smallest and largest allowed sizes, and the largest of them that fits."""
    low = max(-(-lo // m) * m, m)
    top = max(hi // m * m, low)
    best = min(limit // m * m, top)
    return low, top, best if best >= low else 0


@pytest.mark.parametrize("policy", search.POLICIES)
@given(limit=st.integers(0, 3000), m=st.sampled_from([1, 3, 8, 16]), lo=st.integers(1, 64),
       hi=st.integers(64, 4000), known_sizes=st.lists(st.integers(1, 6000), max_size=6))
def test_known_trials_anywhere_end_the_search_with_the_true_maximum(policy, limit, m, lo, hi, known_sizes):
    # Known trials agree with the probe (memory grows with the batch) but may lie off the
    # grid of multiples of m and outside [lo, hi]: estimate passes the user's --batch-sizes.
    known = [Trial(b, "ok" if b <= limit else "oom") for b in known_sizes]
    seen: list[int] = []
    with deadline(5):
        result = POLICY_CALLS[policy](threshold_probe(limit, seen), lo=lo, hi=hi, multiple_of=m, known=known)
    low, top, true_max = on_grid(limit, m, lo, hi)
    assert all(low <= b <= top and b % m == 0 for b in seen)
    assert len(seen) == len(set(seen)) and not set(seen) & set(known_sizes)  # nothing run twice
    best = result.max_batch_size
    assert best <= true_max
    if best:  # it ran (or was known to run) at exactly that size, and fit
        assert best in seen or best in known_sizes
    if not result.capped:
        assert result.next_size is not None and result.next_size > limit  # shown to fail
    if policy in ("guided", "binsearch", "linear"):
        assert result.exact and best == true_max


def test_a_known_failure_off_the_grid_does_not_loop():
    # Issue 7: --multiple-of 8 --batch-sizes 8,21 with 21 too big re-picked 8 forever,
    # because the failure at 21 was kept off the grid (21 - 8 > 8: never closed). A failure
    # at 21 means 24 fails too, so only 16 is left to try.
    seen: list[int] = []
    with deadline(5):
        result = guided(threshold_probe(16, seen), lambda trials: 13, lo=8, multiple_of=8,
                        known=[Trial(8, "ok"), Trial(21, "oom")])
    assert (result.max_batch_size, result.next_size, result.exact, seen) == (16, 24, True, [16])


@pytest.mark.parametrize("policy", search.POLICIES)
def test_every_policy_ends_on_the_issue_7_trials(policy):
    seen: list[int] = []
    with deadline(5):
        result = POLICY_CALLS[policy](threshold_probe(16, seen), lo=8, multiple_of=8,
                                      known=[Trial(8, "ok"), Trial(21, "oom")])
    assert result.max_batch_size in (8, 16) and result.next_size in (16, 24) and len(seen) <= 2


def test_a_fit_known_off_the_grid_is_run_before_it_is_the_answer():
    # A fit at 21 implies 16 fits, but the answer must be a size that ran (estimate reads
    # its traced peak): 16 is probed once, and nothing else is needed.
    seen: list[int] = []
    result = guided(threshold_probe(21, seen), lambda trials: 21, multiple_of=8,
                    known=[Trial(21, "ok"), Trial(22, "oom")])
    assert (result.max_batch_size, result.exact, seen) == (16, True, [16])


def test_a_known_fit_the_probe_contradicts_is_not_the_answer():
    # Memory should grow with the batch; if the probe says otherwise, trust what ran.
    seen: list[int] = []
    result = guided(threshold_probe(15, seen), lambda trials: 21, lo=8, multiple_of=8,
                    known=[Trial(21, "ok"), Trial(22, "oom")])
    assert (result.max_batch_size, result.next_size, result.exact, seen) == (0, 16, False, [16])


def test_a_known_failure_below_the_smallest_size_means_nothing_fits():
    seen: list[int] = []
    result = search.binsearch(threshold_probe(3, seen), lo=8, multiple_of=8, known=[Trial(5, "oom")])
    assert (result.max_batch_size, result.next_size, result.exact, seen) == (0, 8, True, [])


def test_asking_for_a_size_already_known_is_an_internal_error():
    book = search._Book(threshold_probe(100, []), 1, 1000, 8, known=[Trial(32, "ok"), Trial(64, "oom")])
    for size in (8, 32, 64, 80):  # below the fit, the fit, the failure, above the failure
        with pytest.raises(RuntimeError, match="already known"):
            book.run(size)


def test_estimate_with_batch_sizes_off_the_multiple_ends():
    # batchfit estimate --multiple-of 8 --batch-sizes 8,21 on a device where 21 does not fit.
    # A wide, shallow MLP: its activations (not its few weights) set the peak at these sizes.
    workload = mlp_workload(d_in=4, d_hidden=16384)
    device = custom_device(24 * 2**30)  # only its context and workspace sizes are read here
    with TraceSession(workload, StepOptions()) as session:
        peak = {b: allocated_point(session.trace(b), device.workspace_bytes).peak_bytes for b in (16, 21)}
    assert peak[16] < peak[21]
    # usable = total - context: choose it halfway between the peaks at 16 and 21.
    device = custom_device(device.context_bytes + (peak[16] + peak[21]) // 2)
    with deadline(60):
        result = estimate(workload, device=device, batch_sizes=[8, 21], multiple_of=8, target_util=1.0,
                          suggest=False, limit="allocated")  # the search is under test, not the allocator
    assert result.max_batch_size == 16 and result.point(16).peak_bytes == peak[16]


class _StandInCurve:
    """A curve whose every size is traced whole with its stream kept (as a generating step's is):
    allocated ``fixed + per_sample * b`` bytes, reserved ``ratio`` times that (exact lines, so the
    answers are known by hand), recording which sizes were traced and which replayed."""

    def __init__(self, fixed: int, per_sample: int, ratio: float) -> None:
        self.fixed, self.per_sample, self.ratio = fixed, per_sample, ratio
        self.points: dict[int, object] = {}
        self.traced: list[int] = []
        self.replayed: list[int] = []

    def point(self, b: int):
        from batchfit.trace.point import MemoryPoint

        if b not in self.points:
            self.traced.append(b)
            peak = self.fixed + self.per_sample * b
            self.points[b] = MemoryPoint(b, peak, {}, "backward", {"backward": peak}, [])
        return self.points[b]

    def reserved(self, b: int):
        point = self.point(b)
        if point.reserved_ratio is None:
            self.replayed.append(b)
            point.peak_reserved_bytes, point.reserved_ratio = int(point.peak_bytes * self.ratio), self.ratio
        return point

    def curve(self):
        return fit_curve({b: p.peak_by_phase for b, p in self.points.items()})


class _FreeReplays(_StandInCurve):
    def replay_is_free(self, b: int) -> bool:
        return True


@pytest.mark.parametrize("limit", [5_000, 9_999, 10_000, 17_600, 23_000])
def test_a_free_replay_spares_the_allocated_bound_above_the_reserved_answer(limit):
    # allocated 1000 + 100 b, reserved 1.1 x that: the largest multiple of 8 whose 1100 + 110 b fits the limit.
    # Where a size's replay needs no more tracing it is replayed as probed, so a size that fits allocated
    # but not reserved ends the allocated search: the answer is the same, and no size above the reserved
    # answer's failure is traced to confirm the allocated one.
    answer = max((limit - 1100) // 110 // 8 * 8, 0)
    answers, traced = [], []
    for curve in (_StandInCurve(1000, 100, 1.1), _FreeReplays(1000, 100, 1.1)):
        for b in (8, 16):
            curve.point(b)
        found = search.curve_search(curve, limit, lo=8, hi=1 << 16, multiple_of=8, reserved=True)
        assert found.exact
        answers.append(found.max_batch_size)
        traced.append(curve.traced)
    assert answers == [answer, answer]
    allocated_failure = (limit - 1000) // 100 // 8 * 8 + 8  # what confirms the allocated answer
    assert set(traced[1]) <= set(traced[0])
    if allocated_failure > answer + 8:  # reserved decides: that size is traced only without free replays
        assert allocated_failure in traced[0] and allocated_failure not in traced[1]


def test_after_its_trusted_guesses_a_prediction_at_the_fit_probes_the_size_above_once():
    """The curve says 32 once 28 and 32 fit and 74 did not (a 70B pipeline's): the next size, 34, is
    probed and fails, where bisecting would have run 52, 42, 36 and 34. A prediction that keeps saying
    the fit gets that one probe only, then bisection (limit 41: 34 fits, then 54, 44, 38, 40, 42)."""
    guesses = iter([74, 28, 32])
    seen: list[int] = []
    result = guided(threshold_probe(33, seen), lambda trials: next(guesses, 32), lo=2, multiple_of=2)
    assert (result.max_batch_size, result.next_size, seen) == (32, 34, [74, 28, 32, 34])
    guesses, seen = iter([74, 28, 32]), []

    def the_fit_again(trials: list[Trial]) -> int:
        return next(guesses, None) or max(t.batch_size for t in trials if t.fits)

    result = guided(threshold_probe(41, seen), the_fit_again, lo=2, multiple_of=2)
    assert (result.max_batch_size, seen) == (40, [74, 28, 32, 34, 54, 44, 38, 40, 42])
