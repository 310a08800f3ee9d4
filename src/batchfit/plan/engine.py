"""``batchfit plan``: per-GPU memory, batch sizes, time and a launch config for many GPUs.

For each GPU count and each strategy (DDP, FSDP2, HSDP, TP, FSDP+TP):

1. Trace rank 0's training step on a fake process group at a few local batch sizes
   (``plan/sharded.py``: PyTorch's own sharding, fake tensors, no GPU).
2. Fit the memory curve and find the largest local batch that fits, confirmed by tracing it
   and the next size up: the same fit (``trace/curve.py``) and search (``search.guided``) as
   ``estimate``, so every answer is a traced one.
3. Pick the micro-batch: the largest local batch under the target utilisation whose product
   with the data-parallel degree divides ``--global-batch`` (accumulation fills the rest),
   traced.
4. Compute the step time at that micro-batch from the FLOPs and collectives the trace
   counted (``time_model.py``), tokens/s and days for ``--tokens``.
5. Recommend, per GPU count, the strategy with the most tokens/s.

Each strategy is one tracing session (``plan/deep.py``: built once, at depths 2, 3 and 4
for a deep model), traced at one local batch after another. The tracer is a parameter
(``trace=``, one point at a time), so the engine is tested with stand-ins whose numbers are
known, and the real tracer is imported only when a plan runs.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType

from batchfit.devices import Device, GiB
from batchfit.errors import OptionError
from batchfit.plan import workers
from batchfit.plan.time_model import OVERLAP_RULE, StepTime, TimeModel, step_time
from batchfit.plan.world import CHINCHILLA_TOKENS_PER_PARAM, World, parse_tokens
from batchfit.search import (DEFAULT_MAX_BATCH, SearchResult, Trial, _check_limit, check_search_options,
                              choose_micro, guided, micro_candidates, reserved_search, trace_first_sizes)
from batchfit.trace.approximation import Approximation
from batchfit.trace.curve import MemoryCurve, secant
from batchfit.workload import StepOptions, Workload

DEFAULT_STRATEGIES = "ddp,fsdp"
SECONDS_PER_DAY = 86400
SOURCE = ("memory traced on a fake process group (rank 0, PyTorch's own sharding, fake tensors); "
          "time computed: FLOPs / (peak x MFU) + collective bytes / link bandwidth")


def sharded() -> ModuleType:
    """The sharded tracer, imported when a plan runs (it pulls in torch.distributed).

    Through ``importlib`` so that a stand-in put in ``sys.modules`` is the one used."""
    return importlib.import_module("batchfit.plan.sharded")


class PointSession:
    """A session over a tracer of one point at a time: ``trace(workload, options, device,
    strategy, local_batch)`` (a stand-in, or a caller's own), and ``replay`` of the same
    arguments for the reserved peak (a ``plan.reserved.ReservedReplay``), when given."""

    def __init__(self, trace: Callable, workload: Workload, options: StepOptions, device: Device, strategy, *,
                 replay: Callable | None = None) -> None:
        self.trace = lambda local_batch: trace(workload, options, device, strategy, local_batch)
        if replay is not None:
            self.reserved = lambda local_batch: replay(workload, options, device, strategy, local_batch)

    def close(self) -> None:
        pass


@dataclass
class PlanPoint:
    """One traced local batch of one strategy: rank 0's peak and what it holds."""

    local_batch: int
    peak_bytes: int
    """As max_memory_allocated() would show it on rank 0: traced, plus the cuBLAS workspace."""
    breakdown: dict[str, int]
    flops: int
    collectives: tuple
    host_reserved_bytes: int = 0
    """Pinned host memory rank 0 holds for --offload (the host allocator's cache)."""
    offloaded_bytes: int = 0
    """Bytes rank 0's activation offload copies to the host in one micro-step, and back."""
    host_peak_bytes: int = 0
    """The most host bytes rank 0's step holds at once for --offload (pinned, rounded)."""
    stage_peak_bytes: tuple[int, ...] = ()
    """Under pp<N>: each pipeline rank's traced peak (allocated, workspace included), rank 0 first;
    ``peak_bytes`` is the largest."""

    reserved: object | None = None
    """Rank 0's fresh process replayed through the caching allocator model (a
    ``plan.reserved.ReservedReplay``: peak reserved bytes, and in which step); None until asked."""

    @property
    def peak_reserved_bytes(self) -> int | None:
        return self.reserved.peak_reserved_bytes if self.reserved else None

    @property
    def reserved_oom(self) -> str | None:
        return self.reserved.reserved_oom if self.reserved else None

    @property
    def reserved_ratio(self) -> float | None:
        return self.reserved.reserved_ratio if self.reserved else None

    def fits(self, limit_bytes: int, limit: str) -> bool:
        """Under ``limit_bytes`` by ``limit`` ('reserved' needs the point replayed)."""
        if limit == "allocated":
            return self.peak_bytes <= limit_bytes
        return self.reserved_oom is None and self.peak_reserved_bytes <= limit_bytes

    def to_json(self) -> dict:
        return {"local_batch": self.local_batch, "peak_bytes": self.peak_bytes,
                "peak_reserved_bytes": self.peak_reserved_bytes, "reserved_oom": self.reserved_oom,
                "peak_step": self.reserved.peak_step_name if self.reserved else None,
                "reserved_by_step": self.reserved.to_json()["by_step"] if self.reserved else None,
                "breakdown": self.breakdown, "flops": self.flops, "host_peak_bytes": self.host_peak_bytes,
                "host_reserved_bytes": self.host_reserved_bytes, "offloaded_bytes": self.offloaded_bytes,
                **({"stage_peak_bytes": list(self.stage_peak_bytes)} if self.stage_peak_bytes else {})}


def plan_point(traced, workspace_bytes: int) -> PlanPoint:
    """A ShardedPoint as a GPU would report it: the cuBLAS workspace (allocated through the
    caching allocator before the step) added, unless the tracer counted it already."""
    breakdown = dict(traced.breakdown)
    peak = traced.peak_bytes
    if "workspace" not in breakdown:
        breakdown["workspace"] = workspace_bytes
        peak += workspace_bytes
    return PlanPoint(traced.local_batch, peak, breakdown, traced.flops, tuple(traced.collectives),
                     getattr(traced, "host_reserved_bytes", 0), getattr(traced, "offloaded_bytes", 0),
                     getattr(traced, "host_peak_bytes", 0), stage_peak_bytes=tuple(getattr(traced, "stage_peak_bytes", ())))


class ShardedCurve:
    """One strategy's step traced at local batch sizes on demand (each size once), with
    ``estimate``'s fit and confirmation on top."""

    def __init__(self, trace_point: Callable[[int], object], workspace_bytes: int,
                 say: Callable[[str], None], replay: Callable[[int], object] | None = None,
                 replay_first: bool = False) -> None:
        self._trace, self._workspace, self._say, self._replay = trace_point, workspace_bytes, say, replay
        self._replay_first = replay_first
        """Replay a size not traced yet before tracing it: the replay's fresh trace gives its
        point too (``DeepSession.replay_gives_point``), one trace of the size instead of two."""
        self.points: dict[int, PlanPoint] = {}
        self.first = None
        """The first ShardedPoint traced (its parameter counts)."""

    def point(self, local_batch: int) -> PlanPoint:
        if local_batch not in self.points:
            self._say(f"local batch {local_batch}")
            traced = self._trace(local_batch)
            self.first = self.first or traced
            self.points[local_batch] = plan_point(traced, self._workspace)
        return self.points[local_batch]

    def reserved(self, local_batch: int) -> PlanPoint:
        """The point with its reserved peak: rank 0's fresh process replayed through the
        allocator model (``plan/reserved.py``), once per size. A size not traced yet is
        replayed first where the replay's fresh trace gives its point too (``replay_first``)."""
        if self._replay is None:
            self.point(local_batch)
            raise OptionError("this tracer cannot replay reserved memory: use --limit allocated")
        replayed = None
        if self._replay_first and local_batch not in self.points:
            self._say(f"local batch {local_batch}: reserved memory (allocator model)")
            replayed = self._replay(local_batch)
        point = self.point(local_batch)
        if point.reserved is None:
            if replayed is None:
                self._say(f"local batch {local_batch}: reserved memory (allocator model)")
                replayed = self._replay(local_batch)
            point.reserved = replayed
        return point

    def curve(self) -> MemoryCurve:
        """The line through the two largest traced sizes (``trace.curve.secant``): the rank's
        step peak, fixed (its shards of parameters, gradients, optimizer state) plus per sample."""
        return MemoryCurve((secant("step", [(b, p.peak_bytes) for b, p in self.points.items()]),))

    def max_batch(self, limit_bytes: int, *, lo: int, hi: int, multiple_of: int,
                  reserved: bool = False, host_limit_bytes: int | None = None) -> SearchResult:
        """The largest multiple of ``multiple_of`` in [lo, hi] whose traced peak is under
        ``limit_bytes`` (and whose offloaded host bytes are under ``host_limit_bytes``, when
        given): predicted by the curve, confirmed by tracing it and the next size up.
        With ``reserved``, the reserved peak, searched at or below the allocated answer, as
        ``estimate`` does (``search.reserved_search``): only the sizes that decide are replayed."""

        def probe(local_batch: int) -> Trial:
            point = self.point(local_batch)
            fits = point.peak_bytes <= limit_bytes and (host_limit_bytes is None
                                                        or point.host_reserved_bytes <= host_limit_bytes)
            return Trial(local_batch, "ok" if fits else "oom", peak_allocated_bytes=point.peak_bytes)

        known = [probe(b) for b in self.points]
        found = guided(probe, lambda trials: self.curve().max_batch_size(limit_bytes, multiple_of),
                       lo=lo, hi=hi, multiple_of=multiple_of, known=known)
        if not reserved or not found.max_batch_size:
            return found
        return reserved_search(self, found, limit_bytes, lo=lo, multiple_of=multiple_of)


@dataclass
class StrategyPlan:
    """One strategy on one GPU count: the row of seed 004's table, and how it was found."""

    strategy: str
    gpus: int
    nodes: int
    dp: int
    tp: int
    shard: str
    replicas: int
    points: list[PlanPoint]
    curve: MemoryCurve | None
    max_local_batch: int
    capped: bool
    micro_batch: int = 0
    accumulation_steps: int = 0
    global_batch: int = 0
    peak_bytes_at_micro: int | None = None
    limit: str = "reserved"
    """What had to fit: 'reserved' (max_memory_reserved, allocator model) or 'allocated'."""
    peak_reserved_bytes_at_micro: int | None = None
    peak_step: str | None = None
    """Where rank 0's reserved peak at the micro-batch happens ('steady step', 'first step', ...)."""
    whole_reserved: list[int] = field(default_factory=list)
    """Local batches whose reserved stream needed the whole model traced (not written from depths)."""
    above_target: bool = False
    """No micro-batch that reaches the global batch stays under the target: the smallest is used."""
    time: StepTime | None = None
    """At the micro-batch, with its accumulation steps."""
    time_at_max: StepTime | None = None
    """At the max local batch, no accumulation: seed 004's iter_dt column."""
    tokens_per_s: float | None = None
    samples_per_s: float | None = None
    tokens_per_s_at_max: float | None = None
    days: float | None = None
    params_per_rank: int | None = None
    fix: list[str] = field(default_factory=list)
    """When not even local batch 1 fits: what would (computed from its breakdown)."""
    skipped: str | None = None
    """Why this strategy was not traced (``auto`` on a model with no tensor-parallel plan)."""
    tp_loss: str | None = None
    """Under TP, the loss the plan traced: sharded (loss_parallel), gathered or replicated; None without TP."""
    ep: int = 1
    """Expert-parallel degree (ep<N>; within dp, so max_global_batch is unchanged by it)."""
    pp: int = 1
    """Pipeline stages (pp<N>); 1 without."""

    @property
    def max_global_batch(self) -> int:
        return self.max_local_batch * self.dp

    @property
    def step_time_s(self) -> float | None:
        return self.time.step_time_s if self.time else None

    @property
    def fits(self) -> bool:
        return self.max_local_batch > 0

    def point(self, local_batch: int) -> PlanPoint | None:
        return next((p for p in self.points if p.local_batch == local_batch), None)

    def to_json(self) -> dict:
        return {
            "strategy": self.strategy, "gpus": self.gpus, "nodes": self.nodes, "dp": self.dp, "tp": self.tp,
            "ep": self.ep, "pp": self.pp, "shard": self.shard, "replicas": self.replicas,
            "points": [p.to_json() for p in self.points],
            "fit": ({"model": "peak(local_batch) = fixed_bytes + bytes_per_sample * local_batch",
                     "fixed_bytes": round(self.curve.lines[0].fixed_bytes),
                     "bytes_per_sample": round(self.curve.lines[0].bytes_per_sample)} if self.curve else None),
            "max_local_batch": self.max_local_batch, "max_global_batch": self.max_global_batch,
            "capped": self.capped, "micro_batch": self.micro_batch,
            "accumulation_steps": self.accumulation_steps, "global_batch": self.global_batch,
            "peak_bytes_at_micro": self.peak_bytes_at_micro, "limit": self.limit,
            "peak_reserved_bytes_at_micro": self.peak_reserved_bytes_at_micro, "peak_step": self.peak_step,
            "whole_reserved": self.whole_reserved, "above_target": self.above_target,
            "host_reserved_bytes_at_micro": (self.point(self.micro_batch).host_reserved_bytes
                                             if self.point(self.micro_batch) else None),
            "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s, "samples_per_s": self.samples_per_s,
            "days": self.days, "time": self.time.to_json() if self.time else None,
            "step_time_s_at_max": self.time_at_max.step_time_s if self.time_at_max else None,
            "tokens_per_s_at_max": self.tokens_per_s_at_max,
            "params_per_rank": self.params_per_rank, "fix": self.fix, "skipped": self.skipped,
            "tp_loss": self.tp_loss,
            "source": SOURCE if self.time else SOURCE.split(";")[0] + "; time not computed (no peak FLOP/s known)",
        }


@dataclass(kw_only=True)
class PlanResult:
    workload: str
    description: str
    tokens_per_sample: int | None
    device: Device
    options: StepOptions
    worlds: list[World]
    strategies_asked: str
    plans: list[StrategyPlan]
    params: int
    global_batch: int | None
    tokens: float | None
    tokens_asked: str | None
    target_util: float
    multiple_of: int
    time_model: TimeModel
    links: dict
    trace_seconds: float
    traces: int
    limit: str = "reserved"
    """What had to fit under the usable memory (and the target): 'reserved' or 'allocated'."""
    approximations: list[Approximation] = field(default_factory=list)
    """Where the traced figures approximate the step (a compiled model traced as eager): every
    output says each one."""
    host_limit_bytes: int | None = None
    """--host-memory: what each rank's offloaded pinned host bytes must fit; None: not checked."""
    created: str = field(default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))

    @property
    def capacity_bytes(self) -> int:
        return self.device.usable_bytes

    @property
    def target_bytes(self) -> int:
        return int(self.target_util * self.device.usable_bytes)

    @property
    def recommended(self) -> list[StrategyPlan]:
        """Per GPU count, the fitting strategy with the most tokens/s (samples/s; with no
        time, the largest global batch); ties go to the smaller tensor-parallel degree."""
        out = []
        for world in self.worlds:
            fitting = [p for p in self.plans if p.gpus == world.gpus and p.fits]
            if fitting:
                out.append(max(fitting, key=lambda p: (p.samples_per_s or 0.0, p.global_batch, -p.tp)))
        return out

    @property
    def ranking(self) -> list:
        """Every combination, per GPU count, by predicted tokens/s with its memory; what does not fit
        or was skipped last, with why (``plan/ranking.py``: a list of ``RankedRow``)."""
        from batchfit.plan.ranking import ranking

        return ranking(self.plans, self.worlds, mfu=self.time_model.mfu, target_bytes=self.target_bytes)

    def to_json(self) -> dict:
        return {
            "source": "traced memory, computed time",
            "workload": self.workload, "description": self.description,
            "tokens_per_sample": self.tokens_per_sample, "device": self.device.to_json(),
            "options": self.options.to_json(), "worlds": [w.to_json() for w in self.worlds],
            "strategies_asked": self.strategies_asked, "params": self.params,
            "global_batch": self.global_batch, "tokens": self.tokens, "tokens_asked": self.tokens_asked,
            "target_util": self.target_util, "multiple_of": self.multiple_of, "limit": self.limit,
            "capacity_bytes": self.capacity_bytes, "target_bytes": self.target_bytes,
            "time_model": {**self.time_model.to_json(), **self.links, "overlap_rule": OVERLAP_RULE},
            "strategies": [p.to_json() for p in self.plans],
            "recommended": [{"gpus": p.gpus, "nodes": p.nodes, "strategy": p.strategy, "dp": p.dp, "tp": p.tp,
                             "micro_batch": p.micro_batch, "accumulation_steps": p.accumulation_steps,
                             "global_batch": p.global_batch, "peak_bytes_at_micro": p.peak_bytes_at_micro,
                             "limit": p.limit, "peak_reserved_bytes_at_micro": p.peak_reserved_bytes_at_micro,
                             "peak_step": p.peak_step,
                             "step_time_s": p.step_time_s, "tokens_per_s": p.tokens_per_s, "days": p.days}
                            for p in self.recommended],
            "ranking": [row.to_json() for row in self.ranking],
            **({"auto_left_out": list(_auto_bounds())} if self.strategies_asked.strip().lower() == "auto" else {}),
            "approximations": [a.to_json() for a in self.approximations],
            "host_limit_bytes": self.host_limit_bytes,
            "trace_seconds": round(self.trace_seconds, 2), "traces": self.traces, "created": self.created,
        }


