"""What ``batchfit plan`` answers: each traced point (PlanPoint), each strategy's plan
(StrategyPlan) and the whole result (PlanResult) with its JSON. The engine (``plan/engine.py``)
fills them; the report and the CLI read them."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

from batchfit.devices import Device
from batchfit.plan.time_model import OVERLAP_RULE, StepTime, TimeModel
from batchfit.plan.world import World
from batchfit.targets import SizedForTarget
from batchfit.trace.approximation import Approximation
from batchfit.trace.curve import MemoryCurve
from batchfit.workload import StepOptions

SOURCE = ("memory traced on a fake process group (rank 0, PyTorch's own sharding, fake tensors); "
          "time computed: FLOPs / (peak x MFU) + collective bytes / link bandwidth")


def _auto_bounds() -> tuple[str, ...]:
    """What --strategies auto leaves out only to bound the tracing (``candidates.bounds``)."""
    from batchfit.plan.candidates import bounds

    return bounds()


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
    curve_peaks: dict[str, int] = field(default_factory=dict)
    """The peaks the plan's curve fits a line to each (``trace.curve.envelope``): each phase's peak
    (the largest pipeline rank's) and under pp<N> each pipeline rank's, workspace included."""

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
    added = 0 if "workspace" in breakdown else workspace_bytes
    breakdown["workspace"] = breakdown.get("workspace", workspace_bytes)
    stages = tuple(getattr(traced, "stage_peak_bytes", ()))
    peaks = {phase: peak + added for phase, peak in getattr(traced, "peak_by_phase", {}).items()}
    peaks |= {f"pipeline rank {rank}": peak + added for rank, peak in enumerate(stages)}
    return PlanPoint(traced.local_batch, traced.peak_bytes + added, breakdown, traced.flops, tuple(traced.collectives),
                     getattr(traced, "host_reserved_bytes", 0), getattr(traced, "offloaded_bytes", 0),
                     getattr(traced, "host_peak_bytes", 0), stage_peak_bytes=stages,
                     curve_peaks=peaks or {"step": traced.peak_bytes + added})


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
    reserved_written: dict = field(default_factory=dict)
    """Local batches whose fresh stream was written from the line through traced ones, and those sizes
    (``trace.stream_line.StreamLine.summary``); empty when every replayed stream was traced."""
    replayed_only: list = field(default_factory=list)
    """The written sizes whose step was not traced: their replays alone (``plan.curve.ReplayedSize``)."""
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
    bound_tokens_per_s: float | None = None
    """Under auto, a candidate not traced because this bound on its tokens/s (``plan/speed_bound.py``) is
    below the best traced one's (``skipped`` says so, with the formula); None for any other row."""
    tp_loss: str | None = None
    """Under TP, the loss the plan traced: sharded (loss_parallel), gathered or replicated; None without TP."""
    ep: int = 1
    """Expert-parallel degree (ep<N>; within dp, so max_global_batch is unchanged by it)."""
    pp: int = 1
    """Pipeline stages (pp<N>); 1 without."""
    cp: int = 1
    """Context-parallel degree (cp<N>; world = pp x dp x cp x tp); 1 without."""
    pp_schedule: str = ""
    """Under pp<N>: the schedule as --pp-schedule names it ("1f1b", "zbv", ...); "" without."""
    microbatches: int = 0
    """Under pp<N>: micro-batches per pipeline step (the local batch splits into them); 0 without."""
    pp_layers_per_stage: int = 0
    """Under pp<N>: blocks per stage (torchtitan's pipeline_parallel_layers_per_stage); 0 without."""
    derived_from_gpus: int = 0
    """The GPU count whose trace this row's memory was derived from (``plan/derived.py``: DDP holds
    the same bytes on any world above 1); 0: traced for this row itself."""

    @property
    def max_global_batch(self) -> int:
        return self.max_local_batch * self.dp

    @property
    def step_time_s(self) -> float | None:
        return self.time.step_time_s if self.time else None

    @property
    def source(self) -> str:
        """Where the row's numbers come from: SOURCE, or the trace its memory was derived from."""
        memory, time = SOURCE.split("; ")
        if self.derived_from_gpus:
            memory = (f"memory derived from the {self.derived_from_gpus}-GPU trace (DDP's rank 0 holds the same "
                      "bytes on any number of GPUs above 1; its all-reduces timed over this row's GPUs)")
        return f"{memory}; {time if self.time else 'time not computed (no peak FLOP/s known)'}"

    @property
    def fits(self) -> bool:
        return self.max_local_batch > 0

    def point(self, local_batch: int) -> PlanPoint | None:
        return next((p for p in self.points if p.local_batch == local_batch), None)

    def _fit_json(self) -> dict | None:
        """The curve's line that is the peak at the max local batch (or the largest traced size), and every line."""
        if self.curve is None:
            return None
        at = self.max_local_batch or max((p.local_batch for p in self.points), default=1)
        line = self.curve.dominant(at)
        return {"model": "peak(local_batch) = the largest of the lines' fixed_bytes + bytes_per_sample * local_batch",
                "line": line.phase, "fixed_bytes": round(line.fixed_bytes),
                "bytes_per_sample": round(line.bytes_per_sample),
                "lines": [{"line": x.phase, "fixed_bytes": round(x.fixed_bytes),
                           "bytes_per_sample": round(x.bytes_per_sample)} for x in self.curve.lines]}

    def to_json(self) -> dict:
        return {
            "strategy": self.strategy, "gpus": self.gpus, "nodes": self.nodes, "dp": self.dp, "tp": self.tp,
            "ep": self.ep, "pp": self.pp, "cp": self.cp, "shard": self.shard, "replicas": self.replicas,
            **({"pp_schedule": self.pp_schedule, "microbatches": self.microbatches,
                "pp_layers_per_stage": self.pp_layers_per_stage} if self.pp > 1 else {}),
            "points": [p.to_json() for p in self.points],
            "fit": self._fit_json(),
            "max_local_batch": self.max_local_batch, "max_global_batch": self.max_global_batch,
            "capped": self.capped, "micro_batch": self.micro_batch,
            "accumulation_steps": self.accumulation_steps, "global_batch": self.global_batch,
            "peak_bytes_at_micro": self.peak_bytes_at_micro, "limit": self.limit,
            "peak_reserved_bytes_at_micro": self.peak_reserved_bytes_at_micro, "peak_step": self.peak_step,
            "whole_reserved": self.whole_reserved, "reserved_written": self.reserved_written,
            "replayed_only": [{"local_batch": p.local_batch, **p.reserved.to_json()} for p in self.replayed_only],
            "above_target": self.above_target,
            "host_reserved_bytes_at_micro": (self.point(self.micro_batch).host_reserved_bytes
                                             if self.point(self.micro_batch) else None),
            "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s, "samples_per_s": self.samples_per_s,
            "days": self.days, "time": self.time.to_json() if self.time else None,
            "step_time_s_at_max": self.time_at_max.step_time_s if self.time_at_max else None,
            "tokens_per_s_at_max": self.tokens_per_s_at_max,
            "params_per_rank": self.params_per_rank, "fix": self.fix, "skipped": self.skipped,
            "bound_tokens_per_s": self.bound_tokens_per_s,
            "tp_loss": self.tp_loss,
            "source": self.source, "derived_from_gpus": self.derived_from_gpus,
        }


@dataclass(kw_only=True)
class PlanResult(SizedForTarget):
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
    created: str = field(
        default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))

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


