"""``batchfit estimate``: predict peak training memory and the largest batch, with no GPU.

1. Trace the step at two batch sizes (fake tensors, CUDA's rounding and kernels).
2. Fit the memory curve (one line per phase, the step's peak is their envelope).
3. Solve for the largest batch under the capacity and under the target, and confirm each
   by tracing it and the next size up (``guided_search``): the answer is always traced.
4. If not even the smallest batch fits, say what it needs and what would make it fit.
"""

from __future__ import annotations

import datetime
import fnmatch
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from batchfit.devices import Device, GiB
from batchfit.errors import OptionError
from batchfit.estimator.global_batch import (
    GlobalBatchSplit,
    accumulation_curves,
    check_global_batch,
    split_global_batch,
)
from batchfit.estimator.request import EstimateRequest
from batchfit.phases import deciding_rl_phase, rl_phase_peaks
from batchfit.search import trace_first_sizes
from batchfit.targets import SizedForTarget, bytes_at_target
from batchfit.trace import cache as trace_cache
from batchfit.trace.approximation import Approximation
from batchfit.trace.curve import MemoryCurve
from batchfit.trace.depth import DEPTHS
from batchfit.trace.noops import no_op_notices
from batchfit.trace.point import MemoryPoint, TracedCurve, host_fits
from batchfit.workload import PARAMS_OFFLOAD_NEEDS_FSDP, StepOptions, Workload


@dataclass
class Suggestion:
    """A change that lowers the peak at the smallest batch, with how we know its effect."""

    change: str
    option: str
    peak_bytes: int
    saving_bytes: int
    fits: bool
    source: str
    """'traced' (we ran the step with the change) or 'computed: <formula>'."""