def _auto_bounds() -> tuple[str, ...]:
    """What --strategies auto leaves out only to bound the tracing (``candidates.BOUNDS``)."""
    from batchfit.plan.candidates import BOUNDS

    return BOUNDS


def _validate(target_util: float, multiple_of: int, max_batch: int, batch_sizes: list[int] | None,
              global_batch: int | None, limit: str) -> None:
    check_search_options(target_util=target_util, multiple_of=multiple_of, max_batch=max_batch)
    _check_limit(limit)
    if any(b < 1 for b in batch_sizes or []):
        raise OptionError("--batch-sizes are local batch sizes, 1 or more: e.g. --batch-sizes 1,2,4")
    if global_batch is not None and global_batch < 1:
        raise OptionError(f"--global-batch must be 1 or more, e.g. 512; got {global_batch}")


def _check_global_batch(global_batch: int, strategies: list, multiple_of: int) -> None:
    """Every strategy must reach the global batch with whole micro-batches on every rank."""
    for s in strategies:
        if global_batch % (s.dp * multiple_of):
            step = math.lcm(*(x.dp * multiple_of for x in strategies))
            near = max(step, round(global_batch / step) * step)
            raise OptionError(
                f"--global-batch {global_batch} cannot be split over {s.name}'s {s.dp} data-parallel ranks on "
                f"{s.world_size} GPUs{f' in multiples of {multiple_of}' if multiple_of > 1 else ''}: "
                f"use a multiple of {step}, e.g. --global-batch {near}")


