"""``batchfit bench``: throughput, allocated and reserved memory, phases, growth and leaks.

Per batch size:
- **time** (cuda, cpu): ``warmup`` burn-in steps, then ``steps`` timed steps, the device
  synchronised around each; median and spread (min, max). On a virtual device nothing is
  timed and the time columns stay empty.
- **memory**: measured on cuda (``max_memory_allocated`` / ``max_memory_reserved``); traced
  elsewhere, with reserved memory from replaying the traced allocations of a fresh process
  (build, first and second step) through the model of the CUDA caching allocator
  (``trace/allocator.py``, with the user's ``PYTORCH_ALLOC_CONF``), which frees its cache and
  retries before it runs out, as the real one does; a virtual row whose step cannot reserve
  its memory is out of memory.
- **FLOPs** per step: PyTorch's FlopCounterMode on the traced step; MFU against the device's
  dense peak for the run's precision (fp32 runs: the fp32 peak), counting recomputation
  when activation checkpointing is on (then it is HFU, and the row says so).
"""

from __future__ import annotations

import datetime
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from batchfit.bench.request import BenchRequest
from batchfit.devices import Device, host_link_seconds
from batchfit.errors import OptionError
from batchfit.targets import Target
from batchfit.tiers import Tier, tiers
from batchfit.trace.allocator import AllocatorConfig
from batchfit.trace.curve import fit_line
from batchfit.trace.point import allocated_point, replay_reserved
from batchfit.trace.session import TraceSession
from batchfit.train.oom import classify, describe
from batchfit.train.step import TrainingStep
from batchfit.train.timing import run_timed_steps
from batchfit.workload import StepOptions, Workload

_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
# The traced step runs attention on the CPU flash kernel (as CUDA's fused ones save the
# same tensors); the flop counter knows the CUDA kernels only, so count it as they are.
_FLOPS = {
    _FLASH_CPU: lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v),
    _FLASH_CPU_BACKWARD: lambda grad, q, k, v, *args, out_shape=None, **kwargs: sdpa_backward_flop_count(grad, q, k, v),
}


PHASE_STEPS = 3
"""Extra steps, after the timed ones, that time each phase."""


@dataclass
class BenchRow:
    batch_size: int
    status: str
    source: str
    """'measured' (cuda: memory and time), 'traced' (virtual: memory only), or 'cpu time,
    traced memory' (cpu: time measured; memory traced, as a GPU named with --gpu or else as
    the CPU step allocates)."""
    step_time_s: float | None = None
    step_time_min_s: float | None = None
    step_time_max_s: float | None = None
    samples_per_s: float | None = None
    samples_per_min: float | None = None
    tokens_per_s: float | None = None
    flops_per_step: int | None = None
    mfu: float | None = None
    """FLOPs per step / step time / the device's dense peak for the run's precision."""
    flops_include_recompute: bool = False
    """With activation checkpointing the counted FLOPs include the recomputed forward, so
    the MFU column is then a hardware FLOPs utilisation (HFU)."""
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    reserved_expandable_bytes: int | None = None
    """Traced reserved peak with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."""
    host_reserved_bytes: int | None = None
    """--offload: pinned host memory the step holds (traced: the host allocator's cache)."""
    offloaded_bytes: int | None = None
    """--offload activations: bytes one micro-batch copies to the host and back (traced)."""
    offload_transfer_s: float | None = None
    """Computed: ``offloaded_bytes`` / the GPU's host link (PCIe, per direction), each way per
    micro-batch; on cuda the measured step time already holds the real copies."""
    phase_peak_bytes: dict[str, int] = field(default_factory=dict)
    phase_time_s: dict[str, float] = field(default_factory=dict)
    top: list[dict] = field(default_factory=list)
    error: str | None = None

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Leak:
    steps: int
    allocated_bytes: list[int]
    bytes_per_step: float
    leaking: bool
    where: list[dict]
    """For traced runs: what the surviving allocations are (op, phase, module, bytes)."""

    def to_json(self) -> dict:
        return asdict(self)


