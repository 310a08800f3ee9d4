"""plan's memory curve (``ShardedCurve.curve``): one line per phase, and per pipeline rank, by hand.

Rank 0 of a made-up strategy (GiB): its optimizer step peaks at 40 whatever the batch, its backward
at 10 + b. At b = 1, 2, 4 the optimizer step is the peak (40, flat), so a line through the step's
own peaks is flat and says any batch fits; the backward's own line (10 + b) says 60 fit 70 GiB:
60 is traced (70, fits) and 61 (71, does not), and the search ends there.
"""

from __future__ import annotations

from batchfit.devices import GiB
from batchfit.distributed.strategy_name import Strategy
from batchfit.plan.engine import ShardedCurve
from batchfit.plan.sharded import ShardedPoint
from batchfit.trace.curve import envelope

STRATEGY = Strategy("fsdp", 8, 8, 1, "fsdp")


def _point(b: int, by_phase: dict[str, int], stages: tuple[int, ...] = ()) -> ShardedPoint:
    peak = max(*by_phase.values(), *stages)  # a pipeline's point: its largest rank's peak
    return ShardedPoint(STRATEGY, b, peak, {"workspace": 0}, 0, (), 1, 1, peak_by_phase=by_phase,
                        stage_peak_bytes=stages)


def _flat_then_growing(b: int) -> ShardedPoint:
    return _point(b, {"forward": (5 + b // 2) * GiB, "backward": (10 + b) * GiB, "optimizer": 40 * GiB})


def test_each_phase_has_its_line_through_its_two_largest_sizes():
    curve = envelope({b: _flat_then_growing(b).peak_by_phase for b in (1, 2, 4)})
    lines = {line.phase: (line.fixed_bytes / GiB, line.bytes_per_sample / GiB) for line in curve.lines}
    assert lines == {"forward": (5, 0.5), "backward": (10, 1), "optimizer": (40, 0)}  # forward: 5+1, 5+2 at 2, 4
    assert curve.peak_bytes(4) == 40 * GiB and curve.peak_bytes(60) == 70 * GiB
    assert curve.max_batch_size(70 * GiB) == 60


def test_the_search_traces_the_predicted_size_and_the_next_only():
    traced = []

    def trace(b: int) -> ShardedPoint:
        traced.append(b)
        return _flat_then_growing(b)

    curve = ShardedCurve(trace, 0, lambda message: None)
    for b in (1, 2):
        curve.point(b)
    found = curve.max_batch(70 * GiB, lo=1, hi=1 << 16, multiple_of=1)
    assert (found.max_batch_size, found.next_size) == (60, 61)
    assert traced == [1, 2, 60, 61]


def test_a_pipeline_rank_that_is_not_the_largest_yet_has_its_own_line():
    """pp2: rank 1 (the head) is the largest at small batches, 24 + b/2 GiB; rank 0 (the most
    micro-batches in flight) grows faster, 10 + 2b, and passes 60 GiB first: at b = 26 (62 GiB),
    where rank 1 holds 37. The point carries the largest rank's phases: rank 1's at b = 2 and 4,
    whose line alone (as a line through the points' peaks, 25 and 26) says 72 fit."""
    def pipeline(b: int) -> ShardedPoint:
        ranks = ((10 + 2 * b) * GiB, (24 * GiB + b * GiB // 2))
        largest = max(range(2), key=lambda rank: ranks[rank])
        return _point(b, {"backward": ranks[largest], "optimizer": (8, 20)[largest] * GiB}, stages=ranks)

    curve = ShardedCurve(pipeline, 0, lambda message: None)
    for b in (2, 4):
        curve.point(b)
    assert curve.points[4].curve_peaks == {"backward": 26 * GiB, "optimizer": 20 * GiB,
                                           "pipeline rank 0": 18 * GiB, "pipeline rank 1": 26 * GiB}
    assert curve.curve().max_batch_size(60 * GiB) == 25
    found = curve.max_batch(60 * GiB, lo=2, hi=1 << 16, multiple_of=1)
    assert (found.max_batch_size, found.next_size, sorted(curve.points)) == (25, 26, [2, 4, 25, 26])


def test_a_tracer_without_phases_gets_one_line_through_its_peaks():
    """A stand-in that reports only the step's peak: the line through its two largest sizes, and the
    workspace it did not count added (3 GiB + 1 GiB per sample, 1 GiB of workspace)."""
    plain = ShardedCurve(lambda b: ShardedPoint(STRATEGY, b, (3 + b) * GiB, {}, 0, (), 1, 1), GiB,
                         lambda message: None)
    for b in (1, 2, 8):
        plain.point(b)
    assert plain.points[8].curve_peaks == {"step": 12 * GiB}
    (line,) = plain.curve().lines
    assert (line.phase, line.fixed_bytes, line.bytes_per_sample) == ("step", 4 * GiB, GiB)


class _Replay:
    """The allocator model's answer for a size: its reserved peak, and reserved over allocated."""

    def __init__(self, reserved_bytes: float, allocated_bytes: int) -> None:
        self.peak_reserved_bytes, self.reserved_oom = int(reserved_bytes), None
        self.reserved_ratio = reserved_bytes / allocated_bytes


def _searches(reserved_gib, capacity_gib: int, target_gib: int) -> tuple[int, int, list[int]]:
    """plan's two searches on a rank whose allocated peak is 10 + b GiB (a flat optimizer step of 10):
    the max local batch under the capacity, then the micro-batch under the target (at most that max);
    their answers and the sizes replayed, in order."""
    replayed = []

    def replay(b: int) -> _Replay:
        replayed.append(b)
        return _Replay(reserved_gib(b) * GiB, (10 + b) * GiB)

    curve = ShardedCurve(lambda b: _point(b, {"backward": (10 + b) * GiB, "optimizer": 10 * GiB}), 0,
                         lambda message: None, replay=replay)
    for b in (1, 2):
        curve.point(b)
    found = curve.max_batch(capacity_gib * GiB, lo=1, hi=1 << 16, multiple_of=1, reserved=True)
    at_target = curve.max_batch(target_gib * GiB, lo=1, hi=found.max_batch_size, multiple_of=1, reserved=True)
    return found.max_batch_size, at_target.max_batch_size, replayed


def test_the_target_search_starts_from_the_ratio_the_capacity_search_replayed():
    """Reserved 1.25 x allocated. Capacity 70 GiB: allocated says 60, reserved (12.5 + 1.25 b <= 70) 46.
    Target 50 GiB: allocated says 40, reserved (12.5 + 1.25 b <= 50) 30. The ratio the capacity's search
    replayed predicts 30 at once: 30 and 31 are the target's only replays (its first was at the
    allocated answer, 40, when it took ratios from its own replays only)."""
    assert _searches(lambda b: 1.25 * (10 + b), 70, 50) == (46, 30, [60, 46, 47, 30, 31])


def test_the_ratio_is_the_one_of_the_failure_nearest_the_answer():
    """Reserved 20 + 1.1 b GiB: the ratio to allocated grows as the size falls (1.19 at 90, 1.207 at 74).
    Capacity 100 GiB: 90 fails (119 GiB); its ratio puts the answer at 74 (100 / 1.19 = 84.0 GiB
    allocated), which fails (101.4); 74's own ratio puts it at 72 (99.2, fits), and 73 fails (100.3).
    With 90's ratio again the next guess was 74 once more, clamped to 73, and after three guesses the
    search bisected up from 36: 11 replays, not 6. Target 90 GiB: 20 + 1.1 b <= 90 at 63."""
    assert _searches(lambda b: 20 + 1.1 * b, 100, 90) == (72, 63, [90, 74, 72, 73, 64, 63])