def _choose_micro(plan: StrategyPlan, curve: ShardedCurve, target_bytes: int, global_batch: int | None,
                  multiple_of: int) -> None:
    """The micro-batch: the largest local batch whose traced peak (reserved or allocated, by
    ``plan.limit``) is under the target and, with a global batch, whose product with dp divides
    it; the smallest such size (which fits the capacity) when none is under the target."""
    reserved = plan.limit == "reserved"
    point = curve.reserved if reserved else curve.point
    if global_batch is None:  # any size: estimate's confirmed search, under the target
        found = curve.max_batch(target_bytes, lo=multiple_of, hi=plan.max_local_batch, multiple_of=multiple_of,
                                reserved=reserved)
        chosen = found.max_batch_size or multiple_of
    else:  # few sizes (divisors): from the largest the curve puts under the target (reserved >= allocated), down
        candidates = micro_candidates(global_batch, plan.max_local_batch, multiple_of, plan.dp)
        chosen = choose_micro(candidates, curve.curve().peak_bytes, target_bytes,
                              lambda m: point(m).fits(target_bytes, plan.limit))
    at = point(chosen)
    plan.micro_batch = chosen
    plan.above_target = not at.fits(target_bytes, plan.limit)
    plan.peak_bytes_at_micro = at.peak_bytes
    plan.peak_reserved_bytes_at_micro = at.peak_reserved_bytes
    plan.peak_step = at.reserved.peak_step_name if at.reserved else None
    plan.global_batch = global_batch if global_batch is not None else chosen * plan.dp
    plan.accumulation_steps = plan.global_batch // (chosen * plan.dp)


