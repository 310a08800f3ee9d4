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
5. Recommend, per GPU count, the strategy with the most tokens/s. Under ``--strategies auto`` the
   candidates are traced in the order of a bound on their tokens/s (``plan/by_bound.py``), and those
   whose bound is below the best traced one's are not traced (their rows say so, with the bound).

Each strategy is one tracing session (``plan/deep.py``: built once, at depths 2, 3 and 4
for a deep model), traced at one local batch after another. The tracer is a parameter
(``trace=``, one point at a time), so the engine is tested with stand-ins whose numbers are
known, and the real tracer is imported only when a plan runs. What it answers (PlanPoint, StrategyPlan,
PlanResult and their JSON) is in ``plan/result.py``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable

from batchfit.devices import Device, GiB
from batchfit.distributed.parallelisms import approximations as parallelism_approximations
from batchfit.distributed.parallelisms import runs_experts
from batchfit.distributed.strategy_name import FSDP_SHARDS, field_degrees
from batchfit.errors import OptionError
from batchfit.plan import by_bound, workers
from batchfit.plan.curve import PointSession, ShardedCurve  # noqa: F401 - the API's names
from batchfit.plan.derived import SharedTraces
from batchfit.plan.derived import jobs as derived_jobs
from batchfit.plan.request import DEFAULT_STRATEGIES, PlanRequest  # noqa: F401 - the API's names
from batchfit.plan.result import PlanPoint, PlanResult, StrategyPlan, plan_point  # noqa: F401 - the API's names
from batchfit.plan.row_cache import row_cache
from batchfit.plan.time_model import TimeModel, step_time
from batchfit.plan.world import CHINCHILLA_TOKENS_PER_PARAM, World, parse_tokens
from batchfit.search import (
    _check_limit,
    check_search_options,
    choose_micro,
    micro_candidates,
    trace_first_sizes,
)
from batchfit.targets import bytes_at_target
from batchfit.workload import StepOptions, Workload

SECONDS_PER_DAY = 86400

def _validate(target_util: float, multiple_of: int, max_batch: int, batch_sizes: list[int] | None,
              global_batch: int | None, limit: str) -> None:
    check_search_options(target_util=target_util, multiple_of=multiple_of, max_batch=max_batch)
    _check_limit(limit)
    if any(b < 1 for b in batch_sizes or []):
        raise OptionError("`batch_sizes` are local batch sizes, 1 or more: e.g. `batch_sizes` 1,2,4")
    if global_batch is not None and global_batch < 1:
        raise OptionError(f"`global_batch` must be 1 or more, e.g. 512; got {global_batch}")


def _check_global_batch(global_batch: int, strategies: list, multiple_of: int) -> None:
    """Every strategy must reach the global batch with whole micro-batches on every rank."""
    for s in strategies:
        own = _own_multiple(s, multiple_of)
        if global_batch % (s.dp * own):
            step = math.lcm(*(x.dp * _own_multiple(x, multiple_of) for x in strategies))
            near = max(step, round(global_batch / step) * step)
            raise OptionError(
                f"`global_batch` {global_batch} cannot be split over {s.name}'s {s.dp} data-parallel ranks on "
                f"{s.world_size} GPUs{f' in multiples of {own}' if own > 1 else ''}: "
                f"use a multiple of {step}, e.g. `global_batch` {near}")


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
    over_host = host_limit_bytes is not None and point.host_reserved_bytes > host_limit_bytes
    if point.peak_bytes <= capacity_bytes and over_host:
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
               f"{(point.peak_bytes - capacity_bytes) / GiB:.2f} GiB more than the "
               f"{capacity_bytes / GiB:.2f} GiB usable"]
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


