"""``batchfit probe``: find the largest batch that really fits, in few probes, safely.

1. (guided) Trace the step on fake tensors at two batch sizes and predict the maximum.
2. Run a policy (a pure function of a probe callable): every probe builds the workload
   fresh, runs real steps (or virtual ones), and is cleaned up before the next.
3. A probe that fails with anything but out-of-memory stops the search: the trials so far
   are kept and reported with that error, never called out of memory.
4. Recommend the maximum that ran; the tiers under ``--target-util`` and 75% come from the
   measured line (the probes already made, else the traced slope through the one measured
   peak) and say so ("predicted"); one extra probe checks the production tier, and
   ``verify_tiers`` probes every tier.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from batchfit import search
from batchfit.devices import format_bytes
from batchfit.distributed import wrap as parallel
from batchfit.errors import OptionError
from batchfit.probe import ranks
from batchfit.probe.request import ProbeRequest
from batchfit.probe.runner import probe_isolated, probe_once
from batchfit.search import SearchResult, Trial
from batchfit.targets import Target
from batchfit.trace.curve import Line, secant
from batchfit.trace.point import TracedCurve
from batchfit.workload import StepOptions, Workload

CONSERVATIVE_UTIL = 0.75


class SearchStopped(Exception):
    """A probe failed with something other than out-of-memory."""

    def __init__(self, trial: Trial) -> None:
        super().__init__(trial.error)
        self.trial = trial


@dataclass
class Recommendation:
    name: str
    batch_size: int
    peak_allocated_bytes: int | None
    why: str
    accumulation_steps: int = 1
    source: str = "probed"
    """'probed' (this batch size ran) or 'predicted' (from the measured line; not run)."""


@dataclass(kw_only=True)
class ProbeResult:
    workload: str
    description: str
    tokens_per_sample: int | None
    target: Target
    options: StepOptions
    policy: str
    multiple_of: int
    smallest: int
    largest: int
    search: SearchResult | None
    trials: list[Trial]
    """Every probe in order: the search's, then the ones that confirm a recommendation."""
    recommendations: list[Recommendation]
    target_util: float
    global_batch: int | None
    seconds: float
    world_size: int = 1
    limit: str = "reserved"
    """What ran out on a virtual device: 'reserved' (allocator model) or 'allocated'; a real GPU
    runs out of what it runs out of."""
    strategy: str | None = None
    """How each rank's step was wrapped ('ddp', 'fsdp'); None: the single-GPU step on every rank."""
    stopped_by: Trial | None = None
    """The trial whose error stopped the search (then max_batch_size is what was found before)."""
    created: str = field(
        default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    torch_version: str = torch.__version__
    traced_bytes_per_sample: float | None = None
    """The traced slope the tiers use when only one probe fit (None without a trace)."""

    @property
    def max_batch_size(self) -> int:
        fits = [t.batch_size for t in self.trials if t.fits]
        return self.search.max_batch_size if self.search else max(fits, default=0)

    @property
    def capacity_bytes(self) -> int | None:
        return self.target.device.usable_bytes if self.target.device else None

    def trial(self, batch_size: int) -> Trial | None:
        return next((t for t in self.trials if t.batch_size == batch_size), None)

    def measured_line(self) -> Line | None:
        """The one memory-per-sample line of this result, the one the tiers were predicted
        from: through the peaks (``peak_of``: the figure the limit names) of the two largest
        batches that fit, else the traced slope through the one that fit."""
        return measured_line(self.trials, self.traced_bytes_per_sample)

    def to_json(self) -> dict:
        best = self.trial(self.max_batch_size)
        line = self.measured_line()
        return {
            "source": ("traced (virtual device)" if self.target.kind == "virtual" else "cpu time, traced memory"
                       if self.target.kind == "cpu" and self.target.device else f"measured ({self.target.kind})"),
            "workload": self.workload, "description": self.description,
            "tokens_per_sample": self.tokens_per_sample,
            "device": {"spec": self.target.spec, **(self.target.device.to_json() if self.target.device else {})},
            "options": self.options.to_json(), "policy": self.policy, "multiple_of": self.multiple_of,
            "min": self.smallest, "max": self.largest,
            "max_batch_size": self.max_batch_size,
            "exact": self.search.exact if self.search else False,
            "next_size": self.search.next_size if self.search else None,
            "capped": self.search.capped if self.search else False,
            "search_probes": len(self.search.trials) if self.search else len(self.trials),
            "peak_allocated_bytes_at_max": best.peak_allocated_bytes if best else None,
            "peak_reserved_bytes_at_max": best.peak_reserved_bytes if best else None,
            "capacity_bytes": self.capacity_bytes,
            "memory_per_sample_bytes": round(line.bytes_per_sample) if line else None,
            "fixed_bytes": round(line.fixed_bytes) if line else None,
            "trials": [t.to_json() for t in self.trials],
            "recommendations": [vars(r) for r in self.recommendations],
            "target_util": self.target_util, "global_batch": self.global_batch,
            "stopped_by": self.stopped_by.to_json() if self.stopped_by else None,
            "limit": self.limit if self.target.kind == "virtual" else None,
            "seconds": round(self.seconds, 2), "world_size": self.world_size, "strategy": self.strategy,
            "created": self.created, "torch_version": self.torch_version,
        }


class _Predictor:
    """The tracer's answer, then corrected by the peaks measured so far (for ``guided``)."""

    def __init__(self, workload: Workload, options: StepOptions, target: Target, capacity: int,
                 multiple_of: int, largest: int, reserved: bool, say: Callable[[str], None]) -> None:
        say("tracing the step on fake tensors to predict")
        with TracedCurve(workload, options, target.device, say, keep_streams=reserved) as traced:
            for b in (multiple_of, 2 * multiple_of):
                traced.point(b)
            self.traced_max = traced.max_batch(target.device.usable_bytes, lo=multiple_of, hi=largest,
                                               multiple_of=multiple_of, reserved=reserved).max_batch_size
            self.points, self.curve = dict(traced.points), traced.curve()
        self.capacity = capacity

    @property
    def slope(self) -> float:
        """The traced bytes per sample of the steepest phase."""
        return max(line.bytes_per_sample for line in self.curve.lines)

    def predicted_bytes(self, batch_size: int) -> int:
        point = self.points.get(batch_size)
        return point.peak_bytes if point else int(self.curve.peak_bytes(batch_size))

    def __call__(self, trials: list[Trial]) -> int:
        # While the device agrees with the trace (sizes up to the traced maximum fit, larger
        # ones do not), keep to the traced maximum: guided then probes it and the next size up.
        agrees = all(t.fits == (t.batch_size <= self.traced_max) for t in trials)
        if agrees:
            return ranks.agree_min(self.traced_max)
        line = measured_line(trials, self.slope)
        if line is not None and line.bytes_per_sample:
            guess = (self.capacity - line.fixed_bytes) / line.bytes_per_sample
        elif trials:  # only failures so far: step 5% below the smallest, to measure a peak
            guess = 0.95 * min(t.batch_size for t in trials)
        else:
            guess = self.traced_max
        return ranks.agree_min(int(guess))


def peak_of(trial: Trial) -> int | None:
    """The peak that decides whether a batch fits: reserved where it is known (a GPU runs out
    when it cannot reserve a segment), else allocated."""
    return trial.peak_reserved_bytes or trial.peak_allocated_bytes


def measured_line(trials: list[Trial], traced_slope: float | None = None) -> Line | None:
    """Peak bytes against batch size from the probes that fit: the secant through the two
    largest, else the traced slope through the one measured peak, else None."""
    measured = sorted((t.batch_size, peak_of(t)) for t in trials if t.fits and peak_of(t))
    if len({b for b, _ in measured}) >= 2:
        return secant("measured", measured)
    if measured and traced_slope:
        b, peak = measured[-1]
        return Line("measured + traced slope", peak - traced_slope * b, traced_slope)
    return None


def find_max_batch(workload: Workload, request: ProbeRequest | None = None, *, target: Target,
                   options: StepOptions | None = None, progress: Callable[[str], None] | None = None,
                   **fields) -> ProbeResult:
    """Probe ``workload`` on ``target`` and return the largest batch that ran.

    ``request`` (``probe/request.py``) says what is asked: the policy, the bounds, the steps per
    probe...; or give its fields as keywords (``find_max_batch(workload, target=t, largest=64)``).
    ``verify_tiers`` probes every recommended tier; by default they are predicted from the
    measured line and at most one extra probe checks the production tier. ``strategy``
    ('ddp', 'fsdp'; under torchrun on a real device the default is 'ddp') wraps each rank's
    model as a multi-GPU run would (``batchfit.distributed.wrap``). ``largest`` caps the search
    (default 65536); a bare ``cpu`` target has no memory to run out of, so it needs the cap
    given, or a GPU to size for (``resolve_target(device='cpu', gpu=...)``).
    """
    if request is None:
        request = ProbeRequest(**fields)
    elif fields:
        raise TypeError(f"find_max_batch: give a ProbeRequest or its fields as keywords, not both "
                        f"({', '.join(fields)})")
    if target.kind == "cpu" and target.device is None and request.largest is None:
        raise OptionError(search.no_memory_limit("find_max_batch on a bare cpu target", "largest=N",
                                          "Target('cpu', get_device('t4-16gb'), 'cpu')"))
    options = (options or StepOptions()).with_attention_of(workload)  # named in every output
    request.check()
    policy, smallest, largest, steps, limit = (request.policy, request.smallest, request.cap, request.steps,
                                               request.limit)
    multiple_of = workload.batch_multiple(request.multiple_of)
    if request.isolate and request.spec is None:
        raise OptionError("`isolate` rebuilds the workload in a fresh process from its MODEL spec: pass spec=")
    say = progress or (lambda message: None)
    target = ranks.local_target(target)
    strategy = parallel.choose_strategy(request.strategy, virtual=target.kind == "virtual",
                                        world_size=ranks.world_size(), isolate=request.isolate)
    ranks.init_ranks(cuda=target.kind == "cuda")
    wrap = parallel.step_wrapper(strategy, target.torch_device, options.precision)
    started = time.perf_counter()
    # Every decision uses the smallest usable memory of all ranks, so all ranks decide alike.
    capacity = ranks.agree_min(target.device.usable_bytes) if target.device else None
    # A bare CPU run has no GPU memory to predict (its probes measure no peaks); sized for a GPU
    # (--device cpu --gpu X), its memory is traced for that GPU as on the virtual device.
    predictor = (_Predictor(workload, options, target, capacity, multiple_of, largest, limit == "reserved", say)
                 if target.device is not None and (policy == "guided" or target.kind == "cuda") else None)
    trials: list[Trial] = []

    def probe(batch_size: int) -> Trial:
        say(f"probe {len(trials) + 1}: batch size {batch_size}")
        if request.isolate:
            trial = probe_isolated(request.spec, request.seq_len, options, target, batch_size, steps=steps,
                                   stop_on_nan=request.stop_on_nan, limit=limit)
        else:
            trial = probe_once(workload, options, target, batch_size, steps=steps, stop_on_nan=request.stop_on_nan,
                               limit=limit, wrap=wrap)
        trial = ranks.agree(trial)
        if predictor is not None:
            trial = Trial(**{**trial.to_json(), "predicted_bytes": predictor.predicted_bytes(batch_size)})
        trials.append(trial)
        if trial.status == "error":
            raise SearchStopped(trial)
        return trial

    bounds = {"lo": smallest, "hi": largest, "multiple_of": multiple_of}
    result, stopped = None, None
    try:
        if policy == "guided" and predictor is not None:
            result = search.guided(probe, predictor, **bounds)
        elif policy == "guided":  # nothing to predict for (cpu): grow gently, as binsearch does
            result = search.binsearch(probe, **bounds)
        else:
            result = getattr(search, policy)(probe, **bounds)
    except SearchStopped as stop:
        stopped = stop.trial
    recommendations: list[Recommendation] = []
    if result is not None:  # the search finished: recommend from it, even if a tier probe then fails
        recommendations, stopped = _recommend(result, probe, trials, capacity, request.target_util,
                                              request.global_batch, bounds, predictor.slope if predictor else None,
                                              request.verify_tiers)
    return ProbeResult(
        workload=workload.name, description=workload.description, tokens_per_sample=workload.tokens_per_sample,
        target=target, options=options, policy=policy, multiple_of=multiple_of, smallest=smallest,
        largest=largest, search=result, trials=trials, recommendations=recommendations,
        target_util=request.target_util, global_batch=request.global_batch, seconds=time.perf_counter() - started,
        world_size=ranks.world_size(), strategy=strategy, stopped_by=stopped, limit=limit,
        traced_bytes_per_sample=predictor.slope if predictor else None,
    )


def _recommend(result: SearchResult, probe: Callable[[int], Trial], trials: list[Trial], capacity: int | None,
               target_util: float, global_batch: int | None, bounds: dict, traced_slope: float | None = None,
               verify_tiers: bool = False) -> tuple[list[Recommendation], Trial | None]:
    """The maximum, the tiers under ``target_util`` and 75%, and the global batch's
    accumulation; and the trial whose error stopped a tier probe (None). A tier probe that
    fails with an error stops further probing, never what was measured: the tiers are then
    what the probes so far say (predicted where none was probed)."""
    best = result.max_batch_size
    if not best:
        return [], None
    stopped: Trial | None = None
    best_trial = next((t for t in trials if t.batch_size == best), None)
    peak = best_trial.peak_allocated_bytes if best_trial else None
    out = [Recommendation("maximum", best, peak, "the largest batch that ran")]
    m = bounds["multiple_of"]
    if capacity and peak:
        extra_probes = 0
        for name, util in (("production", target_util), ("conservative", CONSERVATIVE_UTIL)):
            limit = int(util * capacity)
            why = f"the largest batch under {util:.0%} of usable memory"
            if verify_tiers and stopped is None:  # search under the limit until the next size up exceeds it
                try:
                    found = search.guided(lambda b, limit=limit: _under(probe(b), limit),
                                          lambda seen, limit=limit: _predict_under(limit, trials, traced_slope,
                                                                                   best, m),
                                          known=[_under(t, limit) for t in trials if t.status != "error"],
                                          **{**bounds, "hi": best})
                except SearchStopped as stop:
                    stopped = stop.trial
                else:
                    ran = next((t for t in trials if t.batch_size == found.max_batch_size), None)
                    if ran:
                        out.append(Recommendation(name, ran.batch_size, ran.peak_allocated_bytes, why + " (probed)"))
                    continue
            tier = _tier(name, why, limit, trials, traced_slope, bounds["lo"], best, m)
            if tier and tier.source == "predicted" and extra_probes == 0 and stopped is None:
                # One extra probe in all: the production tier, the one to train with.
                extra_probes += 1
                try:
                    probe(tier.batch_size)
                except SearchStopped as stop:  # keep the prediction; say what stopped the probe
                    stopped = stop.trial
                tier = _tier(name, why, limit, trials, traced_slope, bounds["lo"], best, m)
            if tier:
                out.append(tier)
    if global_batch:
        micro_cap = next((r.batch_size for r in out if r.name == "production"), best)
        micro = search.largest_micro_batch(global_batch, micro_cap, m)
        if micro:
            out.append(Recommendation("global batch", micro, None,
                                      f"{global_batch} samples per optimizer step as {global_batch // micro} "
                                      f"micro-batches of {micro} (no larger than {micro_cap})",
                                      accumulation_steps=global_batch // micro))
        else:
            out.append(Recommendation("global batch", 0, None, f"no multiple of {m} up to {micro_cap} divides "
                                      f"{global_batch}: choose a global batch that is a multiple of {m}"))
    return out, stopped


def _under(trial: Trial, limit: int) -> Trial:
    """A trial as 'fits under ``limit``' rather than 'fits the device'."""
    fits = trial.fits and (peak_of(trial) or 0) <= limit
    return Trial(trial.batch_size, "ok" if fits else "oom", peak_allocated_bytes=trial.peak_allocated_bytes,
                 peak_reserved_bytes=trial.peak_reserved_bytes)


def _predict_under(limit: int, trials: list[Trial], traced_slope: float | None, best: int, m: int) -> int:
    """The measured line's largest multiple of ``m`` under ``limit``, below any size known to
    exceed it and no larger than the maximum (0 when the line cannot say)."""
    line = measured_line(trials, traced_slope)
    if line is None or not line.bytes_per_sample:
        return 0
    predicted = min(int((limit - line.fixed_bytes) / line.bytes_per_sample) // m * m, best)
    # Sizes shown to exceed the limit; a probe that failed with an error showed nothing about memory.
    failed_above = min((t.batch_size for t in trials if t.status != "error" and not _under(t, limit).fits),
                       default=None)
    return predicted if failed_above is None else min(predicted, failed_above - m)


def _tier(name: str, why: str, limit: int, trials: list[Trial], traced_slope: float | None, lo: int,
          best: int, m: int) -> Recommendation | None:
    """The largest batch under ``limit``: a probed one when the measured line says no
    larger size fits, else the line's prediction (labelled predicted)."""
    probed = max((t for t in trials if _under(t, limit).fits), key=lambda t: t.batch_size, default=None)
    predicted = _predict_under(limit, trials, traced_slope, best, m)
    if probed and predicted <= probed.batch_size:
        return Recommendation(name, probed.batch_size, probed.peak_allocated_bytes, why + " (probed)")
    if predicted < lo:
        return None
    line = measured_line(trials, traced_slope)
    return Recommendation(name, predicted, int(line.at(predicted)),
                          why + f", predicted from the measured line ({format_bytes(line.bytes_per_sample)} "
                          "per sample); not probed", source="predicted")