def _fix(plan: StrategyPlan, point: PlanPoint, capacity_bytes: int, options: StepOptions,
         host_limit_bytes: int | None = None) -> list[str]:
    """What would make local batch 1 fit, computed from its breakdown (labelled computed)."""
    if point.peak_bytes <= capacity_bytes and host_limit_bytes is not None and point.host_reserved_bytes > host_limit_bytes:
        return [f"local batch {point.local_batch} fits the GPU, but its offloaded tensors hold "
                f"{point.host_reserved_bytes / GiB:.2f} GiB of pinned host memory per rank, over --host-memory "
                f"{host_limit_bytes / GiB:.2f} GiB: offload less (--offload none) or give the host's memory"]
    parts = point.breakdown
    state = sum(parts.get(k, 0) for k in ("parameters", "gradients", "optimizer", "optimizer_state"))
    if point.peak_bytes <= capacity_bytes and point.reserved is not None:  # fits allocated, not reserved
        needed = point.peak_reserved_bytes
        out = [f"local batch {point.local_batch} allocates {point.peak_bytes / GiB:.2f} GiB per GPU, under the "
               f"{capacity_bytes / GiB:.2f} GiB usable, but the caching allocator "
               + (f"cannot reserve it ({point.reserved_oom})" if needed is None else
                  f"reserves {needed / GiB:.2f} GiB (allocator model, {point.reserved.peak_step_name})")]
    else:
        out = [f"local batch {point.local_batch} needs {point.peak_bytes / GiB:.2f} GiB per GPU, "
               f"{(point.peak_bytes - capacity_bytes) / GiB:.2f} GiB more than the {capacity_bytes / GiB:.2f} GiB usable"]
    if plan.shard in ("none", "ddp") and plan.gpus > 1 and state:
        saving = state * (1 - 1 / plan.gpus)
        out.append(f"fsdp shards parameters, gradients and optimizer state ({state / GiB:.2f} GiB here) over the "
                   f"{plan.gpus} GPUs: {saving / GiB:.2f} GiB less (computed: their sum x (1 - 1/{plan.gpus})); "
                   "--strategies fsdp")
    elif plan.shard in ("fsdp", "fsdp-noreshard", "hsdp") and state:
        out.append(f"more GPUs shard the {state / GiB:.2f} GiB of parameters, gradients and optimizer state "
                   f"further: twice as many save {state / 2 / GiB:.2f} GiB (computed); --gpus {2 * plan.gpus}")
    if options.checkpointing == "none" and parts.get("activations"):
        out.append(f"--checkpointing full keeps one block's activations, not all of them "
                   f"({parts['activations'] / GiB:.2f} GiB here)")
    if options.precision not in ("bf16",):
        out.append("--precision bf16 halves parameters, gradients and optimizer state")
    out.append(f"a GPU with at least {point.peak_bytes / GiB * 1.05:.0f} GiB (`batchfit gpus`)")
    return out