@dataclass(kw_only=True)
class EstimateResult(SizedForTarget):
    workload: str
    description: str
    tokens_per_sample: int | None
    device: Device
    options: StepOptions
    params: int
    trainable_params: int
    points: list[MemoryPoint]
    curve: MemoryCurve
    target_util: float
    multiple_of: int
    max_batch_size: int
    max_batch_size_at_target: int
    capped: bool
    trace_seconds: float
    traces: int
    suggestions: list[Suggestion] = field(default_factory=list)
    depth_blocks: int | None = None
    """When set, the points were traced at depths 2, 3, 4 of this many blocks and extrapolated
    (exactly: the three lay on one line), except the batch sizes in ``full_traces``."""
    full_traces: list[int] = field(default_factory=list)
    depths: tuple[int, ...] = DEPTHS
    """The depths traced when ``depth_blocks`` is set."""
    whole_reserved: list[int] = field(default_factory=list)
    """Batch sizes whose reserved peak came from a whole-model trace; the others' allocation
    streams were written from the depths' streams (``trace/stream.py``)."""
    written_generation: dict | None = None
    """Where an RL step's generation loop was written instead of run (``trace/written.py``): the batch
    sizes it was traced at, written again at (``repeated``: the measured step's, from the warm-up step's
    record), written from the line through two traced sizes at (``line``), and where that line was
    checked; None where it ran at every size."""
    known_limits: list[str] = field(default_factory=list)
    """What this model runs that the trace does not mirror (beyond docs/tracing/known-limits.md's list)."""
    approximations: list[Approximation] = field(default_factory=list)
    """Where the traced figures approximate the step (a compiled model traced as eager): every
    output says each one."""
    notices: list[str] = field(default_factory=list)
    """Options that changed nothing for this model (``trace/noops.py``): every output says each one."""
    limit: str = "reserved"
    """What had to fit: 'reserved' (max_memory_reserved, allocator model) or 'allocated'."""
    host_limit_bytes: int | None = None
    """--host-memory: what the offloaded pinned host bytes must fit; None: not checked."""
    split: GlobalBatchSplit | None = None
    """--global-batch: its micro-batch and accumulation steps (``estimator/global_batch.py``)."""
    run: object | None = None
    """--data --batching: the run over the data (``estimator/run.py``: RunSummary), each traced
    batch size's worst step; None for one shape."""
    eval_phase: object | None = None
    """--eval-batch-size: the eval loop after the answer's training step (``estimator/eval_phase.py``: EvalPhase)."""
    created: str = field(
        default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    torch_version: str = field(default_factory=trace_cache.torch_version)

    def point(self, batch_size: int) -> MemoryPoint | None:
        return next((p for p in self.points if p.batch_size == batch_size), None)

    def fits(self, point: MemoryPoint) -> str:
        """'yes', or 'no' with why, for a traced point under this result's limit. Under the reserved
        limit a size above the answer that was not replayed fails because a smaller one did
        (reserved memory only grows with the batch): the search did not need to replay it; above
        a capped answer (``--max-batch``) nothing was searched."""
        if point.reserved_oom:
            return "no (cannot reserve)"
        if not host_fits(point, self.host_limit_bytes):
            return "no (host memory)"
        if max(point.peak_bytes, point.peak_reserved_bytes or 0) > self.capacity_bytes:
            return "no"
        if self.limit == "reserved" and point.peak_reserved_bytes is None and point.batch_size > self.max_batch_size:
            return "not searched (above --max-batch)" if self.capped else "no (a smaller batch cannot reserve)"
        return "yes"

    def why_smallest_does_not_fit(self) -> str:
        """When nothing fits: what the smallest size needed, or that its memory could not be reserved."""
        small = self.points[0]
        if not host_fits(small, self.host_limit_bytes) and small.peak_bytes <= self.capacity_bytes:
            return (f"its offloaded tensors hold {small.host_reserved_bytes / GiB:.2f} GiB of pinned host memory, "
                    f"over --host-memory {self.host_limit_bytes / GiB:.2f} GiB")
        if small.reserved_oom and small.peak_bytes <= self.capacity_bytes:
            return (f"its tensors take {small.peak_bytes / GiB:.2f} GiB of the {self.capacity_bytes / GiB:.2f} GiB "
                    f"usable, but the caching allocator cannot reserve them ({small.reserved_oom})")
        return f"it needs {small.peak_bytes / GiB:.2f} GiB, {self.capacity_bytes / GiB:.2f} GiB are usable"

    def headroom_bytes(self, batch_size: int) -> int | None:
        """Usable memory left at ``batch_size``: beyond reserved memory where it was replayed."""
        point = self.point(batch_size)
        return None if point is None else self.capacity_bytes - (point.peak_reserved_bytes or point.peak_bytes)

    @property
    def rl_phases(self) -> tuple[int, dict[str, int]] | None:
        """An RL step's phases at the answer (else the smallest traced batch): (batch, each phase's
        allocated peak, ``phases.RL_PHASES``); None for a step with no generation phase."""
        point = self.point(self.max_batch_size) if self.max_batch_size else (self.points[0] if self.points else None)
        peaks = rl_phase_peaks(point.peak_by_phase) if point is not None else None
        return (point.batch_size, peaks) if peaks else None

    def _rl_json(self) -> dict:
        found = self.rl_phases
        if found is None:
            return {}
        batch_size, peaks = found
        return {"rl_phases": {"batch_size": batch_size, "peak_bytes": peaks,
                              "deciding_phase": deciding_rl_phase(peaks)}}

    def _run_json(self, batch_size: int) -> dict:
        run = self.run.runs.get(batch_size) if self.run is not None else None
        return {"run": run.to_json()} if run is not None else {}

    def to_json(self) -> dict:
        best = self.max_batch_size
        return {
            "source": "traced",
            "workload": self.workload,
            "description": self.description,
            "tokens_per_sample": self.tokens_per_sample,
            "device": self.device.to_json(),
            "options": self.options.to_json(),
            "params": self.params,
            "trainable_params": self.trainable_params,
            "points": [{**p.to_json(), "fits": self.fits(p), **self._run_json(p.batch_size)} for p in self.points],
            "fit": self.curve.to_json(max(best, max(p.batch_size for p in self.points)), self.multiple_of),
            "target_util": self.target_util,
            "multiple_of": self.multiple_of,
            "capacity_bytes": self.capacity_bytes,
            "target_bytes": self.target_bytes,
            "max_batch_size": best,
            "max_batch_size_at_target": self.max_batch_size_at_target,
            "capped": self.capped,
            "limit": self.limit,
            "peak_bytes_at_max": self.point(best).peak_bytes if best else None,
            "peak_reserved_bytes_at_max": self.point(best).peak_reserved_bytes if best else None,
            "paged_bytes": self.points[0].paged_bytes if self.points else 0,
            "headroom_bytes": self.headroom_bytes(best) if best else None,
            "host_peak_bytes": self.point(best).host_peak_bytes if best else None,
            "host_reserved_bytes": self.point(best).host_reserved_bytes if best else None,
            "host_limit_bytes": self.host_limit_bytes,
            "suggestions": [vars(s) for s in self.suggestions],
            "known_limits": self.known_limits,
            "approximations": [a.to_json() for a in self.approximations],
            "notices": self.notices,
            "trace_seconds": round(self.trace_seconds, 2),
            "traces": self.traces,
            "traced_by_depth": ({"blocks": self.depth_blocks, "depths": list(self.depths),
                                 "full_traces": self.full_traces, "whole_reserved": self.whole_reserved}
                                if self.depth_blocks else None),
            "written_generation": self.written_generation,
            **({"global_batch": self.split.global_batch, "micro_batch": self.split.micro_batch,
                "accumulation_steps": self.split.accumulation_steps, "split": self.split.to_json()}
               if self.split else {}),
            **({"run": self.run.to_json()} if self.run is not None else {}),
            **({"eval": self.eval_phase.to_json()} if self.eval_phase is not None else {}),
            **self._rl_json(),
            "created": self.created,
            "torch_version": self.torch_version,
        }


def estimate(workload: Workload, request: EstimateRequest | None = None, *, device: Device,
             options: StepOptions | None = None, progress: Callable[[str], None] | None = None,
             **fields) -> EstimateResult:
    """Trace ``workload`` and find the largest batch that fits ``device``.

    ``request`` (``estimator/request.py``) says what is asked: the sizes traced, the limit, the
    global batch, the eval loop...; or give its fields as keywords
    (``estimate(workload, device=d, max_batch=64, limit="allocated")``). Below, each field by its name.

    ``limit`` is what must stay under the usable memory: ``reserved`` (default: what the
    CUDA caching allocator reserves, fragmentation included; a GPU runs out when it cannot
    reserve a segment) or ``allocated`` (what tensors hold, ``max_memory_allocated``).
    ``host_memory_bytes`` (``--host-memory``): a batch whose ``--offload``-ed pinned host bytes
    pass it does not fit; None does not check them (they are reported all the same).
    ``global_batch`` (``--global-batch``): also the micro-batch and accumulation steps that make
    it on one device, by plan's rule, each candidate traced with its accumulation.
    ``eval_batch_size`` (``--eval-batch-size``): also HF Trainer's eval loop after the answer's
    training step (``estimator/eval_phase.py``).
    ``cache``: reuse the traces of an earlier call in the trace cache (``trace/cache.py``; only for
    a workload from ``load_workload``), and write this call's there.
    """
    if request is None:
        request = EstimateRequest(**fields)
    elif fields:
        raise TypeError(f"estimate: give an EstimateRequest or its fields as keywords, not both ({', '.join(fields)})")
    options = (options or StepOptions()).with_attention_of(workload)  # named in every output
    if options.offload_spec.params:  # before any trace: one device has no FSDP
        raise OptionError(PARAMS_OFFLOAD_NEEDS_FSDP)
    request.check()
    limit, cache, host_limit_bytes = request.limit, request.cache, request.host_memory_bytes
    multiple_of = workload.batch_multiple(request.multiple_of)
    check_global_batch(request.global_batch, multiple_of, options)
    notices = no_op_notices(workload, options)
    say = progress or (lambda message: None)
    started = time.perf_counter()
    with TracedCurve(workload, options, device, say, keep_streams=limit == "reserved", cache=cache) as traced:
        trace_first_sizes(traced, request.batch_sizes, multiple_of, device.usable_bytes)
        answers = [traced.max_batch(limit_bytes, lo=multiple_of, hi=request.max_batch, multiple_of=multiple_of,
                                    reserved=limit == "reserved", host_limit_bytes=host_limit_bytes)
                   for limit_bytes in (device.usable_bytes, bytes_at_target(device, request.target_util))]
        points = traced.points
        known_limits = traced.known_limits
        approximations = traced.approximations
        suggestions = (_suggestions(workload, options, device, points[min(points)], say, cache)
                       if request.suggest and answers[0].max_batch_size == 0 else [])
        split = None
        if request.global_batch is not None:
            split = _split(traced, request, options, device, multiple_of, answers[0].max_batch_size, say)
            points = traced.points
    result = EstimateResult(
        workload=workload.name, description=workload.description,
        tokens_per_sample=workload.tokens_per_sample, device=device, options=options,
        params=traced.params, trainable_params=traced.trainable_params,
        points=[points[b] for b in sorted(points)], curve=traced.curve(), target_util=request.target_util,
        multiple_of=multiple_of, max_batch_size=answers[0].max_batch_size,
        max_batch_size_at_target=answers[1].max_batch_size, capped=answers[0].capped,
        trace_seconds=time.perf_counter() - started, traces=len(points), suggestions=suggestions, limit=limit,
        depth_blocks=traced.blocks, full_traces=traced.full_traces, whole_reserved=traced.whole_reserved,
        written_generation=traced.written_generation,
        known_limits=known_limits, approximations=approximations, host_limit_bytes=host_limit_bytes, split=split,
        notices=notices,
    )
    if request.eval_batch_size:
        from batchfit.estimator.eval_phase import add_eval_phase  # the eval loop's tracer: only when asked

        add_eval_phase(result, workload, request.eval_batch_size, held_steps=request.eval_held_steps, limit=limit,
                       say=say)
    return result


def _split(traced: TracedCurve, request: EstimateRequest, options: StepOptions, device: Device, multiple_of: int,
           max_local: int, say: Callable[[str], None]) -> GlobalBatchSplit:
    """``global_batch``'s micro-batch and accumulation steps, each candidate traced with its accumulation."""
    global_batch, limit = request.global_batch, request.limit

    def open_curve(alt: StepOptions) -> TracedCurve:
        say(f"tracing with {alt.accumulation_steps} accumulation steps for global batch {global_batch}")
        return TracedCurve(traced.workload, alt, device, say, keep_streams=limit == "reserved", cache=request.cache)

    with accumulation_curves(open_curve, options) as at_accumulation:
        return split_global_batch(traced, at_accumulation, global_batch=global_batch, max_local=max_local,
                                  multiple_of=multiple_of, target_bytes=bytes_at_target(device, request.target_util),
                                  capacity_bytes=device.usable_bytes, limit=limit,
                                  host_limit_bytes=request.host_memory_bytes)


SHARDING_GPUS = (2, 4, 8, 16, 32, 64)
LORA = "*lora*"


def _has_parameters(workload: Workload, pattern: str) -> bool:
    """Whether any parameter name matches ``pattern`` (built on the meta device: no memory)."""
    import torch

    try:
        with torch.device("meta"):
            names = [name for name, _ in workload.build_model().named_parameters()]
    except Exception:  # noqa: BLE001 - a model that cannot be built on meta: do not suggest
        return False
    return any(fnmatch.fnmatchcase(name, pattern) for name in names)


def _suggestions(workload: Workload, options: StepOptions, device: Device,
                 smallest: MemoryPoint, say: Callable[[str], None], cache: bool = False) -> list[Suggestion]:
    """What would make the smallest batch fit: traced where it is a step option, else computed."""
    capacity = device.usable_bytes
    out: list[Suggestion] = []
    peak, parts = smallest.peak_bytes, smallest.breakdown

    def traced(change: str, option: str, **changes) -> None:
        say(f"tracing batch size {smallest.batch_size} with {option}")
        alt = StepOptions(**{**options.to_json(), **changes})
        try:
            traced_alt = TracedCurve(workload, alt, device, cache=cache)
        except OptionError:
            return  # not applicable to this model (no block stack to checkpoint, say)
        with traced_alt:
            new = traced_alt.point(smallest.batch_size).peak_bytes
        if new < peak:  # a change that saves nothing is not a suggestion
            out.append(Suggestion(change, option, new, peak - new, new <= capacity, "traced"))

    def computed(change: str, option: str, saving: float, formula: str) -> None:
        if saving <= 0:
            return
        new = int(peak - saving)
        out.append(Suggestion(change, option, new, int(saving), new <= capacity, f"computed: {formula}"))

    if options.precision != "bf16":
        traced("bf16 weights, gradients and optimizer state", "--precision bf16", precision="bf16")
    if options.checkpointing == "none":
        traced("activation checkpointing of every block", "--checkpointing full", checkpointing="full")
    if options.offload == "none":
        traced("saved activations offloaded to pinned host memory (torchtune's / TRL's hooks)",
               "--offload activations", offload="activations")
    state = parts["optimizer_state"]
    if not (options.optimizer or "").endswith("bit"):  # not already an 8-bit / 4-bit optimizer
        computed("8-bit optimizer state (bitsandbytes AdamW8bit)", "--optimizer adamw-8bit",
                 state * 3 / 4, "optimizer_state x 3/4 (1 byte per value instead of 4)")
    if not options.trainable and _has_parameters(workload, LORA):  # else --train-only '*lora*' is refused
        computed("train adapters only (LoRA), base frozen", f"--train-only '{LORA}'",
                 parts["gradients"] + state, "gradients + optimizer_state at the peak (the adapters' own are ~1%)")
    # Everything per parameter shards: at an optimizer-step peak the step's temporaries are
    # per-parameter too (foreach scratch), so they shard with the state they update.
    per_param = ["parameters", "gradients", "optimizer_state"]
    if smallest.phase == "optimizer":
        per_param.append("temporaries")
    sharded = sum(parts[name] for name in per_param)
    for gpus in SHARDING_GPUS:
        saving = sharded * (1 - 1 / gpus)
        if peak - saving <= capacity or gpus == SHARDING_GPUS[-1]:
            computed(f"shard over {gpus} GPUs (FSDP / ZeRO-3)", f"{gpus} GPUs", saving,
                     f"({' + '.join(per_param)}) x (1 - 1/{gpus})")
            break
    return out