def plan(workload: Workload, request: PlanRequest | None = None, *, device: Device,
         options: StepOptions | None = None, progress: Callable[[str], None] | None = None,
         trace: Callable | None = None, parse: Callable | None = None, replay: Callable | None = None,
         facts=None, **fields) -> PlanResult:
    """Plan ``workload`` on ``device`` for each of ``request.worlds`` and each of ``request.strategies``.

    ``request`` (``plan/request.py``) says what is asked: the worlds, strategies, global batch, tokens,
    batch sizes, limit, time model...; or give its fields as keywords
    (``plan(workload, device=d, worlds=[World(8)], strategies="fsdp")``). Below, each field by its name.

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
    searches multiples of its own micro-batches; those that cannot apply are rows with ``skipped``;
    the others are traced in the order of a bound on their tokens/s, and one whose bound is below the
    best traced row's is a row ``skipped`` 'not traced: at most ...' with ``bound_tokens_per_s``
    (``plan/by_bound.py``, ``plan/speed_bound.py``).
    ``cache``: read each strategy session's rows from the trace cache where an earlier plan asked the
    same of it, and write them there (``plan/row_cache.py``; the real tracer and a workload from
    ``load_workload`` only).
    """
    if request is None:
        request = PlanRequest(**fields)
    elif fields:
        raise TypeError(f"plan: give a PlanRequest or its fields as keywords, not both ({', '.join(fields)})")
    options = (options or StepOptions()).with_attention_of(workload)  # named in every output
    time_model = request.time_model or TimeModel()
    _validate(request.target_util, request.multiple_of, request.max_batch, request.batch_sizes, request.global_batch,
              request.limit)
    tokens_asked = request.tokens if isinstance(request.tokens, str) else None
    tokens = parse_tokens(request.tokens) if isinstance(request.tokens, str) else request.tokens
    if tokens is not None and not workload.tokens_per_sample:
        raise OptionError(f"`tokens` needs a sequence model: {workload.name} has no tokens per sample; drop `tokens`")
    if options.quantize != "none":
        # plan prepares each rank's step on the meta device, then once more per rank: bitsandbytes'
        # quantization state (absmax, not a parameter) would stay behind, and FSDP2 / TP would hold
        # Params4bit as DTensors, which bitsandbytes cannot (nor can ColwiseParallel split them).
        raise OptionError(f"`quantize` {options.quantize} (QLoRA) is traced on one GPU only, not under plan's "
                          "strategies yet: use `batchfit estimate` with the same options for one GPU's QLoRA step, "
                          "or plan without `quantize`")
    if workload.generate is not None:
        # the policy's generation runs a submodule of the wrapped model (model.policy), whose sharded
        # parameters FSDP2 gathers only around the root's forward: TRL gathers them for generation itself
        # (unwrap_model_for_generation), which no strategy here mirrors yet
        raise OptionError(f"{workload.name} generates (an RL step): plan does not trace generation under its "
                          "strategies yet; use `batchfit estimate` with the same options for one GPU's step")
    if options.accumulation_steps != 1:
        raise OptionError("plan chooses the accumulation steps itself (to reach `global_batch`): "
                          "drop `accumulation_steps`")
    if trace is None or parse is None:
        from batchfit.plan import sharded  # the tracer, imported when a plan runs (it pulls in torch.distributed)

        pipeline = dict(pp_schedule=request.pp_schedule, microbatches=request.microbatches)
        pp_options = {} if (request.pp_schedule, request.microbatches) == ("1f1b", 0) else pipeline
        parse = parse or functools.partial(sharded.parse_strategies, **pp_options)  # a stand-in need not take them
    if trace is not None:
        open_session = functools.partial(PointSession, trace, replay=replay)
    else:
        from batchfit.plan.deep import DeepSession  # the tracer: torch, when a plan runs
        from batchfit.plan.pipeline import pipeline_or

        open_session = pipeline_or(functools.partial(DeepSession, session=sharded.ShardedSession,
                                                     fork=request.processes != 1))  # processes 1: one process
    multiple_of = workload.batch_multiple(request.multiple_of)
    auto = request.strategies.strip().lower() == "auto"
    not_traced: list[StrategyPlan] = []
    if auto:  # every combination (plan/candidates.py); the ones that cannot apply listed, not traced
        from batchfit.plan.candidates import model_facts

        facts = facts or model_facts(workload, options)
        by_world, not_traced = _auto(request.worlds, parse, facts, request.pp_schedule, request.microbatches)
    else:
        # every bad name before any trace
        by_world = [(world, parse(request.strategies, world.gpus)) for world in request.worlds]
    if options.offload_spec.params and auto:
        for world, chosen in by_world:
            chosen[:] = _set_aside(world, chosen, lambda s: None if s.shard in FSDP_SHARDS else
                                   "--offload params is FSDP2's CPUOffloadPolicy: this has no FSDP", not_traced)
    elif options.offload_spec.params:
        by_world = _with_fsdp_only(by_world, auto=False)
    if request.global_batch is not None:
        for world, chosen in by_world:
            if auto:
                chosen[:] = _set_aside(world, chosen, _not_reaching(request.global_batch, multiple_of), not_traced)
            _check_global_batch(request.global_batch, chosen, multiple_of)
    # the default strategies were not chosen by the user: a too-wide fsdp is a skipped row beside ddp's answer
    _refuse_wide_shards(workload, by_world, auto or request.strategies == DEFAULT_STRATEGIES, not_traced)
    _refuse_tp_losses(workload, options, by_world, auto, not_traced)
    if auto:
        _set_aside_too_large(workload, options, device, by_world, not_traced)
    say = progress or (lambda message: None)
    started = time.perf_counter()
    target_bytes = bytes_at_target(device, request.target_util)
    cached = request.cache and trace is None

    def one(job: tuple[World, object, list], say: Callable[[str], None]) -> tuple[list[StrategyPlan], int | None, int]:
        world, strategy, derived = job
        search = dict(auto=auto, batch_sizes=request.batch_sizes, global_batch=request.global_batch,
                      multiple_of=_own_multiple(strategy, multiple_of),
                      max_batch=request.max_batch, target_bytes=target_bytes, limit=request.limit,
                      host_limit_bytes=request.host_memory_bytes)
        kept = row_cache(workload, options, device, job, {**search, "time_model": time_model}) if cached else None
        found = kept.get("rows") if kept is not None else None
        if found is not None:
            say(f"{strategy.name} on {world.gpus} GPU{'s' if world.gpus > 1 else ''}: read from the trace cache "
                "(--no-cache traces it again)")
            return found
        rows = _plan_one(open_session, workload, options, device, world, strategy, time_model, say, derived=derived,
                         **search)
        if kept is not None:
            kept.put("rows", rows)
        return rows

    # a pipeline's session traces every rank's stages whole, not the model cut to 2-4 blocks: the longest
    processes = request.processes if trace is None else 1

    def sessions(function: Callable, jobs: list) -> workers.Sessions:
        return workers.Sessions(function, jobs, say, processes=processes,
                                costly=lambda job: getattr(job[1], "pp", 1) > 1,
                                label=lambda job: f"{job[1].name} on {job[0].gpus} GPU{'s' if job[0].gpus > 1 else ''}")

    def run(function: Callable, jobs: list) -> list:
        with sessions(function, jobs) as started:
            return started.run(range(len(jobs)))

    jobs = derived_jobs(by_world)
    if auto:  # the candidates in the order of the tokens/s they could reach, none that cannot be first
        done = by_bound.run_auto(one, jobs, say, sessions=sessions, workload=workload, options=options, device=device,
                                 time_model=time_model, experts=facts.experts,
                                 processes=processes or workers.default_processes(len(jobs)), row=_bounded_row)
    else:
        done = run(one, jobs)
    by_key = {(p.gpus, p.strategy): p for rows, _, _ in done for p in rows}
    plans = [by_key[(world.gpus, s.name)] for world, chosen in by_world for s in chosen] + not_traced
    params = next((n for _, n, _ in done if n is not None), None)
    traces = sum(count for _, _, count in done)
    if params is None:
        raise OptionError(f"no strategy of '{request.strategies}' could be traced for {workload.name}: "
                          "every one was skipped (see above); name strategies with `strategies` ddp,fsdp")
    # what was traced only: a candidate auto set aside by its bound, or skipped, has no figure to approximate
    approximations = _approximations(workload, options, [s for world, chosen in by_world for s in chosen
                                                         if not by_key[(world.gpus, s.name)].skipped])
    if tokens == "chinchilla":
        tokens = float(CHINCHILLA_TOKENS_PER_PARAM * params)
    for p in plans:
        if tokens is not None and p.tokens_per_s:
            p.days = tokens / p.tokens_per_s / SECONDS_PER_DAY
    return PlanResult(
        workload=workload.name, description=workload.description, tokens_per_sample=workload.tokens_per_sample,
        device=device, options=options, worlds=list(request.worlds), strategies_asked=request.strategies,
        plans=plans,
        params=params, global_batch=request.global_batch, tokens=tokens, tokens_asked=tokens_asked,
        target_util=request.target_util, multiple_of=multiple_of, time_model=time_model,
        links=time_model.links(device), trace_seconds=time.perf_counter() - started, traces=traces,
        approximations=approximations, limit=request.limit, host_limit_bytes=request.host_memory_bytes,
    )