def plan(workload: Workload, *, device: Device, worlds: list[World], options: StepOptions | None = None,
         strategies: str = DEFAULT_STRATEGIES, global_batch: int | None = None, tokens: str | float | None = None,
         batch_sizes: list[int] | None = None, target_util: float = 0.9, multiple_of: int = 1,
         max_batch: int = DEFAULT_MAX_BATCH, time_model: TimeModel | None = None,
         trace: Callable | None = None, parse: Callable | None = None,
         progress: Callable[[str], None] | None = None, processes: int | None = None,
         limit: str = "reserved", replay: Callable | None = None,
         host_memory_bytes: int | None = None, pp_schedule: str = "1f1b", microbatches: int = 0,
         facts=None) -> PlanResult:
    """Plan ``workload`` on ``device`` for each of ``worlds`` and each of ``strategies``.

    ``trace(workload, options, device, strategy, local_batch) -> ShardedPoint`` and
    ``parse(text, world_size) -> list[Strategy]`` default to ``batchfit.plan.sharded``'s.
    ``tokens`` is a count, ``'chinchilla'`` (20 x parameters) or a string either way.
    ``processes``: strategies traced at once, each in its own process (default: one per CPU
    core, at most one per strategy; ``plan/workers.py``); 1 traces them one after another.
    ``limit``: what must stay under the usable memory and the target, as in ``estimate``:
    ``reserved`` (default: rank 0's fresh process replayed through the caching allocator model,
    ``plan/reserved.py``) or ``allocated``. ``replay(workload, options, device, strategy,
    local_batch) -> ReservedReplay`` goes with a stand-in ``trace``.
    ``host_memory_bytes`` (``--host-memory``): a local batch whose ``--offload``-ed pinned host
    bytes on a rank pass it does not fit; None does not check them.
    ``pp_schedule`` / ``microbatches`` (``--pp-schedule``, ``--microbatches``): for pp<N> strategies
    (``plan/pipeline.py``), whose local batch is a pipeline's samples per step (a multiple of the
    micro-batches).
    ``strategies='auto'``: every combination ``plan/candidates.py`` lists for the model (``facts``, a
    ``candidates.ModelFacts``, default read from the model built on the meta device); each pp<N>
    searches multiples of its own micro-batches; those that cannot apply are rows with ``skipped``.
    """
    options = options or StepOptions()
    time_model = time_model or TimeModel()
    _validate(target_util, multiple_of, max_batch, batch_sizes, global_batch, limit)
    tokens_asked = tokens if isinstance(tokens, str) else None
    tokens = parse_tokens(tokens) if isinstance(tokens, str) else tokens
    if tokens is not None and not workload.tokens_per_sample:
        raise OptionError(f"--tokens needs a sequence model: {workload.name} has no tokens per sample; drop --tokens")
    if options.accumulation_steps != 1:
        raise OptionError("plan chooses the accumulation steps itself (to reach --global-batch): "
                          "drop --accumulation-steps")
    if trace is None or parse is None:
        module = sharded()
        pp_options = {} if (pp_schedule, microbatches) == ("1f1b", 0) else dict(pp_schedule=pp_schedule,
                                                                                  microbatches=microbatches)
        parse = parse or functools.partial(module.parse_strategies, **pp_options)  # a stand-in need not take them
    if trace is not None:
        open_session = functools.partial(PointSession, trace, replay=replay)
    else:
        from batchfit.plan.deep import DeepSession  # the tracer: torch, when a plan runs
        from batchfit.plan.pipeline import pipeline_or

        open_session = pipeline_or(functools.partial(DeepSession, session=module.ShardedSession))
    multiple_of = workload.batch_multiple(multiple_of)
    auto = strategies.strip().lower() == "auto"
    not_traced: list[StrategyPlan] = []
    if auto:  # every combination (plan/candidates.py); the ones that cannot apply listed, not traced
        by_world, not_traced = _auto(workload, options, worlds, parse, facts, pp_schedule, microbatches)
    else:
        by_world = [(world, parse(strategies, world.gpus)) for world in worlds]  # every bad name before any trace
    base_multiple = multiple_of
    for _, chosen in by_world:  # a pipeline's local batch is whole micro-batches
        multiple_of = math.lcm(multiple_of, *(s.microbatches for s in chosen if getattr(s, "pp", 1) > 1))
    if auto:  # each its own: pipelines do not make fsdp's local batch a multiple of their micro-batches
        multiple_of = base_multiple
    if options.offloads("params") and auto:
        for world, chosen in by_world:
            chosen[:] = _set_aside(world, chosen, lambda s: None if s.shard in FSDP_SHARDS else
                                   "--offload params is FSDP2's CPUOffloadPolicy: this has no FSDP", not_traced)
    elif options.offloads("params"):
        by_world = _with_fsdp_only(by_world, auto=False)
    if global_batch is not None:
        for world, chosen in by_world:
            if auto:
                chosen[:] = _set_aside(world, chosen, _not_reaching(global_batch, multiple_of), not_traced)
            _check_global_batch(global_batch, chosen, multiple_of)
    say = progress or (lambda message: None)
    started = time.perf_counter()
    from batchfit.distributed.zero import zero_approximations  # torch: when a plan runs
    from batchfit.trace.approximation import offload_approximations
    from batchfit.trace.compiled import plan_compile_approximations, sharded_eager_reason, sharded_traces_compiled
    from batchfit.trace.cuda_float8 import float8_approximations
    from batchfit.trace.routing import workload_routing_approximation

    every = list({s.name: s for _, chosen in by_world for s in chosen}.values())
    compiled = [s.name for s in every if sharded_traces_compiled(s, options)]
    approximations = plan_compile_approximations(workload, options, compiled, {
        s.name: sharded_eager_reason(s, options) or "" for s in every if s.name not in compiled})
    approximations += float8_approximations(options)
    every = [s for _, chosen in by_world for s in chosen]
    approximations += workload_routing_approximation(
        workload, options, expert_parallel=bool(every) and all(getattr(s, "ep", 1) > 1 for s in every))
    approximations += offload_approximations(options.offload, options.compile)
    approximations += zero_approximations([s for _, chosen in by_world for s in chosen])
    from batchfit.distributed.pipeline import pipeline_approximations

    approximations += pipeline_approximations([s for _, chosen in by_world for s in chosen])
    from batchfit.distributed.context_parallel import context_parallel_approximations

    approximations += context_parallel_approximations([s for _, chosen in by_world for s in chosen])
    from batchfit.distributed.expert_parallel import ep_approximations

    approximations += ep_approximations([s for _, chosen in by_world for s in chosen], options.routing)
    target_bytes = int(target_util * device.usable_bytes)

    def one(job: tuple[World, object], say: Callable[[str], None]) -> tuple[StrategyPlan, int | None]:
        world, strategy = job
        return _plan_one(open_session, workload, options, device, world, strategy, time_model, say, auto=auto,
                         batch_sizes=batch_sizes, global_batch=global_batch,
                         multiple_of=_own_multiple(strategy, multiple_of) if auto else multiple_of,
                         max_batch=max_batch, target_bytes=target_bytes, limit=limit,
                         host_limit_bytes=host_memory_bytes)

    jobs = [(world, strategy) for world, chosen in by_world for strategy in chosen]
    done = workers.run(one, jobs, say, processes=processes if trace is None else 1)
    plans = [plan_row for plan_row, _ in done] + not_traced
    params = next((n for _, n in done if n is not None), None)
    traces = sum(len(p.points) for p in plans)
    if params is None:
        raise OptionError(f"no strategy of '{strategies}' could be traced for {workload.name}: "
                          "every one was skipped (see above); name strategies with --strategies ddp,fsdp")
    if tokens == "chinchilla":
        tokens = float(CHINCHILLA_TOKENS_PER_PARAM * params)
    for p in plans:
        if tokens is not None and p.tokens_per_s:
            p.days = tokens / p.tokens_per_s / SECONDS_PER_DAY
    return PlanResult(
        workload=workload.name, description=workload.description, tokens_per_sample=workload.tokens_per_sample,
        device=device, options=options, worlds=list(worlds), strategies_asked=strategies, plans=plans,
        params=params, global_batch=global_batch, tokens=tokens, tokens_asked=tokens_asked,
        target_util=target_util, multiple_of=multiple_of, time_model=time_model,
        links=time_model.links(device), trace_seconds=time.perf_counter() - started, traces=traces,
        approximations=approximations, limit=limit, host_limit_bytes=host_memory_bytes,
    )


