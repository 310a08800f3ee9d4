"""Finding the largest batch size that fits, as pure functions of a probe.

A probe runs (or traces) one batch size and says whether it fit. Nothing here imports
torch, so the search is tested with synthetic probes. The answer is always a batch size
that was probed and fit, and the next size up (by ``multiple_of``) was probed and did not,
or is the cap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Trial:
    """One probe: did ``batch_size`` fit, and how many bytes did it peak at."""

    batch_size: int
    fits: bool
    peak_bytes: int | None = None


@dataclass
class SearchResult:
    max_batch_size: int
    """0 when even the smallest size did not fit."""
    trials: list[Trial]
    capped: bool = False
    """True when ``max_batch_size`` is the cap and was not shown to fail above it."""


def guided_search(probe: Callable[[int], Trial], predict: Callable[[list[Trial]], int], *,
                  multiple_of: int = 1, cap: int = 1 << 20, known: list[Trial] = (),
                  trusted_predictions: int = 3, max_probes: int = 64) -> SearchResult:
    """Probe the predicted maximum and its neighbour; bisect only where predictions miss.

    ``predict(trials)`` returns the predicted largest fitting batch (any int) from all the
    trials so far; it is clamped into the interval still unknown. ``known`` are trials
    already made (e.g. the points a curve was fitted on). A good prediction ends the search
    in two probes (the maximum and the size above it); after ``trusted_predictions`` probes
    the search bisects, so it ends in O(log cap) probes however wrong the predictions are.
    """
    m = multiple_of
    cap = max(cap // m * m, m)
    trials = list(known)
    fit = max((t.batch_size for t in trials if t.fits and t.batch_size % m == 0), default=0)
    fail = min((t.batch_size for t in trials if not t.fits), default=cap + m)
    fail = min(fail, cap + m)
    fit = min(fit, fail - m)
    own: list[Trial] = []
    while fail - fit > m and len(own) < max_probes:
        if len(own) < trusted_predictions:
            guess = predict(trials) // m * m
        else:
            guess = (fit + fail) // 2 // m * m
        guess = min(max(guess, fit + m), fail - m)
        trial = probe(guess)
        trials.append(trial)
        own.append(trial)
        if trial.fits:
            fit = guess
        else:
            fail = guess
    return SearchResult(max_batch_size=fit, trials=own, capped=fail > cap)
