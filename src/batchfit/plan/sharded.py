"""Rank 0 of a multi-GPU step, traced on one CPU: PyTorch's own DDP / FSDP2 / TP on a fake process group.

``torch.distributed``'s "fake" backend answers every collective at once without moving data,
for any world size, in one process. With it the model is wrapped exactly as a real run wraps
it (``batchfit.distributed.apply_strategy``: DDP with its gradient buckets, FSDP2 ``fully_shard`` per
block and at the root, HSDP on a 2-D mesh, DTensor tensor parallelism, FSDP + TP on a 2-D
mesh), the step runs on fake tensors, and what rank 0 holds is counted by the tracer of
``estimate`` plus what sharding adds (``_tracker.ShardedTracker``: FSDP2's storage resizes,
DTensor shards, collective buffers, every collective call, FLOPs per rank).

Strategy names (``ddp``, ``fsdp+tp2``, ``pp2+ep4+fsdp+tp2``, ...) are parsed once, in
``distributed/strategy_name.py``, into typed degrees; this module lists them (``auto``) and traces them.

On one GPU every strategy is the plain single-GPU step (``shard`` "none").
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from dataclasses import dataclass

from batchfit.distributed import parallelisms
from batchfit.distributed.strategy import Strategy
from batchfit.distributed.strategy_name import NAMES_HELP, SHARDS, parse_strategy  # noqa: F401 - plan's names
from batchfit.errors import OptionError
from batchfit.plan.fake_world import fake_world, meshes_of


def parse_strategies(text: str, world_size: int, *, pp_schedule: str = "1f1b", microbatches: int = 0) -> list[Strategy]:
    """'ddp,fsdp,fsdp+tp2' or 'auto' (``plan/candidates.py``'s combinations for any model: no pp).
    Raises OptionError with one line saying what to type instead for an unknown name or a
    degree that does not divide ``world_size`` (e.g. 'tp3' on 4 GPUs)."""
    names = [n for n in text.split(",") if n.strip()]
    if not names:
        raise OptionError(f"no strategy given: use {NAMES_HELP}")
    if [n.strip().lower() for n in names] == ["auto"]:  # no model here: plan() asks plan/candidates.py with one
        from batchfit.plan.candidates import ModelFacts, candidates
        from batchfit.plan.world import DEFAULT_GPUS_PER_NODE, World

        nodes = world_size // DEFAULT_GPUS_PER_NODE if world_size % DEFAULT_GPUS_PER_NODE == 0 else 1
        listed = candidates(World(world_size, max(nodes, 1)), ModelFacts(name="the model", tp_plan=True))
        names = [c.name for c in listed if c.skipped is None]  # pp needs the model's layers: not listed
    strategies: list[Strategy] = []
    for name in names:
        if name.strip().lower() == "auto":
            raise OptionError("'auto' stands alone: `strategies` auto, or a list such as ddp,fsdp")
        strategy = parse_strategy(name, world_size, pp_schedule=pp_schedule, microbatches=microbatches)
        if strategy not in strategies:
            strategies.append(strategy)
    return strategies


@dataclass(frozen=True)
class Collective:
    op: str
    """"all_gather", "reduce_scatter", "all_reduce", "reduce", "broadcast", "all_to_all"."""
    group: str
    """"dp", or a parallelism's own label (``Parallelism.group``: "tp", "cp" for the ring's K/V all-gathered and
    dK/dV passed on, "ep" for the experts' all-to-alls)."""
    group_size: int
    """Ranks in the group."""
    bytes: int
    """Payload bytes of the full (unsharded) tensor the collective produces / reduces, per call."""
    phase: str
    """The batchfit.phases name in which it was called (forward, backward, optimizer, ...)."""


@dataclass(frozen=True)
class ShardedPoint:
    strategy: Strategy
    local_batch: int
    peak_bytes: int
    """Rank 0's peak allocated bytes of one steady-state step (CUDA 512-byte rounding), with the
    cuBLAS workspace as ``estimate`` counts it (``breakdown['workspace']``)."""
    breakdown: dict[str, int]
    """Bytes by category at the peak: parameters, gradients, optimizer_state, activations,
    temporaries, inputs, generation, collective, other, workspace."""
    flops: int
    """FLOPs rank 0 executes in one step (torch.utils.flop_counter's formulas on its shards)."""
    collectives: tuple[Collective, ...]
    """Every collective rank 0 called in one step, in order."""
    params: int
    """Parameters of the whole (unsharded) model."""
    params_per_rank: int
    """Parameter elements rank 0 holds."""
    phase: str = ""
    """The phase of the step in which the peak is reached."""
    peak_by_phase: dict[str, int] = dataclasses.field(default_factory=dict)
    """Each phase's own peak (workspace included): with ``breakdown_by_phase``, what
    ``trace.depth.extrapolate`` needs to extrapolate traces of a model cut to 1, 2, 3 blocks."""
    breakdown_by_phase: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    """The breakdown at each phase's own peak."""
    peak_by_part: dict[str, int] = dataclasses.field(default_factory=dict)
    """Each phase's peak by part ('backward:last'; ``trace.memory.PARTS``), for ``trace.depth``."""
    breakdown_by_part: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    tp_loss: str | None = None
    """Under TP, the loss the plan built: "sharded" (logits split by the vocabulary, loss_parallel),
    "gathered" (the whole logits on every rank) or "replicated" (the plan leaves the head whole);
    None without TP."""
    host_peak_bytes: int = 0
    """Rank 0's most host bytes at once for --offload (pinned, power-of-two rounded)."""
    host_reserved_bytes: int = 0
    """Pinned host memory rank 0's host allocator holds (its cache): what --host-memory checks."""
    offloaded_bytes: int = 0
    """Bytes rank 0's activation offload copied to the host in the step (and back)."""
    total_peak_bytes: int = 0
    """Rank 0's most device + host bytes at once, no workspace: what a CPU rank holds (the gloo truth)."""
    stage_peak_bytes: tuple[int, ...] = ()
    """Under pp<N> (``plan/pipeline.py``): each pipeline rank's peak, rank 0 first; the point is the largest's."""


def _to_empty_keeping_ties(model):
    """``model.to_empty(device="cpu")`` under the fake mode, with tied parameters still tied.

    ``Module.to_empty`` replaces a meta parameter by a new Parameter when the new tensor's
    type differs (a FakeTensor does), module by module, so a parameter two modules share
    (GPT-2's embedding and head) would become two: each module gets back the first one."""
    owners = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, name))
    model.to_empty(device="cpu")
    for places in owners.values():
        first_module, first_name = places[0]
        shared = first_module._parameters[first_name]
        for module, name in places[1:]:
            if module._parameters[name] is not shared:
                module._parameters[name] = shared
    return model