FSDP_SHARDS = ("fsdp", "fsdp-noreshard", "hsdp")


def _auto(workload: Workload, options: StepOptions, worlds: list[World], parse: Callable, facts,
          pp_schedule: str, microbatches: int) -> tuple[list, list[StrategyPlan]]:
    """``--strategies auto``: per world, the strategies of ``candidates.candidates`` to trace, and a
    row (not traced, ``skipped`` saying why) for each combination that cannot apply to this model."""
    from batchfit.plan.candidates import candidates, model_facts

    facts = facts or model_facts(workload, options)
    by_world, not_traced = [], []
    for world in worlds:
        listed = candidates(world, facts, pp_schedule=pp_schedule, microbatches=microbatches)
        names = [c.name for c in listed if c.skipped is None]
        by_world.append((world, parse(",".join(names), world.gpus) if names else []))
        not_traced += [StrategyPlan(strategy=c.name, gpus=c.gpus, nodes=c.nodes, dp=c.dp, tp=c.tp, shard=c.shard,
                                    replicas=c.replicas, pp=c.pp, points=[], curve=None, max_local_batch=0,
                                    capped=False, skipped=c.skipped) for c in listed if c.skipped]
    return by_world, not_traced


def _own_multiple(strategy, multiple_of: int) -> int:
    """A strategy's local batch step under auto: whole pipeline micro-batches for pp<N>."""
    return math.lcm(multiple_of, strategy.microbatches) if getattr(strategy, "pp", 1) > 1 else multiple_of


