"""Where to branch, for how long, which batch sizes: the branch plan fitted to the budget and
the grid, or a short sweep where branching cannot beat the sweep on cost. Pure arithmetic in
samples (no torch), so every case is checked by hand (``tests/test_recommend.py``).

A branch must hold ``MIN_STEPS`` whole steps at its batch size, so its window is at least that
many of the largest branched batch, whatever share of the budget ``--window`` asks; at a small
budget and a wide grid that window is a large share of the budget. The first plan, in this
order, that costs at most ``max_share`` of the sweep it replaces is the one that runs:

1. every batch size branched, at the configured branch points; then at the last point only
   (the earlier points give the critical batch size early on; the answer reads the last one);
2. the same two with the largest batch size left out, then the two largest, ... (at least
   ``MIN_BRANCHED`` stay): on a doubling grid each halves the window; the result says which
   batch sizes were not measured.

When no cut reaches ``max_share``, the cheapest plan runs if it still costs less than the
sweep; when even that costs as much as the sweep, the sweep itself is the cheaper plan: every
batch size trained on the whole budget (a short sweep: the budget is small), and the answer is
its best run. The command never trains more than the sweep it replaces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_STEPS = 2
"""Whole steps a branch takes at its batch size: one step is no comparison of rates of progress."""

MIN_BRANCHED = 3
"""Batch sizes branched at the least: fewer cannot place a best between neighbours."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The branch plan in samples, or the short sweep (``mode == "sweep"``)."""

    mode: str
    """branch, or sweep (every batch size trained on the whole budget from the start)."""
    batch_sizes: tuple[int, ...]
    """The batch sizes branched (all of them in a sweep)."""
    points: tuple[int, ...]
    """Branch points (samples the parent consumed); (0,) in a sweep: the runs start from the initial state."""
    window: int
    """Samples each branch trains (the whole budget in a sweep)."""
    seeds: int
    """Data windows at the last point (1 in a sweep)."""
    trained: int
    """Samples trained by the plan: the parent to its last point and every branch (x rates per batch)."""
    sweep_trained: int
    """Samples the sweep it replaces trains: the budget at every batch size and rate."""
    validated: int = 0
    """Samples validated: the parent at its start and each point, each branch at its end."""
    sweep_validated: int = 0
    """Samples the sweep validates (its own rule: ``config.sweep_validated``)."""
    notes: tuple[str, ...] = ()

    @property
    def share(self) -> float:
        """Trained and validated alike, as the result counts its cost."""
        return (self.trained + self.validated) / (self.sweep_trained + self.sweep_validated)


def branch_window(total: int, sizes: tuple[int, ...], window_share: float) -> int:
    """``window_share`` of the budget in whole steps of every branched size, at least
    ``MIN_STEPS`` steps of the largest."""
    step = math.lcm(*sizes)
    return max(int(window_share * total) // step * step, math.ceil(MIN_STEPS * sizes[-1] / step) * step)


def branch_points(total: int, b0: int, shares: tuple[float, ...], window: int, seeds: int) -> tuple[int, ...] | None:
    """The points at ``shares`` of the budget (whole steps of the parent's batch ``b0``), the last moved
    earlier so that its ``seeds`` windows end within the budget; None when no point leaves room."""
    latest = (total - seeds * window) // b0 * b0
    if latest < b0:
        return None
    return tuple(sorted({min(max(b0, round(p * total / b0) * b0), latest) for p in shares}))


def branch_layout(total: int, sizes: tuple[int, ...], shares: tuple[float, ...], *, window_share: float,
                  seeds: int, rates: int, eval_samples: int, sweep: Layout) -> Layout | None:
    window = branch_window(total, sizes, window_share)
    points = branch_points(total, sizes[0], shares, window, seeds)
    if points is None:
        return None
    branches = (len(points) + seeds - 1) * len(sizes) * rates
    return Layout(mode="branch", batch_sizes=sizes, points=points, window=window, seeds=seeds,
                  trained=points[-1] + branches * window, validated=(1 + len(points) + branches) * eval_samples,
                  sweep_trained=sweep.sweep_trained, sweep_validated=sweep.sweep_validated)


def lay_out(total: int, batch_sizes: list[int], *, point_shares: tuple[float, ...], window_share: float, seeds: int,
            rates: int, max_share: float, eval_samples: int = 0, sweep_validated: int = 0) -> Layout:
    """The first plan, in the module's order, that costs at most ``max_share`` of the sweep; else
    the cheapest, when it costs less than the sweep; else the sweep itself. ``eval_samples``: one
    validation pass; ``sweep_validated``: what the sweep validates (both 0: trained samples alone)."""
    sizes = tuple(sorted(batch_sizes))
    runs = len(sizes) * rates
    sweep = Layout(mode="sweep", batch_sizes=sizes, points=(0,), window=total, seeds=1, trained=total * runs,
                   validated=(2 + runs) * eval_samples, sweep_trained=total * runs, sweep_validated=sweep_validated)
    candidates = []
    for keep in range(len(sizes), min(MIN_BRANCHED, len(sizes)) - 1, -1):
        for shares in (point_shares, point_shares[-1:]) if len(point_shares) > 1 else (point_shares,):
            plan = branch_layout(total, sizes[:keep], shares, window_share=window_share, seeds=seeds, rates=rates,
                                 eval_samples=eval_samples, sweep=sweep)
            if plan is not None:
                candidates.append(plan)
    fits = [c for c in candidates if c.share <= max_share]
    if fits:
        return _explained(fits[0], sizes, point_shares, window_share, total)
    cheapest = min(candidates, key=lambda c: c.share, default=None)
    if cheapest is not None and cheapest.share < sweep.share:
        plan = _explained(cheapest, sizes, point_shares, window_share, total)
        return Layout(**{**plan.__dict__, "notes": (*plan.notes, f"no branch plan costs {max_share:.0%} of the sweep "
                                                               f"or less at this budget; the cheapest costs "
                                                               f"{cheapest.share:.0%}")})
    why = (f"the cheapest branch plan trains {cheapest.trained:,} samples, the sweep {sweep.trained:,}"
           if cheapest is not None else "no branch window of whole steps fits the budget")
    return Layout(**{**sweep.__dict__, "notes": (f"ran the sweep itself (every batch size on the whole budget, "
                                                 f"{sweep.trained:,} samples): branching cannot cost less here "
                                                 f"({why})",)})


def _explained(plan: Layout, sizes: tuple[int, ...], point_shares: tuple[float, ...], window_share: float,
               total: int) -> Layout:
    """The plan, with a note for each way it differs from what was asked."""
    notes = []
    asked = int(window_share * total)
    if plan.window > asked:
        notes.append(f"window {plan.window:,} samples ({plan.window / total:.1%} of the budget), not the "
                     f"{window_share:.0%} asked: {MIN_STEPS} whole steps at batch {plan.batch_sizes[-1]}")
    if len(plan.points) < len(point_shares):
        notes.append(f"branched at the last point only ({plan.points[-1]:,} samples), to cost less")
    left = sizes[len(plan.batch_sizes):]
    if left:
        notes.append(f"batch sizes {', '.join(map(str, left))} not branched (a window of {MIN_STEPS} steps at them "
                     f"costs too much at this budget): the answer is within {plan.batch_sizes[0]}-"
                     f"{plan.batch_sizes[-1]}")
    return Layout(**{**plan.__dict__, "notes": tuple(notes)})
