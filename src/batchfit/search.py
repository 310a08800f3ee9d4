"""Finding the largest batch size that fits, as pure functions of a probe.

A probe runs (or traces) one batch size and returns a Trial: ``ok``, ``oom`` or ``error``.
Nothing here imports torch, so every policy is tested with synthetic probes. A policy only
sees ``ok`` and ``oom``: the caller stops the search on ``error`` (raise from the probe).

Every policy answers with a batch size it probed (or was given as known) and that fit (or 0),
and the smallest size above it known not to fit (or the cap). The answer is *exact* when that
size is the next one up by ``multiple_of``; ``guided``, ``binsearch`` and ``linear`` always
are, Lightning's ``power`` and Accelerate's ``halving`` usually are not, and say so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from batchfit.errors import OptionError

DEFAULT_MAX_BATCH = 1 << 16
"""The largest batch (local batch, for plan) any search considers unless told otherwise."""


LIMITS: tuple[str, ...] = ("reserved", "allocated")
"""What must stay under the usable memory: what the caching allocator reserves, or what tensors hold."""


MAX_BATCH_SIZE = 1 << 24
"""The largest batch-like option batchfit takes (sizes, --max, --multiple-of, --global-batch):
beyond it the step's own tensor sizes overflow."""


def check_size(option: str, value: int | None) -> None:
    """One line for a size option above :data:`MAX_BATCH_SIZE` (an overflow deep in torch otherwise)."""
    if value is not None and value > MAX_BATCH_SIZE:
        raise OptionError(f"{option} must be at most {MAX_BATCH_SIZE:,} (2^24), got {value:,}")


def check_search_options(*, target_util: float, multiple_of: int, max_batch: int) -> None:
    """The options every batch-size search shares (estimate, plan)."""
    check_size("`multiple_of`", multiple_of)
    check_size("`max_batch`", max_batch)
    if not 0 < target_util <= 1:
        raise OptionError(f"`target_util` must be in (0, 1], e.g. 0.9; got {target_util}")
    if multiple_of < 1:
        raise OptionError(f"`multiple_of` must be 1 or more, got {multiple_of}")
    if max_batch < multiple_of:
        raise OptionError(f"`max_batch` ({max_batch}) must be at least `multiple_of` ({multiple_of})")


def check_estimate_options(*, target_util: float, multiple_of: int, batch_sizes: list[int] | None,
                           max_batch: int, limit: str) -> None:
    """Estimate's search options, checked before anything is traced (the CLI: before torch loads)."""
    check_search_options(target_util=target_util, multiple_of=multiple_of, max_batch=max_batch)
    for b in batch_sizes or []:
        if b < 1:
            raise OptionError(f"batch sizes must be 1 or more, got {b}: e.g. `batch_sizes` 8,16,32")
    _check_limit(limit)


def check_probe_options(*, policy: str, multiple_of: int, smallest: int, largest: int, steps: int,
                        target_util: float, global_batch: int | None, limit: str) -> None:
    """probe's options, checked before anything runs (the CLI: before torch loads)."""
    for option, value in (("`multiple_of`", multiple_of), ("`min`", smallest), ("`max`", largest),
                          ("`global_batch`", global_batch)):
        check_size(option, value)
    if policy not in POLICIES:
        raise OptionError(f"unknown `policy` '{policy}': use one of {', '.join(POLICIES)}")
    if multiple_of < 1 or smallest < 1 or largest < smallest:
        raise OptionError(f"need 1 <= `min` <= `max` and `multiple_of` >= 1 (got min {smallest}, "
                          f"max {largest}, multiple-of {multiple_of})")
    if steps < 2:
        raise OptionError(f"`steps` must be at least 2 (the second step has optimizer state), got {steps}")
    if not 0 < target_util <= 1:
        raise OptionError(f"`target_util` must be in (0, 1], e.g. 0.9; got {target_util}")
    if global_batch is not None and global_batch < 1:
        raise OptionError(f"`global_batch` must be 1 or more, got {global_batch}")
    _check_limit(limit)