def _set_aside(world: World, chosen: list, why: Callable[[object], str | None], not_traced: list[StrategyPlan]) -> list:
    """Under auto, the strategies ``why`` has no reason against; each other becomes a skipped row
    with the reason (a strategy the user named is refused with one line instead)."""
    kept = []
    for s in chosen:
        reason = why(s)
        if reason is None:
            kept.append(s)
            continue
        not_traced.append(StrategyPlan(strategy=s.name, gpus=world.gpus, nodes=world.nodes, dp=s.dp, tp=s.tp,
                                       shard=s.shard, replicas=getattr(s, "replicas", 1), pp=getattr(s, "pp", 1),
                                       points=[], curve=None, max_local_batch=0, capped=False, skipped=reason))
    return kept


def _not_reaching(global_batch: int, multiple_of: int) -> Callable[[object], str | None]:
    """Why a strategy cannot reach ``global_batch`` with whole micro-batches on each dp rank (or None)."""
    def why(s) -> str | None:
        step = s.dp * _own_multiple(s, multiple_of)
        return (f"--global-batch {global_batch} is not a multiple of its {s.dp} data-parallel ranks x "
                f"{step // s.dp} samples" if global_batch % step else None)
    return why


def _with_fsdp_only(by_world: list, *, auto: bool) -> list:
    """``--offload params`` is FSDP2's CPUOffloadPolicy: ``auto`` keeps its FSDP strategies; a
    named strategy without FSDP (ddp, tp<N>, one GPU) stops the plan with one line, before any trace."""
    if auto:
        return [(world, [s for s in chosen if s.shard in FSDP_SHARDS]) for world, chosen in by_world]
    other = sorted({f"{s.name} on {world.gpus} GPU{'s' if world.gpus > 1 else ''}" for world, chosen in by_world
                    for s in chosen if s.shard not in FSDP_SHARDS})
    if other:
        raise OptionError(f"--offload params is FSDP2's CPUOffloadPolicy, and {', '.join(other)} has no FSDP: "
                          "plan it with --strategies fsdp (or hsdp<R>, fsdp+tp<N>), or use --offload activations")
    return by_world