def _approximations(workload: Workload, options: StepOptions, traced: list) -> list:
    """Where the figures of the ``traced`` strategies (each row's, on each GPU count) approximate their step:
    the compiled or eager trace, float8, routing, offload, attention, packing and each parallelism's own."""
    from batchfit.trace.approximation import attention_approximations, offload_approximations
    from batchfit.trace.compiled import plan_compile_approximations, sharded_eager_reason, sharded_traces_compiled
    from batchfit.trace.cuda_float8 import float8_approximations
    from batchfit.trace.hf_packing import batch_passes_position_ids, packing_approximation
    from batchfit.trace.routing import workload_routing_approximation

    every = list({s.name: s for s in traced}.values())
    compiled = [s.name for s in every if sharded_traces_compiled(s, options)]
    approximations = plan_compile_approximations(workload, options, compiled, {
        s.name: sharded_eager_reason(s, options) or "" for s in every if s.name not in compiled})
    approximations += float8_approximations(options)
    approximations += workload_routing_approximation(
        workload, options, expert_parallel=bool(traced) and all(runs_experts(s) for s in traced))
    approximations += offload_approximations(options.offload_spec, options.compile)
    approximations += attention_approximations(options.attention)
    approximations += packing_approximation(int(batch_passes_position_ids(workload)))
    approximations += parallelism_approximations(traced, workload, options)  # each parallelism's own (registry)
    return approximations