def no_memory_limit(what: str, cap: str, sized: str) -> str:
    """Why a probe on a bare CPU is refused, and what to add (one line)."""
    return (f"{what} has no memory to run out of: it would double the batch with real CPU steps up to the cap. "
            f"Size memory for a GPU ({sized}), or give {cap} to time CPU steps up to it")


def _check_limit(limit: str) -> None:
    if limit not in LIMITS:
        raise OptionError(f"unknown `limit` '{limit}': use reserved (what a GPU runs out of) or allocated")


def trace_first_sizes(curve, batch_sizes: list[int] | None, multiple_of: int, usable_bytes: int, *,
                      larger_first: bool = False) -> None:
    """Trace ``batch_sizes`` on ``curve`` (a TracedCurve or plan's ShardedCurve: ``points`` by
    size, ``point(b)`` traces), or by default the first two multiples, the second only when the
    first fits ``usable_bytes`` (when the smallest does not fit, no larger one will).

    ``larger_first``: the default two the larger first, then the smaller always (for a session whose first
    trace is a fresh process's: plan's ``DeepSession`` keeps that stream as its stream line's small end, and a
    batch of two has the events of larger ones where a batch of one can have fewer, ``plan/deep.py``)."""
    sizes = sorted(set(batch_sizes or [multiple_of, 2 * multiple_of]))
    if larger_first and batch_sizes is None:
        for b in reversed(sizes):
            curve.point(b)
        return
    if len(sizes) > 1 and hasattr(curve, "trace_ahead"):  # a TracedCurve: the second on the second core, meanwhile
        curve.trace_ahead(sizes[1])
    for b in sizes:
        if batch_sizes is None and curve.points and curve.points[min(curve.points)].peak_bytes > usable_bytes:
            break
        curve.point(b)


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
    """The smallest size above the answer known not to fit: probed, or the multiple of
    multiple_of at or above a known failure off that grid; None if none is known."""
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