def _plan_one(open_session: Callable, workload: Workload, options: StepOptions, device: Device, world: World,
              strategy, time_model: TimeModel, say: Callable[[str], None], *, auto: bool,
              batch_sizes: list[int] | None, global_batch: int | None, multiple_of: int, max_batch: int,
              target_bytes: int, limit: str = "reserved",
              host_limit_bytes: int | None = None) -> tuple[StrategyPlan, int | None]:
    """One strategy on one GPU count, in one tracing session: its row, and the model's
    parameter count (None when ``auto`` skipped it: the model has no tensor-parallel plan)."""
    label = f"{strategy.name} on {world.gpus} GPU{'s' if world.gpus > 1 else ''}"
    base = dict(strategy=strategy.name, gpus=world.gpus, nodes=world.nodes, dp=strategy.dp,
                tp=strategy.tp, shard=strategy.shard, replicas=getattr(strategy, "replicas", 1),
                ep=getattr(strategy, "ep", 1), pp=getattr(strategy, "pp", 1))
    curve = None
    try:
        with contextlib.closing(open_session(workload, options, device, strategy)) as session:
            curve = ShardedCurve(session.trace, device.workspace_bytes, lambda message: say(f"{label}: {message}"),
                                 replay=getattr(session, "reserved", None),
                                 replay_first=getattr(session, "replay_gives_point", False))
            trace_first_sizes(curve, batch_sizes, multiple_of, device.usable_bytes)
            plan_row = _plan_strategy(base, curve, strategy, world, workload, device, options, time_model,
                                      global_batch=global_batch, multiple_of=multiple_of,
                                      max_batch=max_batch, target_bytes=target_bytes, limit=limit,
                                      host_limit_bytes=host_limit_bytes)
            plan_row.whole_reserved = list(getattr(session, "whole_reserved", []))
    except OptionError as error:
        if not auto or (curve is not None and curve.points):
            raise
        # auto tried a combination this model cannot run (no TP plan; a torchtitan job's parallelize_llama has
        # no ddp / zero / pp): a skipped row with the one-line reason, as the candidates' own rules give
        return StrategyPlan(**base, points=[], curve=None, max_local_batch=0, capped=False,
                            skipped=str(error)), None
    plan_row.points = [curve.points[b] for b in sorted(curve.points)]
    plan_row.curve = curve.curve()
    return plan_row, curve.first.params


def _plan_strategy(base: dict, curve: ShardedCurve, strategy, world: World, workload: Workload, device: Device,
                   options: StepOptions, time_model: TimeModel, *, global_batch: int | None, multiple_of: int,
                   max_batch: int, target_bytes: int, limit: str = "reserved",
                   host_limit_bytes: int | None = None) -> StrategyPlan:
    """One strategy's row: the max local batch (traced and confirmed), the micro-batch and its
    time, or, when not even the smallest batch fits, what would make it fit."""
    capacity = device.usable_bytes
    found = curve.max_batch(capacity, lo=multiple_of, hi=max_batch, multiple_of=multiple_of,
                            reserved=limit == "reserved", host_limit_bytes=host_limit_bytes)
    plan_row = StrategyPlan(**base, points=[], curve=None, max_local_batch=found.max_batch_size,
                            capped=found.capped, params_per_rank=curve.first.params_per_rank, limit=limit,
                            tp_loss=getattr(curve.first, "tp_loss", None))
    if plan_row.fits:
        _choose_micro(plan_row, curve, target_bytes, global_batch, multiple_of)
        _time(plan_row, curve, strategy, world, device, options, time_model, workload)
    else:
        plan_row.fix = _fix(plan_row, curve.points[min(curve.points)], capacity, options, host_limit_bytes)
    return plan_row


def _time(plan_row: StrategyPlan, curve: ShardedCurve, strategy, world: World, device: Device,
          options: StepOptions, model: TimeModel, workload: Workload) -> None:
    """Step time, samples/s and tokens/s at the micro-batch, and at the max local batch."""
    at_micro = curve.points[plan_row.micro_batch]
    plan_row.time = step_time(at_micro, strategy, world, device, options.precision, model,
                              plan_row.accumulation_steps, param_offload=options.offloads("params"))
    at_max = curve.points.get(plan_row.max_local_batch)
    plan_row.time_at_max = at_max and step_time(at_max, strategy, world, device, options.precision, model,
                                                param_offload=options.offloads("params"))
    if plan_row.time:
        plan_row.samples_per_s = plan_row.global_batch / plan_row.time.step_time_s
        if workload.tokens_per_sample:
            plan_row.tokens_per_s = plan_row.samples_per_s * workload.tokens_per_sample
    if plan_row.time_at_max and workload.tokens_per_sample:
        plan_row.tokens_per_s_at_max = (plan_row.max_global_batch * workload.tokens_per_sample
                                        / plan_row.time_at_max.step_time_s)