def _auto(worlds: list[World], parse: Callable, facts, pp_schedule: str, microbatches: int) -> tuple[list, list]:
    """``--strategies auto``: per world, the strategies of ``candidates.candidates`` to trace, and a
    row (not traced, ``skipped`` saying why) for each combination that cannot apply to this model."""
    from batchfit.plan.candidates import candidates

    by_world, not_traced = [], []
    for world in worlds:
        listed = candidates(world, facts, pp_schedule=pp_schedule, microbatches=microbatches)
        names = [c.name for c in listed if c.skipped is None]
        by_world.append((world, parse(",".join(names), world.gpus) if names else []))
        not_traced += [StrategyPlan(strategy=c.name, gpus=c.gpus, nodes=c.nodes, dp=c.dp, shard=c.shard,
                                    replicas=c.replicas, **field_degrees(c),
                                    points=[], curve=None, max_local_batch=0,
                                    capped=False, skipped=c.skipped) for c in listed if c.skipped]
    return by_world, not_traced


def _bounded_row(world: World, strategy, *, skipped: str, bound: float) -> StrategyPlan:
    """An auto candidate not traced because its bound cannot beat the best traced row (``plan/by_bound.py``)."""
    return StrategyPlan(**_row_base(world, strategy), points=[], curve=None, max_local_batch=0, capped=False,
                        skipped=skipped, bound_tokens_per_s=bound)