class _Book:
    """What a policy has learnt so far; every probe goes through it.

    Sizes live on the grid of multiples of ``m`` in [lo, hi]. ``fit`` is the largest grid
    size known to fit (0: none) and ``fail`` the smallest above it known not to (None: none).
    Every probe must be of a size strictly between them, so each one narrows the gap and a
    policy that asks for a size it already knows raises instead of looping: every search
    ends within as many probes as there are grid sizes.
    """

    def __init__(self, probe: Probe, lo: int, hi: int, m: int, known: list[Trial] = ()) -> None:
        self.probe, self.m = probe, m
        self.lo = max(-(-lo // m) * m, m)
        self.hi = max(hi // m * m, self.lo)
        self.trials: list[Trial] = []
        """The probes this search made (known trials excluded)."""
        self.all = list(known)
        """Known trials and probes: what ``guided`` gives its predictor."""
        self.ran: dict[int, Trial] = {}
        """Grid sizes with a trial of exactly that size: the only possible answers."""
        self.fits: set[int] = set()
        self.fails: set[int] = set()
        # Peak memory grows with the batch size, so a known trial says something about grid
        # sizes it did not run: a fit at b means every size <= b fits (the grid size at or below
        # b, or hi if b is above it), and a failure at b means every size >= b fails (the grid
        # size at or above b, or lo if b is below it: then nothing fits). A fit known only this
        # way is probed before it is given as the answer (``_confirm``).
        for t in known:
            b = t.batch_size
            if t.fits and min(b // m * m, self.hi) >= self.lo:
                self.fits.add(min(b // m * m, self.hi))
            elif not t.fits and max(-(-b // m) * m, self.lo) <= self.hi:
                self.fails.add(max(-(-b // m) * m, self.lo))
            if b % m == 0 and self.lo <= b <= self.hi:
                self.ran.setdefault(b, t)
        for b, t in self.ran.items():
            if not t.fits:
                self._failed(b)
        self._update()

    def _failed(self, batch_size: int) -> None:
        # What ran outweighs what is implied: a failure forgets the fits implied at or above
        # it (known trials that contradict each other, or a probe that contradicts them).
        self.fails.add(batch_size)
        self.fits = {b for b in self.fits if b < batch_size or b in self.ran and self.ran[b].fits}

    def _update(self) -> None:
        # A failure at or below a size that fit contradicts monotonicity (a flaky probe, or
        # known trials from elsewhere): trust what fit, as the answer must be a size that ran.
        self.fit = max(self.fits, default=0)
        self.fail = min((b for b in self.fails if b > self.fit), default=None)

    def grid(self, batch_size: int) -> int:
        """The grid size a policy means by ``batch_size``: rounded down, within [lo, hi]."""
        return min(max(batch_size // self.m * self.m, self.lo), self.hi)

    def unknown(self, batch_size: int) -> bool:
        """Whether probing ``batch_size`` (a grid size) can teach anything."""
        return self.fit < batch_size and (self.fail is None or batch_size < self.fail)

    def run(self, batch_size: int) -> Trial:
        batch_size = self.grid(batch_size)
        if not self.unknown(batch_size):
            raise RuntimeError(
                f"internal error in the batch-size search: it asked for {batch_size}, whose outcome "
                f"is already known (largest fit {self.fit}, smallest failure {self.fail}, lo {self.lo}, "
                f"hi {self.hi}, multiple_of {self.m}, {len(self.trials)} probes); please report this")
        return self._probe(batch_size)

    def _probe(self, batch_size: int) -> Trial:
        trial = self.probe(batch_size)
        self.trials.append(trial)
        self.all.append(trial)
        self.ran[batch_size] = trial
        if trial.fits:
            self.fits.add(batch_size)
        else:
            self._failed(batch_size)
        self._update()
        return trial

    def _confirm(self) -> None:
        """Probe the answer if it is only implied by a larger known fit off the grid."""
        while self.fit and self.fit not in self.ran:  # each pass lowers fit or confirms it
            self._probe(self.fit)

    def closed(self) -> bool:
        return self.fit >= self.hi or (self.fail is not None and self.fail - self.fit <= self.m) or (
            self.fail == self.lo)

    def bisect(self) -> None:
        """Bisect between the largest fit and the smallest failure until they are adjacent."""
        while not self.closed():  # run() raises rather than repeat a size: this ends
            if self.fail is None:  # nothing failed yet: keep doubling
                self.run(min(max(self.fit * 2, self.lo), self.hi))
                continue
            low = max(self.fit, self.lo - self.m)
            self.run((low + self.fail) // 2 // self.m * self.m if self.fail - low > self.m else low + self.m)

    def result(self) -> SearchResult:
        self._confirm()
        return SearchResult(self.fit, self.trials, self.fail, capped=self.fit >= self.hi,
                            multiple_of=self.m, smallest=self.lo)


def guided(probe: Probe, predict: Callable[[list[Trial]], int], *, lo: int = 1, hi: int = 1 << 16,
           multiple_of: int = 1, known: list[Trial] = (), trusted_predictions: int = 3) -> SearchResult:
    """Probe the predicted maximum and its neighbour; bisect only where predictions miss.

    ``predict(trials)`` gives the predicted largest fitting batch from all trials so far (the
    tracer's curve, corrected by measured peaks). After ``trusted_predictions`` probes the
    search bisects, so it ends in O(log(hi)) probes however wrong the predictions are; but
    once, where the prediction is the largest size known to fit, it first probes the size above
    it: that either ends the search or is a fit bisection would have found (a 70B pipeline's
    curve said 32 after 28 and 32 fit, 74 did not; bisecting traced 52, 42, 36, 34).
    """
    book = _Book(probe, lo, hi, multiple_of, known)
    m = book.m
    confirmed = False
    while not book.closed():  # open means fail - fit > m, so the size below lies between them
        guess = predict(book.all) // m * m
        if len(book.trials) >= trusted_predictions:
            if confirmed or not book.fit or guess > book.fit:
                book.bisect()
                break
            confirmed = True  # the one probe of the size above the fit the prediction stops at
        upper = book.fail - m if book.fail is not None else book.hi
        book.run(min(max(guess, book.fit + m, book.lo), upper))
    return book.result()


def _double_until_oom(book: _Book) -> None:
    """Lightning's first stage: lo, 2 lo, 4 lo, ... until one does not fit (or the cap)."""
    size = book.lo
    while book.fail is None and book.fit < book.hi:
        if book.unknown(book.grid(size)):  # skip sizes already known to fit
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
    size = book.grid(start or book.hi)
    while size > book.fit:  # a size known to fit ends it, as a probe that fits would
        if book.unknown(size) and book.run(size).fits:
            break
        if size <= book.lo:
            break
        smaller = int(size * factor) // book.m * book.m
        size = max(min(smaller, size - book.m), book.lo)  # always smaller: this ends
    return book.result()


def linear(probe: Probe, *, lo: int = 1, hi: int = 1 << 16, multiple_of: int = 1, start: int = 64,
           step: int = 16, known: list[Trial] = ()) -> SearchResult:
    """Seed 000's search by hand: start at 64, add 16 until out of memory (halving the start
    while it does not fit), then step by ``multiple_of`` up from the last size that fit."""
    book = _Book(probe, lo, hi, multiple_of, known)
    size = book.grid(start)
    while size > book.fit:  # the start is not known to fit: try it, halving while it does not
        if (book.unknown(size) and book.run(size).fits) or size <= book.lo:
            break
        size = book.grid(size // 2)  # always smaller while above lo: this ends
    while book.fail is None and book.fit < book.hi and book.fit:
        book.run(book.fit + max(step // book.m, 1) * book.m)
    while not book.closed():  # the fine search, one step at a time
        book.run(book.fit + book.m)
    return book.result()


POLICIES = ("guided", "power", "binsearch", "halving", "linear")


def host_fits(point, host_limit_bytes: int | None) -> bool:
    """Whether the pinned host memory ``point`` holds (``host_reserved_bytes``) fits ``host_memory``
    (None: not checked)."""
    return host_limit_bytes is None or point.host_reserved_bytes <= host_limit_bytes


def reserved_fits(point, limit_bytes: int) -> bool:
    """Whether a replayed ``point`` reserves no more than ``limit_bytes`` (the allocator model never ran out)."""
    return point.reserved_oom is None and point.peak_reserved_bytes <= limit_bytes


def curve_search(curve, limit_bytes: int, *, lo: int, hi: int, multiple_of: int, reserved: bool = False,
                 host_limit_bytes: int | None = None) -> SearchResult:
    """The largest multiple of ``multiple_of`` in [lo, hi] whose traced peak is under ``limit_bytes``:
    the curve predicts it, tracing it and the next size up confirms it (:func:`guided`). Shared by
    estimate's ``TracedCurve`` and plan's ``ShardedCurve``: ``curve.point(b)`` traces one size (its
    ``peak_bytes``, ``host_reserved_bytes``), ``curve.points`` holds the sizes traced so far (each
    a known trial), ``curve.curve()`` is the fit through them.

    With ``reserved`` the peak is the reserved one (``max_memory_reserved``). Reserved is never less
    than allocated, so the allocated answer comes first (cheap: by depth), then the reserved one at or
    below it (:func:`reserved_search`), where each probe replays a fresh stream through the allocator
    model. With ``host_limit_bytes`` a size whose offloaded host bytes pass it does not fit either.

    A size that fits as allocated and whose replay needs no more tracing (``curve.replay_is_free(b)``,
    where the curve has it: its fresh stream is kept whole) is replayed as it is probed, and counts as
    a failure when it cannot reserve: nothing above it fits, so the allocated search does not trace
    the next size up only to confirm a bound the reserved search never uses (seed 003's GRPO step:
    batch 104, a whole step of 144 generated tokens)."""
    replay_is_free = getattr(curve, "replay_is_free", None) if reserved else None  # plan's curves: none

    def allocated_probe(batch_size: int, *, replay: bool = True) -> Trial:
        point = curve.point(batch_size)
        fits = point.peak_bytes <= limit_bytes and host_fits(point, host_limit_bytes)
        if fits and replay_is_free is not None and (point.reserved_ratio is not None
                                                    or (replay and replay_is_free(batch_size))):
            point = curve.reserved(batch_size)
            fits = reserved_fits(point, limit_bytes)
        return Trial(batch_size, "ok" if fits else "oom", peak_allocated_bytes=point.peak_bytes)

    known = [allocated_probe(b, replay=False) for b in curve.points]  # replayed where it already was

    def predict(trials: list[Trial]) -> int:
        guess = reserved_guess(curve, trials, limit_bytes, multiple_of) if replay_is_free is not None else None
        return curve.curve().max_batch_size(limit_bytes, multiple_of) if guess is None else guess

    found = guided(allocated_probe, predict, lo=lo, hi=hi, multiple_of=multiple_of, known=known)
    if not reserved or not found.max_batch_size:
        return found
    return reserved_search(curve, found, limit_bytes, lo=lo, multiple_of=multiple_of)


def reserved_guess(curve, trials: list[Trial], limit_bytes: int, multiple_of: int) -> int | None:
    """The largest batch whose reserved peak the replays among ``trials`` put under ``limit_bytes``;
    None when no size was replayed. Between the largest size that fits and the smallest that does
    not, reserved bytes grow about linearly (segments are sized by the requests): the limit is
    interpolated there. Otherwise the reserved/allocated ratio of the replayed size nearest the
    answer (the smallest that failed, else the largest that fit; replayed among ``trials``, else by
    another search over the same curve: the capacity's, before the target's) solves the allocated
    curve for limit / ratio. The ratio changes with the size (tinystories pp2+fsdp: 1.146 at 2290,
    1.1625 at 2060): the largest size's, once a nearer one had failed, put the answer at 2060 again
    and again, each time clamped one micro-batch lower (2058, 2056)."""

    replays = _replays(curve)

    def demand(batch_size: int) -> float | None:
        """What the step at ``batch_size`` reserves, or would have to (its reserved peak; when
        the allocator model ran out, what it held and asked for, scaled to the step's peak)."""
        point = replays.get(batch_size)
        if point is None or point.reserved_ratio is None:
            return None
        return point.peak_reserved_bytes if point.reserved_oom is None else point.reserved_ratio * point.peak_bytes

    known = sorted((t.batch_size, t.fits, demand(t.batch_size)) for t in trials)
    known = [(b, fits, need) for b, fits, need in known if need is not None]
    fits = [(b, need) for b, ok, need in known if ok]
    fails = [(b, need) for b, ok, need in known if not ok and (not fits or b > max(fits)[0])]
    if fits and fails:
        (b_fit, r_fit), (b_fail, r_fail) = max(fits), min(fails)
        if r_fail > r_fit:
            return int(b_fit + (limit_bytes - r_fit) * (b_fail - b_fit) / (r_fail - r_fit))
    replayed = [(b, ok) for b, ok, _ in known] or [
        (b, reserved_fits(replays[b], limit_bytes)) for b in replays if demand(b) is not None]
    if not replayed:
        return None
    nearest = min((b for b, ok in replayed if not ok), default=max(b for b, _ in replayed))
    # reserved over the curve's own peak there: the curve is what limit / ratio is solved on
    return curve.curve().max_batch_size(limit_bytes * replays[nearest].peak_bytes / demand(nearest),
                                        multiple_of)


def _replays(curve) -> dict:
    """The sizes a search can read a replay of: the traced points, and (plan's curve) the sizes replayed
    alone from a stream written by a line (``plan.curve.ReplayedSize``; a traced point wins)."""
    return {**getattr(curve, "replayed_only", {}), **curve.points}


def reserved_search(curve, found: SearchResult, limit_bytes: int, *, lo: int, multiple_of: int) -> SearchResult:
    """The largest multiple of ``multiple_of`` in [lo, ``found``] whose *reserved* peak is under
    ``limit_bytes``, where ``found`` is the allocated answer under the same limit (reserved is
    never less than allocated, so nothing above it fits). Shared by estimate's ``TracedCurve``
    and plan's ``ShardedCurve``: ``curve.points`` by size (``peak_bytes``, ``peak_reserved_bytes``,
    ``reserved_oom``, ``reserved_ratio``), ``curve.reserved(b)`` replays one size through the
    allocator model (the costly probe), ``curve.curve()`` is the allocated fit."""

    def reserved_trial(batch_size: int, point) -> Trial:
        return Trial(batch_size, "ok" if reserved_fits(point, limit_bytes) else "oom",
                     peak_allocated_bytes=point.peak_bytes, peak_reserved_bytes=point.peak_reserved_bytes)

    probe = getattr(curve, "reserved_probe", curve.reserved)  # plan's: a size replayed alone, from a written stream

    def reserved_probe(batch_size: int) -> Trial:
        return reserved_trial(batch_size, probe(batch_size))

    def predict(trials: list[Trial]) -> int:
        guess = reserved_guess(curve, trials, limit_bytes, multiple_of)
        return found.max_batch_size if guess is None else guess

    above = [Trial(found.next_size, "oom")] if found.next_size else []  # fails allocated: fails reserved
    replayed = [reserved_trial(b, p) for b, p in _replays(curve).items()  # from the search of another limit
                if p.reserved_ratio is not None and lo <= b <= found.max_batch_size]
    result = guided(reserved_probe, predict, lo=lo, hi=found.max_batch_size, multiple_of=multiple_of,
                    known=above + replayed)
    result.capped = found.capped and result.max_batch_size == found.max_batch_size  # capped by hi, not by us
    if result.max_batch_size == found.max_batch_size and result.next_size is None:
        result.next_size = found.next_size  # above hi, so the book dropped it; it failed all the same
    return result


def micro_candidates(global_batch: int, max_local: int, multiple_of: int, dp: int = 1) -> list[int]:
    """Local batches that could be the micro-batch of ``global_batch``, largest first: multiples
    of ``multiple_of`` up to ``max_local`` whose product with ``dp`` divides the global batch
    (accumulation fills the rest)."""
    sizes = range(max_local // multiple_of * multiple_of, 0, -multiple_of)
    return [m for m in sizes if global_batch % (m * dp) == 0]


def largest_micro_batch(global_batch: int, max_local: int, multiple_of: int = 1, dp: int = 1) -> int | None:
    """The largest micro-batch of ``global_batch`` (the first of :func:`micro_candidates`): the
    fewest, fullest accumulation steps; None when no multiple of ``multiple_of`` up to
    ``max_local`` divides it. The one rule of every caller that splits a global batch (probe's
    tier, ElasticStep's split, the sweep's and recommend's runs)."""
    return next(iter(micro_candidates(global_batch, min(max_local, global_batch // dp), multiple_of, dp)), None)


def choose_micro(candidates: list[int], predicted_bytes: Callable[[int], float], target_bytes: int,
                 fits: Callable[[int], bool]) -> int:
    """plan's and estimate's rule for the micro-batch of a global batch: the largest candidate
    (largest first, from ``micro_candidates``) whose traced peak is under the target, tried
    from the largest the fitted curve puts under it (reserved is never below allocated), down;
    the smallest candidate (the caller says it is above the target) when none is under it.
    ``fits`` traces one size."""
    first = next((i for i, m in enumerate(candidates) if predicted_bytes(m) <= target_bytes), len(candidates) - 1)
    return next((m for m in candidates[first:] if fits(m)), candidates[-1])