def _unpinned(model):
    """FSDP2's CPU offload without ``pin_memory()``: a fake tensor cannot be pinned (no fake
    kernel for aten._pin_memory). The bytes are the same; the tracker rounds host blocks as the
    pinned allocator does."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        for fsdp_param in group.fsdp_params if group is not None else ():
            fsdp_param.pin_memory = False
    return model


def _count_cpu_offload(model, tracker) -> None:
    """FSDP2's CPUOffloadPolicy on the tracker's accounts: each sharded parameter lives on the
    host, and so does its gradient once FSDP2 has copied it there after the reduce-scatter (it
    calls the parameter's post-accumulate-grad hooks then). On this CPU ``.to("cpu")`` copies
    nothing, so the trace moves them between accounts; the optimizer step's state and temporaries,
    made from host tensors, count on the host by themselves (``MemoryTracker._made_from_host``)."""
    for param in model.parameters():
        tracker.move_to_host(param)
        param.register_post_accumulate_grad_hook(lambda p: tracker.move_to_host(p.grad))


def _local_elements(tensor) -> int:
    return getattr(tensor, "_local_tensor", tensor).numel()


class ShardedSession:
    """Rank 0 of ``strategy`` on a fake process group (one CPU process, fake tensors), built
    once and traced at one local batch after another, as ``estimate``'s session is.

    workload: batchfit.Workload; options: batchfit.StepOptions; device: batchfit.Device (its
    cuBLAS workspace is added, as in ``estimate``). ``cuda_semantics=False`` traces what a CPU
    step does instead (no rounding, CPU kernels), to compare with a real gloo run, and with
    ``gloo_scratch`` the copies gloo's reduce-scatter makes (``ShardedTracker._gloo_scratch``); ``rank``
    traces that rank instead of rank 0 (a truth compared rank by rank; ``plan`` traces rank 0).
    Raises OptionError('... has no tensor-parallel plan: ...') for TP on a model without one.
    """

    def __init__(self, workload, options, device, strategy: Strategy, *, cuda_semantics: bool = True,
                 rank: int = 0, gloo_scratch: bool = False) -> None:
        import torch

        from batchfit.distributed import apply_strategy
        from batchfit.distributed.strategy import check_step_options
        from batchfit.distributed.tracker import ShardedTracker
        from batchfit.trace.compiled import sharded_traces_compiled
        from batchfit.trace.memory import CUDA_BLOCK_BYTES
        from batchfit.trace.session import TraceSession
        from batchfit.train.losses import tp_loss_of
        from batchfit.train.step import TrainingStep

        self.strategy = strategy
        self.fake_meshes = [p.fake_mesh() for p in parallelisms.registered()
                            if p.fake_mesh is not None and p.used_by(strategy)]
        """The code of each parallelism ``strategy`` uses that runs around its step (``Parallelism.fake_mesh``)."""
        self.workspace = device.workspace_bytes if cuda_semantics else 0
        own_plan = workload.parallelize
        self._exit = contextlib.ExitStack()
        self._exit.enter_context(fake_world(strategy.world_size, rank))
        try:
            self.meshes = meshes = meshes_of(strategy)  # outside FakeTensorMode: the mesh holds rank tables
            self.tracker = tracker = ShardedTracker(round_bytes=CUDA_BLOCK_BYTES if cuda_semantics else 1)
            tracker.gloo_scratch = gloo_scratch and not cuda_semantics
            tracker.trace_compiled = sharded_traces_compiled(strategy, options)  # read by TraceSession

            def shipped_plan(model, options):  # tp's (distributed/tp_plans.py), through its registry entry
                return next((plan for own in self.fake_meshes if (plan := own.parallelize(model, options))), None)

            def shard(model):
                if hasattr(model, "stage_indices"):  # a pipeline rank's stages: each wrapped as its own root
                    for i, stage in enumerate(model.stages):
                        model.stages[i] = shard(stage)
                    return model
                check_step_options(strategy, options, model)  # before the model is wrapped, so before any trace
                if workload.parallelize_all is not None:  # the model's own (torchtitan's parallelize_llama)
                    return workload.parallelize_all(model, strategy, meshes.groups)
                return _unpinned(apply_strategy(model, strategy, meshes, precision=options.precision, fake=True,
                                                cpu_offload=options.offload_spec.params, routing=options.routing_spec,
                                                parallelize=own_plan or shipped_plan(model, options),
                                                on_bucket=tracker.mark_collective))

            # TP and FSDP2 are applied to the model built on the meta device, outside FakeTensorMode
            # (they build sub-meshes, which read rank tables), after the step's own preparation
            # (precision, freezing, checkpointing): a TrainingStep on "meta" does exactly that.
            # Its parameters get (fake) memory by to_empty inside the trace. DDP wraps a model
            # that has memory, so it comes after, inside the trace.
            ddp = strategy.shard in ("ddp", "zero1")
            prepared = TrainingStep(workload, options, torch.device("meta"), wrap=None if ddp else shard).model
            # DTensors count their global size; a parallelism's parameters on no rank-0 tensor (ep's experts) added
            self.params = sum(p.numel() for p in prepared.parameters()) + sum(
                own.params_elsewhere(prepared) for own in self.fake_meshes)
            built = dataclasses.replace(workload, build_model=lambda: _to_empty_keeping_ties(prepared))
            for own in self.fake_meshes:  # cp: the sequence sharded, attention by torch's ring
                built = own.workload(built, strategy, meshes, cpu=not cuda_semantics, enter=self._exit.enter_context)
            prepared_options = dataclasses.replace(options, checkpointing="none")  # done on meta already
            for own in self.fake_meshes:  # zero1 / zero2: a ZeroRedundancyOptimizer (built inside the trace)
                built, prepared_options = own.optimizer(built, prepared_options, strategy)
            self.session = self._exit.enter_context(TraceSession(
                built, prepared_options, cuda_semantics=cuda_semantics, wrap=shard if ddp else None, tracker=tracker))
            self.params_per_rank = sum(_local_elements(p) for p in self.session.step.model.parameters())
            self.fresh_stream: list[tuple[str, int, int]] | None = None
            """Rank 0's allocation stream of a fresh process: the first trace's."""
            self.fresh_streams: dict[int, int] = {}
            """The side stream of each malloc of :attr:`fresh_stream` made on one (FSDP2's
            all-gather and reduce-scatter buffers; ``MemoryTracker.streams``)."""
            self.fresh_steps: tuple[int, ...] | None = None
            """Where the first and the second step start in :attr:`fresh_stream` (the build before
            them), and under DDP where its bucket rebuild (at the start of the second step's forward) ends."""
            self.tp_loss = tp_loss_of(prepared) if strategy.tp > 1 else None
            if options.offload_spec.params:
                _count_cpu_offload(self.session.step.model, tracker)
        except BaseException:
            self._exit.close()
            raise

    def trace(self, local_batch: int) -> ShardedPoint:
        """One steady-state step at ``local_batch`` (the first also runs the warm-up step).

        The first trace runs as a fresh process does: :attr:`fresh_stream` is then rank 0's
        allocation stream from the model's build to the end of the second step, and
        :attr:`fresh_steps` where each step starts in it. (A later trace cannot be fresh: DDP
        rebuilt its buckets once, and FSDP2 initialised itself, in the first one.)"""
        if local_batch < 1:
            raise OptionError(f"the local batch must be 1 or more, got {local_batch}")
        session, tracker, strategy = self.session, self.tracker, self.strategy
        first = not session._warm
        with warnings.catch_warnings():
            # FSDP2 warns that a module returned a view; the step never writes into the output.
            warnings.filterwarnings("ignore", message=".*returned a view tensor")
            snapshot = session.trace(local_batch).snapshot
        if first:
            for own in self.fake_meshes:  # cp: no attention through the ring
                own.check(strategy, self.meshes, tracker.calls)
            self.fresh_stream = list(tracker.events)
            self.fresh_streams = dict(tracker.streams)
            rebuilt = getattr(getattr(session.step.model, "reducer", None), "rebuilt_at", None)
            self.fresh_steps = (session.build_events, tracker.window_event) + ((rebuilt[1],) if rebuilt else ())
        workspace = self.workspace
        collectives = []
        for call in self.tracker.calls:  # a parallelism's own label (cp's ring, ep's all-to-alls), else the mesh's
            group, size = next((label for own in self.fake_meshes if (label := own.label(call, strategy, self.meshes))),
                               self.meshes.groups.get(call.group_name, ("dp", strategy.dp)))
            collectives.append(Collective(call.op, group, size, call.bytes, call.phase))
        return ShardedPoint(
            strategy=strategy, local_batch=local_batch, peak_bytes=snapshot.peak_bytes + workspace,
            breakdown={**snapshot.breakdown, "workspace": workspace}, flops=self.tracker.flops,
            collectives=tuple(collectives), params=self.params,
            params_per_rank=self.params_per_rank, phase=snapshot.phase,
            peak_by_phase={k: v + workspace for k, v in snapshot.peak_by_phase.items()},
            breakdown_by_phase={k: {**v, "workspace": workspace} for k, v in snapshot.breakdown_by_phase.items()},
            peak_by_part={k: v + workspace for k, v in snapshot.peak_by_part.items()},
            breakdown_by_part={k: {**v, "workspace": workspace} for k, v in snapshot.breakdown_by_part.items()},
            tp_loss=self.tp_loss,
            host_peak_bytes=snapshot.host_peak_bytes, host_reserved_bytes=snapshot.host_reserved_bytes,
            offloaded_bytes=snapshot.offloaded_bytes, total_peak_bytes=snapshot.total_peak_bytes,
        )

    def close(self) -> None:
        self._exit.close()

    def __enter__(self) -> ShardedSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def trace_sharded(workload, options, device, strategy: Strategy, local_batch: int, *,
                  cuda_semantics: bool = True, rank: int = 0, gloo_scratch: bool = False) -> ShardedPoint:
    """Rank 0's (or ``rank``'s) step at one local batch: a :class:`ShardedSession` traced once."""
    if local_batch < 1:
        raise OptionError(f"the local batch must be 1 or more, got {local_batch}")
    with ShardedSession(workload, options, device, strategy, cuda_semantics=cuda_semantics, rank=rank,
                        gloo_scratch=gloo_scratch) as session:
        return session.trace(local_batch)