def _own_multiple(strategy, multiple_of: int) -> int:
    """A strategy's local batch step: whole pipeline micro-batches for pp<N>, ``multiple_of`` for the
    others, so the strategies asked together never change one's answer (a shared lcm made
    fsdp+tp2 beside pp2+fsdp search even sizes only)."""
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
        not_traced.append(StrategyPlan(**_row_base(world, s), points=[], curve=None, max_local_batch=0, capped=False,
                                       skipped=reason))
    return kept


def _refuse_or_set_aside(by_world: list, why: Callable[[object], str | None], skip: bool,
                         not_traced: list[StrategyPlan]) -> None:
    """Each strategy ``why`` has a reason against: a skipped row with ``skip`` (:func:`_set_aside`), else the
    first reason raised (one line, before any trace)."""
    for world, chosen in by_world:
        if skip:
            chosen[:] = _set_aside(world, chosen, why, not_traced)
        elif (reason := next(filter(None, map(why, chosen)), None)) is not None:
            raise OptionError(reason)


def _refuse_wide_shards(workload: Workload, by_world: list, skip: bool, not_traced: list[StrategyPlan]) -> None:
    """Before any trace: an FSDP2 shard group wider than the model's largest parameter
    (``plan/shard_limit.py``) stops a named strategy with one line, and is a skipped row with
    ``skip`` (auto, or the default strategies)."""
    from batchfit.plan.shard_limit import too_wide

    why = too_wide(workload, [s for _, chosen in by_world for s in chosen])
    _refuse_or_set_aside(by_world, why, skip, not_traced)


def _refuse_tp_losses(workload: Workload, options: StepOptions, by_world: list, skip: bool,
                      not_traced: list[StrategyPlan]) -> None:
    """Before any trace: a `loss` other than plain under a tensor-parallel plan batchfit ships (each records its
    loss on the model, which the step refuses: ``train/step.py``) stops a named strategy with one line, and is a
    skipped row with ``skip`` (auto). A model's own plan (``Workload.parallelize``) is left to its step."""
    from batchfit.train.losses import tp_loss_refusal

    if options.loss == "plain" or workload.parallelize is not None or workload.parallelize_all is not None:
        return

    def why(strategy) -> str | None:
        if strategy.tp == 1:
            return None
        reason = tp_loss_refusal(options.loss)
        return reason if skip else f"{strategy.name}: {reason}"  # a skipped row names its strategy itself

    _refuse_or_set_aside(by_world, why, skip, not_traced)


def _set_aside_too_large(workload: Workload, options: StepOptions, device: Device, by_world: list,
                         not_traced: list[StrategyPlan]) -> None:
    """Under auto, before any trace: each candidate whose parameters, gradients and optimizer state
    alone pass the usable memory (``plan/bound.py``) is a skipped row saying so, unless every one
    is (then they are traced, so that the rows say what would make local batch 1 fit)."""
    from batchfit.plan.bound import too_large

    why = too_large(workload, options, device)
    if all(why(s) is not None for _, chosen in by_world for s in chosen):
        return
    for world, chosen in by_world:
        chosen[:] = _set_aside(world, chosen, why, not_traced)


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
        raise OptionError(f"`offload` params is FSDP2's CPUOffloadPolicy, and {', '.join(other)} has no FSDP: "
                          "plan it with `strategies` fsdp (or hsdp<R>, fsdp+tp<N>), or use `offload` activations")
    return by_world