class _PhaseTimer:
    """Step hooks that time each phase, synchronising a GPU at each boundary: used only in
    extra steps after the timed ones, so the step time and MFU are measured without them."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.times, self._phase, self._start = device, {}, None, 0.0

    def phase(self, name: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        if self._phase is not None:
            self.times[self._phase] = self.times.get(self._phase, 0.0) + now - self._start
        self._phase, self._start = (None if name == "idle" else name), now

    def before_zero_grad(self, model, optimizer) -> None:
        pass


def _traced(workload: Workload, options: StepOptions, batch_size: int, device: Device | None) -> dict:
    """Trace one batch size in a fresh session: memory, phases, allocator replay, FLOPs.

    For a GPU (``device``) the step is traced as CUDA runs it and reserved memory comes from
    the allocator model; with no GPU named (``--device cpu``) it is traced as the CPU runs
    it, which has no caching allocator and so no reserved figure.
    """
    workspace = device.workspace_bytes if device else 0
    with TraceSession(workload, options, cuda_semantics=device is not None) as session:
        point = allocated_point(session.trace(batch_size), workspace)  # the second step
        reserved = expandable = reserved_oom = None
        if device is not None:  # the whole fresh process: build, first step, second step
            config = AllocatorConfig.from_env()
            reserved, reserved_oom, _ = replay_reserved(session.tracker.events, device, config)
            expandable, _, _ = replay_reserved(session.tracker.events, device,
                                               replace(config, expandable_segments=True))
        with session.fake_mode, FlopCounterMode(display=False, custom_mapping=_FLOPS) as counter:
            session.step.run(batch_size)
        flops = counter.get_total_flops()
    return {"allocated": point.peak_bytes, "reserved": reserved, "expandable": expandable, "reserved_oom": reserved_oom,
            "phases": {k: v for k, v in point.peak_by_phase.items() if k != "idle"},
            "top": point.top, "flops": flops, "host": point.host_reserved_bytes, "offloaded": point.offloaded_bytes}


def _timed(workload: Workload, options: StepOptions, target: Target, batch_size: int, steps: int,
           warmup: int) -> dict:
    """Whole steps timed with no syncs inside them; then the phases, timed in extra steps."""
    step = TrainingStep(workload, options, target.torch_device)
    whole = run_timed_steps(step, batch_size, steps=steps, warmup=warmup)
    timer = _PhaseTimer(target.torch_device)
    phase_steps = min(steps, PHASE_STEPS)
    run_timed_steps(step, batch_size, steps=phase_steps, hooks=timer)
    return {"times": whole.times_s, "phase_time_s": {k: v / phase_steps for k, v in timer.times.items()},
            "allocated": whole.peak_allocated_bytes, "reserved": whole.peak_reserved_bytes}


def bench_row(workload: Workload, options: StepOptions, target: Target, batch_size: int, *,
              steps: int = 10, warmup: int = 3) -> BenchRow:
    """One batch size: traced memory and FLOPs always, timed on cuda and cpu.

    ``batch_size`` is the micro-batch: a step runs ``options.accumulation_steps`` of them,
    so a step processes ``batch_size x accumulation_steps`` samples.
    """
    traced, timed, failure = None, None, None
    try:
        traced = _traced(workload, options, batch_size, target.device)
        if target.kind != "virtual":
            timed = _timed(workload, options, target, batch_size, steps, warmup)
    except Exception as error:  # noqa: BLE001 - reported in the row, classified
        failure = (classify(error), describe(error))
    target.release()  # out of the except block: the failed step's tensors can go now
    if failure:
        return BenchRow(batch_size, failure[0], "—", error=failure[1])
    if target.kind == "virtual" and traced["allocated"] > target.device.usable_bytes:
        return BenchRow(batch_size, "oom", "traced", peak_allocated_bytes=traced["allocated"],
                        error="the traced peak exceeds the device's usable memory")
    if target.kind == "virtual" and traced["reserved_oom"]:
        return BenchRow(batch_size, "oom", "traced", peak_allocated_bytes=traced["allocated"],
                        reserved_expandable_bytes=traced["expandable"], error=traced["reserved_oom"])
    source = {"cuda": "measured", "virtual": "traced", "cpu": "cpu time, traced memory"}[target.kind]
    row = BenchRow(batch_size, "ok", source, flops_include_recompute=options.checkpointing != "none")
    row.peak_allocated_bytes, row.peak_reserved_bytes = traced["allocated"], traced["reserved"]
    row.reserved_expandable_bytes = traced["expandable"]
    row.phase_peak_bytes, row.top, row.flops_per_step = traced["phases"], traced["top"], traced["flops"]
    if options.offload != "none":
        row.host_reserved_bytes, row.offloaded_bytes = traced["host"], traced["offloaded"]
        row.offload_transfer_s = host_link_seconds(traced["offloaded"], target.device) if target.device else None
    if timed:
        times = timed["times"]
        row.step_time_s, row.step_time_min_s, row.step_time_max_s = statistics.median(times), min(times), max(times)
        row.samples_per_s = batch_size * options.accumulation_steps / row.step_time_s
        row.samples_per_min = 60 * row.samples_per_s
        row.tokens_per_s = row.samples_per_s * workload.tokens_per_sample if workload.tokens_per_sample else None
        row.phase_time_s = timed["phase_time_s"]
        if target.kind == "cuda":
            row.peak_allocated_bytes, row.peak_reserved_bytes = timed["allocated"], timed["reserved"]
            row.reserved_expandable_bytes = None  # measured: the traced what-if does not apply
            peak_tflops = target.device.peak_tflops(options.precision)
            if row.flops_per_step and peak_tflops:
                row.mfu = row.flops_per_step / row.step_time_s / (peak_tflops * 1e12)
    return row


def leak_check(workload: Workload, options: StepOptions, target: Target, batch_size: int, steps: int) -> Leak:
    """Run ``steps`` steps and fit allocated memory after each against the step number."""
    where: list[dict] = []
    if target.kind == "cuda":
        step = TrainingStep(workload, options, target.torch_device)
        allocated = []
        for _ in range(steps):
            step.run(batch_size)
            torch.cuda.synchronize(target.torch_device)
            allocated.append(torch.cuda.memory_allocated(target.torch_device))
        del step
    else:  # traced: the tracker sees every storage that survives a step, and who made it
        with TraceSession(workload, options) as session:
            allocated = session.run_steps(batch_size, min(steps, 2))  # optimizer state, caches
            clock = session.tracker.clock
            allocated += session.run_steps(batch_size, steps - len(allocated))
            grown: dict[tuple, int] = {}
            for record in session.tracker.alive_since(clock):
                key = (record.op, record.phase, record.module)
                grown[key] = grown.get(key, 0) + record.nbytes
            where = [{"op": op, "phase": phase, "module": module, "bytes": n}
                     for (op, phase, module), n in sorted(grown.items(), key=lambda kv: -kv[1])[:5]]
    target.release()
    settled = list(enumerate(allocated))[2:]  # the first steps create optimizer state and caches
    slope = fit_line("leak", settled).bytes_per_sample if len(settled) >= 2 else 0.0
    growth = allocated[-1] - allocated[min(2, len(allocated) - 1)]
    leaking = slope >= 256 and growth >= 256 * max(len(settled) - 1, 1)
    return Leak(steps, allocated, slope, leaking, where if leaking else [])


def breakpoints(rows: list[BenchRow], threshold: float = 0.25) -> list[dict]:
    """Where memory per sample changes by more than ``threshold``, and what dominates each side."""
    ok = [r for r in rows if r.status == "ok" and r.peak_allocated_bytes]
    slopes = [((b.peak_allocated_bytes - a.peak_allocated_bytes) / (b.batch_size - a.batch_size), a, b)
              for a, b in zip(ok, ok[1:])]
    out = []
    for (before, a, b), (after, _, c) in zip(slopes, slopes[1:]):
        base = max(abs(before), 1.0)
        if abs(after - before) / base > threshold:
            out.append({
                "between": [a.batch_size, c.batch_size], "at": b.batch_size,
                "bytes_per_sample_before": round(before), "bytes_per_sample_after": round(after),
                "phase_before": max(a.phase_peak_bytes, key=a.phase_peak_bytes.get) if a.phase_peak_bytes else None,
                "phase_after": max(c.phase_peak_bytes, key=c.phase_peak_bytes.get) if c.phase_peak_bytes else None,
                "largest_after": c.top[:3],
            })
    return out


@dataclass(kw_only=True)
class BenchResult:
    workload: str
    description: str
    tokens_per_sample: int | None
    target: Target
    options: StepOptions
    rows: list[BenchRow]
    tiers: list[Tier]
    breakpoints: list[dict]
    hints: list[str]
    leak: Leak | None
    steps: int
    warmup: int
    seconds: float
    created: str = field(
        default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    torch_version: str = torch.__version__

    def to_json(self) -> dict:
        return {
            "workload": self.workload, "description": self.description, "tokens_per_sample": self.tokens_per_sample,
            "device": {"spec": self.target.spec, **(self.target.device.to_json() if self.target.device else {})},
            "options": self.options.to_json(), "steps": self.steps, "warmup": self.warmup,
            "rows": [r.to_json() for r in self.rows], "tiers": [asdict(t) for t in self.tiers],
            "breakpoints": self.breakpoints, "hints": self.hints,
            "leak": self.leak.to_json() if self.leak else None,
            "seconds": round(self.seconds, 1), "created": self.created, "torch_version": self.torch_version,
        }


def _hints(rows: list[BenchRow], leak: Leak | None, points: list[dict]) -> list[str]:
    hints = []
    wasteful = [r for r in rows if r.peak_reserved_bytes and r.peak_allocated_bytes and r.reserved_expandable_bytes]
    worst = max(wasteful, key=lambda r: r.peak_reserved_bytes - r.peak_allocated_bytes, default=None)
    if worst is not None:
        waste = worst.peak_reserved_bytes - worst.peak_allocated_bytes
        if (waste >= max(0.1 * worst.peak_reserved_bytes, 256 * 2**20)
                and worst.reserved_expandable_bytes < worst.peak_reserved_bytes):
            hints.append(
                f"batch {worst.batch_size}: {waste / 2**30:.2f} GiB reserved but not allocated (fragmentation); "
                f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True is traced to reserve "
                f"{worst.reserved_expandable_bytes / 2**30:.2f} GiB instead of "
                f"{worst.peak_reserved_bytes / 2**30:.2f} GiB")
    if leak and leak.leaking:
        top = leak.where[0] if leak.where else None
        place = (f": {top['op']} in the {top['phase']} phase" + (f" ({top['module']})" if top["module"] else "")
                 if top else "")
        hints.append(f"memory grows by {leak.bytes_per_step:,.0f} bytes per step{place}; keep .item() of losses, "
                     "not the tensors, and do not keep tensors that hold the graph across steps")
    for point in points:
        hints.append(f"memory per sample changes at batch ~{point['at']}: "
                     f"{point['bytes_per_sample_before'] / 2**20:.1f} -> {point['bytes_per_sample_after'] / 2**20:.1f} "
                     f"MiB/sample; the peak moves from the {point['phase_before']} phase to the "
                     f"{point['phase_after']} phase")
    return hints


def bench(workload: Workload, request: BenchRequest | None = None, *, target: Target,
          options: StepOptions | None = None, progress: Callable[[str], None] | None = None,
          **fields) -> BenchResult:
    """Bench ``workload`` on ``target`` at each of ``request.batch_sizes`` (``bench/request.py``; or give
    its fields as keywords: ``bench(workload, target=t, batch_sizes=[8, 16])``)."""
    if request is None:
        request = BenchRequest(**fields)
    elif fields:
        raise TypeError(f"bench: give a BenchRequest or its fields as keywords, not both ({', '.join(fields)})")
    request.check()
    batch_sizes, steps, warmup = request.batch_sizes, request.steps, request.warmup
    options = (options or StepOptions()).with_attention_of(workload)  # named in every output
    say = progress or (lambda message: None)
    group = workload.batch_multiple()
    bad = [b for b in batch_sizes if b < 1 or b % group]
    if bad:
        raise OptionError(f"batch sizes must be positive multiples of the group size {group}; got {bad}")
    started = time.perf_counter()
    rows = []
    for b in sorted(set(batch_sizes)):
        say(f"batch size {b}" + (" (traced)" if target.kind == "virtual" else f" ({warmup} + {steps} steps)"))
        rows.append(bench_row(workload, options, target, b, steps=steps, warmup=warmup))
        if rows[-1].status == "error":
            break  # not out of memory: larger batches will not tell more
    leak, leak_check_steps = None, request.leak_check_steps
    if leak_check_steps:
        small = min((r.batch_size for r in rows if r.status == "ok"), default=min(batch_sizes))
        say(f"leak check: {leak_check_steps} steps at batch size {small}")
        leak = leak_check(workload, options, target, small, leak_check_steps)
    points = breakpoints(rows)
    capacity = target.device.usable_bytes if target.device else None
    return BenchResult(
        workload=workload.name, description=workload.description, tokens_per_sample=workload.tokens_per_sample,
        target=target, options=options, rows=rows, tiers=tiers(rows, capacity) if capacity else [],
        breakpoints=points, hints=_hints(rows, leak, points), leak=leak, steps=steps, warmup=warmup,
        seconds=time.perf_counter() - started,
    )
