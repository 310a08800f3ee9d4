"""Finding the largest batch size that fits, as pure functions of a probe.

A probe runs (or traces) one batch size and returns a Trial: ``ok``, ``oom`` or ``error``.
Nothing here imports torch, so every policy is tested with synthetic probes. A policy only
sees ``ok`` and ``oom``: the caller stops the search on ``error`` (raise from the probe).

Every policy answers with a batch size it probed and that fit (or 0), and the smallest size
above it that it probed and that did not fit (or the cap). The answer is *exact* when that
size is the next one up by ``multiple_of``; ``guided``, ``binsearch`` and ``linear`` always
are, Lightning's ``power`` and Accelerate's ``halving`` usually are not, and say so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Trial:
    """One probe of one batch size."""

    batch_size: int
    status: str
    """ok, oom, or error (anything else that went wrong: never counted as out of memory)."""
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    step_time_s: float | None = None
    loss: float | None = None
    error: str | None = None
    """For oom and error: the exception's type and first line."""
    predicted_bytes: int | None = None
    """The tracer's prediction for this batch size, when there is one."""

    @property
    def fits(self) -> bool:
        return self.status == "ok"

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class SearchResult:
    max_batch_size: int
    """The largest probed batch that fit; 0 when even the smallest did not."""
    trials: list[Trial]
    """The probes this search made, in order."""
    next_size: int | None
    """The smallest size above the answer known not to fit: probed, or implied by a known
    failure at an off-grid size (21 failed, so 24 fails); None if none is known."""
    capped: bool
    """The answer is the largest size allowed (--max), so nothing above it was needed."""
    multiple_of: int = 1
    smallest: int = 1
    """The smallest size allowed (--min, rounded up to --multiple-of)."""

    @property
    def exact(self) -> bool:
        """Shown to be the largest: the next size up failed, or the answer is the cap."""
        above = self.max_batch_size + self.multiple_of if self.max_batch_size else self.smallest
        return self.capped or self.next_size == above


Probe = Callable[[int], Trial]


class NoProgress(RuntimeError):
    """A policy kept asking for sizes whose outcome was already known: a bug, not a search."""