def _plan_one(open_session: Callable, workload: Workload, options: StepOptions, device: Device, world: World,
              strategy, time_model: TimeModel, say: Callable[[str], None], *, auto: bool,
              batch_sizes: list[int] | None, global_batch: int | None, multiple_of: int, max_batch: int,
              target_bytes: int, limit: str = "reserved", host_limit_bytes: int | None = None,
              derived: list[tuple[World, object]] = ()) -> tuple[list[StrategyPlan], int | None, int]:
    """One strategy on one GPU count, in one tracing session: its row and the rows ``derived`` from
    its traces (``plan/derived.py``: DDP on other GPU counts), the model's parameter count (None when
    ``auto`` skipped it: the model has no tensor-parallel plan) and the local batches traced."""
    shared, rows, params = None, [], None
    try:
        with contextlib.closing(open_session(workload, options, device, strategy)) as session:
            shared = SharedTraces(session, strategy)
            for row_world, row_strategy in [(world, strategy), *derived]:
                is_derived = row_strategy is not strategy
                label = f"{row_strategy.name} on {row_world.gpus} GPU{'s' if row_world.gpus > 1 else ''}" + (
                    f" (from the {world.gpus}-GPU trace)" if is_derived else "")
                if is_derived:
                    say(f"{label}: read from that trace's sizes")
                curve = ShardedCurve(shared.trace_for(row_strategy), device.workspace_bytes,
                                     lambda message, label=label: say(f"{label}: {message}"),
                                     replay=shared.reserved if shared.can_replay else None,
                                     replay_first=getattr(session, "replay_gives_point", False),
                                     known=shared.has if is_derived else None)
                trace_first_sizes(curve, batch_sizes, multiple_of, device.usable_bytes,
                                  larger_first=hasattr(session, "line"))
                plan_row = _plan_strategy(_row_base(row_world, row_strategy), curve, row_strategy, row_world,
                                          workload, device, options, time_model, global_batch=global_batch,
                                          multiple_of=multiple_of, max_batch=max_batch, target_bytes=target_bytes,
                                          limit=limit, host_limit_bytes=host_limit_bytes)
                plan_row.whole_reserved = list(getattr(session, "whole_reserved", []))
                line = getattr(session, "line", None)
                plan_row.reserved_written = line.summary() if line is not None and line.written else {}
                plan_row.replayed_only = [curve.replayed_only[b] for b in sorted(curve.replayed_only)]
                plan_row.pp_layers_per_stage = getattr(session, "layers_per_stage", 0)
                plan_row.derived_from_gpus = world.gpus if is_derived else 0
                plan_row.points = [curve.points[b] for b in sorted(curve.points)]
                plan_row.curve = curve.curve()
                rows.append(plan_row)
                params = curve.first.params
    except OptionError as error:
        if not auto or (shared is not None and shared.points):
            raise
        # auto tried a combination this model cannot run (no TP plan; a torchtitan job's parallelize_llama has
        # no ddp / zero / pp): a skipped row with the one-line reason, as the candidates' own rules give
        return [StrategyPlan(**_row_base(w, s), points=[], curve=None, max_local_batch=0, capped=False,
                             skipped=str(error)) for w, s in [(world, strategy), *derived]], None, 0
    return rows, params, len(shared.points)


def _row_base(world: World, strategy) -> dict:
    """A row's fields that come from its strategy and world."""
    return dict(strategy=strategy.name, gpus=world.gpus, nodes=world.nodes, dp=strategy.dp,
                shard=strategy.shard, replicas=getattr(strategy, "replicas", 1), **field_degrees(strategy),
                pp_schedule=getattr(strategy, "pp_schedule", ""), microbatches=getattr(strategy, "microbatches", 0))


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
        if found.max_batch_size in curve.replayed_only:  # replayed from a written stream: its step is traced
            curve.reserved(found.max_batch_size)         # for the time at the max local batch
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
                              plan_row.accumulation_steps, param_offload=options.offload_spec.params)
    at_max = curve.points.get(plan_row.max_local_batch)
    plan_row.time_at_max = at_max and step_time(at_max, strategy, world, device, options.precision, model,
                                                param_offload=options.offload_spec.params)
    if plan_row.time:
        plan_row.samples_per_s = plan_row.global_batch / plan_row.time.step_time_s
        if workload.tokens_per_sample:
            plan_row.tokens_per_s = plan_row.samples_per_s * workload.tokens_per_sample
    if plan_row.time_at_max and workload.tokens_per_sample:
        plan_row.tokens_per_s_at_max = (plan_row.max_global_batch * workload.tokens_per_sample
                                        / plan_row.time_at_max.step_time_s)