class _Book:
    """What a policy has learnt so far; every probe goes through it.

    Memory grows with the batch size, so one trial decides many sizes: a fit at b means
    every size up to b fits, a failure at b means every size from b on fails. Known trials
    (and every probe) are read that way, onto the grid of multiples of ``m``.
    """

    IDLE_LIMIT = 64
    """Requests in a row whose outcome was already known before a policy is stopped."""

    def __init__(self, probe: Probe, lo: int, hi: int, m: int, known: list[Trial] = ()) -> None:
        self.probe, self.m = probe, m
        self.lo = max(-(-lo // m) * m, m)
        self.hi = max(hi // m * m, self.lo)
        self.trials: list[Trial] = []
        self.all = list(known)
        self._idle = 0
        # A known fit at 21 with m = 8 shows 16 fits; a known failure at 21 shows 24 fails.
        fits = [min(t.batch_size // m * m, self.hi) for t in known if t.fits and t.batch_size >= self.lo]
        fails = [max(-(-t.batch_size // m) * m, self.lo) for t in known if not t.fits]
        self.fit = max(fits, default=0)
        self.fail = min((b for b in fails if b > self.fit and b <= self.hi), default=None)

    def run(self, batch_size: int) -> Trial:
        batch_size = min(max(batch_size // self.m * self.m, self.lo), self.hi)
        if batch_size <= self.fit or (self.fail is not None and batch_size >= self.fail):
            self._idle += 1
            if self._idle > self.IDLE_LIMIT:
                raise NoProgress(f"the search asked {self._idle} times in a row for sizes it had decided "
                                 f"(largest fit {self.fit}, smallest failure {self.fail}, multiple of {self.m})")
            known = next((t for t in self.all if t.batch_size == batch_size), None)
            return known or Trial(batch_size, "ok" if batch_size <= self.fit else "oom")
        self._idle = 0
        trial = self.probe(batch_size)
        self.trials.append(trial)
        self.all.append(trial)
        if trial.fits:
            self.fit = max(self.fit, batch_size)
        elif self.fail is None or batch_size < self.fail:
            self.fail = batch_size
        return trial

    def closed(self) -> bool:
        return self.fit >= self.hi or (self.fail is not None and self.fail - self.fit <= self.m) or (
            self.fail == self.lo)

    def bisect(self) -> None:
        """Bisect between the largest fit and the smallest failure until they are adjacent."""
        while not self.closed():
            if self.fail is None:  # nothing failed yet: keep doubling
                self.run(min(max(self.fit * 2, self.lo), self.hi))
                continue
            low = max(self.fit, self.lo - self.m)
            self.run((low + self.fail) // 2 // self.m * self.m if self.fail - low > self.m else low + self.m)

    def result(self) -> SearchResult:
        return SearchResult(self.fit, self.trials, self.fail, capped=self.fit >= self.hi,
                            multiple_of=self.m, smallest=self.lo)


def guided(probe: Probe, predict: Callable[[list[Trial]], int], *, lo: int = 1, hi: int = 1 << 16,
           multiple_of: int = 1, known: list[Trial] = (), trusted_predictions: int = 3) -> SearchResult:
    """Probe the predicted maximum and its neighbour; bisect only where predictions miss.

    ``predict(trials)`` gives the predicted largest fitting batch from all trials so far (the
    tracer's curve, corrected by measured peaks). After ``trusted_predictions`` probes the
    search bisects, so it ends in O(log(hi)) probes however wrong the predictions are.
    """
    book = _Book(probe, lo, hi, multiple_of, known)
    m = book.m
    while not book.closed():
        if len(book.trials) >= trusted_predictions:
            book.bisect()
            break
        guess = predict(book.all) // m * m
        upper = book.fail - m if book.fail is not None else book.hi
        book.run(min(max(guess, book.fit + m, book.lo), upper))
    return book.result()


def _double_until_oom(book: _Book) -> None:
    """Lightning's first stage: lo, 2 lo, 4 lo, ... until one does not fit (or the cap)."""
    size = book.lo
    while book.fail is None and book.fit < book.hi:
        book.run(size)
        size = size * 2


def binsearch(probe: Probe, *, lo: int = 1, hi: int = 1 << 16, multiple_of: int = 1,
              known: list[Trial] = ()) -> SearchResult:
    """Lightning's ``binsearch``: double from ``lo`` until out of memory, then bisect."""
    book = _Book(probe, lo, hi, multiple_of, known)
    _double_until_oom(book)
    book.bisect()
    return book.result()


def power(probe: Probe, *, lo: int = 1, hi: int = 1 << 16, multiple_of: int = 1,
          known: list[Trial] = ()) -> SearchResult:
    """Lightning's ``power``: double from ``lo`` until out of memory; keep the last that fit."""
    book = _Book(probe, lo, hi, multiple_of, known)
    _double_until_oom(book)
    return book.result()


def halving(probe: Probe, *, lo: int = 1, hi: int = 1 << 16, multiple_of: int = 1,
            start: int | None = None, factor: float = 0.9, known: list[Trial] = ()) -> SearchResult:
    """Accelerate's ``find_executable_batch_size``: start at ``start`` (its
    ``starting_batch_size``, here the cap by default) and multiply by 0.9 after each
    out-of-memory until one fits."""
    book = _Book(probe, lo, hi, multiple_of, known)
    size = min(max(start or book.hi, book.lo), book.hi)
    while True:
        trial = book.run(size)
        if trial.fits or size <= book.lo:
            break
        smaller = int(size * factor) // book.m * book.m
        size = max(min(smaller, size - book.m), book.lo)
    return book.result()


def linear(probe: Probe, *, lo: int = 1, hi: int = 1 << 16, multiple_of: int = 1, start: int = 64,
           step: int = 16, known: list[Trial] = ()) -> SearchResult:
    """Seed 000's search by hand: start at 64, add 16 until out of memory (halving the start
    while it does not fit), then step by ``multiple_of`` up from the last size that fit."""
    book = _Book(probe, lo, hi, multiple_of, known)
    size = min(max(start, book.lo), book.hi)
    while not book.run(size).fits and size > book.lo:  # the start did not fit: halve it
        size = max(size // 2 // book.m * book.m, book.lo)
    while book.fail is None and book.fit < book.hi and book.fit:
        book.run(book.fit + max(step // book.m, 1) * book.m)
    while not book.closed():  # the fine search, one step at a time
        book.run(book.fit + book.m)
    return book.result()


POLICIES = ("guided", "power", "binsearch", "halving", "linear")

