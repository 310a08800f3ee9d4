"""Apply a strategy to a model with PyTorch's own distributed code: DDP, FSDP2, HSDP, TP.

One copy, used by every engine that wraps a model: ``plan`` wraps rank 0 of each strategy
on the fake process group (fake tensors, any world size, one process); ``probe`` under
torchrun and the tests' gloo runs wrap the real model of each rank. So the traced wrap is the
code that really runs, mixed-precision policy included.

    ddp          DistributedDataParallel: every rank keeps the whole model; gradients are
                 all-reduced in buckets during backward (the buckets are memory too)
    fsdp         FSDP2 ``fully_shard`` on each block of every stack of repeated blocks (encoder
                 and decoder both) and at the root,
                 as torchtitan does: each rank keeps 1/N of the parameters, gradients and
                 optimizer state, and all-gathers one block at a time
    fsdp-noreshard  FSDP2 with ``reshard_after_forward=False``: a block's gathered parameters
                 stay from its forward to its backward (ZeRO-2-like while they are gathered;
                 sharded at rest, between steps)
    zero1        DDP + ZeroRedundancyOptimizer: optimizer state sharded, parameters and
                 gradients replicated (``distributed/zero.py``)
    zero2        ZeroRedundancyOptimizer with each gradient reduced to the rank that owns it:
                 optimizer state and gradients sharded, parameters replicated
    hsdp         FSDP2 sharded within groups, replicated across them (a 2-D mesh)
    tp           tensor parallelism (DTensor) on the tp mesh, before any data-parallel wrap

The device meshes are built before anything is traced (a mesh made under ``FakeTensorMode``
would hold a fake rank table). Importing this module does not import torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchfit.distributed.strategy_name import Strategy
from batchfit.errors import OptionError
from batchfit.options import Routing

if TYPE_CHECKING:
    import torch
    from torch import nn


def data_parallel(shard: str, world_size: int) -> Strategy:
    """DDP or FSDP2 ("ddp", "fsdp") over all ``world_size`` ranks, no tensor parallelism: what
    ``probe`` wraps under torchrun."""
    return Strategy(shard, world_size, world_size, 1, shard)


@dataclass
class Meshes:
    """The device meshes of one strategy, and what each process group is called."""

    dp: object | None  # DeviceMesh over the data-parallel ranks (2-D for HSDP), None without one
    tp: object | None  # DeviceMesh over the tensor-parallel ranks, None without TP
    groups: dict[str, tuple[str, int]]  # process group name -> ("dp" | "tp" | "cp" | "ep", ranks in it)
    cp: object | None = None  # DeviceMesh over the context-parallel ranks (the ring), None without CP
    ring_groups: frozenset[str] = frozenset()  # the cp mesh's group names (one may be FSDP2's too, at dp 1)
    ep: object | None = None  # DeviceMesh over the expert-parallel ranks (ep<N>), None without EP
    dp_mod_ep: object | None = None  # the data-parallel ranks holding the same experts: FSDP of the experts


def build_meshes(strategy: Strategy, device_type: str = "cpu") -> Meshes:
    """The meshes of ``strategy`` over the default process group (one per rank, all ranks).
    A 1-D mesh over the whole world reuses the default group (no new communicator)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if strategy.cp > 1:
        return _cp_meshes(strategy, device_type)
    ep = dp_mod_ep = None
    if strategy.ep > 1 and strategy.tp > 1:
        dp, tp, ep, dp_mod_ep = _ep_tp_meshes(strategy, device_type)
    elif strategy.ep > 1:  # torchtitan's ParallelDims: dp_shard = dp_shard_mod_ep x dp_shard_in_ep, ep inside
        mesh = init_device_mesh(device_type, (strategy.dp // strategy.ep, strategy.ep),
                                mesh_dim_names=("dp_mod_ep", "ep"))
        dp, ep, dp_mod_ep = mesh["dp_mod_ep", "ep"]._flatten("dp"), mesh["ep"], mesh["dp_mod_ep"]
        tp = None
    elif strategy.tp > 1 and strategy.dp > 1:
        mesh = init_device_mesh(device_type, (strategy.dp, strategy.tp), mesh_dim_names=("dp", "tp"))
        dp, tp = mesh["dp"], mesh["tp"]
    elif strategy.tp > 1:
        dp, tp = None, init_device_mesh(device_type, (strategy.tp,), mesh_dim_names=("tp",))
        if strategy.shard in ("fsdp", "fsdp-noreshard"):  # fsdp+tpN on N GPUs: FSDP over one rank
            mesh = init_device_mesh(device_type, (1, strategy.tp), mesh_dim_names=("dp", "tp"))
            dp, tp = mesh["dp"], mesh["tp"]
    elif strategy.shard == "hsdp":
        dp, tp = init_device_mesh(device_type, (strategy.replicas, strategy.world_size // strategy.replicas),
                                  mesh_dim_names=("replicate", "shard")), None
    elif strategy.shard != "none":
        dp, tp = init_device_mesh(device_type, (strategy.world_size,), mesh_dim_names=("dp",)), None
    else:
        dp = tp = None
    groups: dict[str, tuple[str, int]] = {}
    # ep before dp: where ep spans the whole data-parallel dimension (ep8 on 8 GPUs) its group is dp's,
    # labelled dp; the all-to-alls are told apart by their op (plan/sharded.py)
    for label, mesh in (("ep", ep), ("dp", dp), ("dp", dp_mod_ep), ("tp", tp)):
        if mesh is not None:
            for group in mesh.get_all_groups():
                groups[group.group_name] = (label, group.size())
    if strategy.shard in ("ddp", "zero1", "zero2"):  # DDP and ZeroRedundancyOptimizer use the default group
        default = dist.distributed_c10d._get_default_group()
        groups[default.group_name] = ("dp", default.size())
    return Meshes(dp=dp, tp=tp, groups=groups, ep=ep, dp_mod_ep=dp_mod_ep)


def _ep_tp_meshes(strategy: Strategy, device_type: str) -> tuple:
    """(dp, tp, ep, dp_mod_ep) of ep<N> with tp<M>, as torchtitan's ``ParallelDims.build_mesh`` unflattens
    one world mesh twice: the dense mesh (dp, tp), tp innermost, for TP and the FSDP2 of everything but
    the experts; the sparse mesh (efsdp, ep, etp=1), ep innermost, for the experts: ep consecutive ranks
    (its tp groups' ranks among them: torchtitan's default etp=1 borrows every TP rank) split the experts,
    and the dp x tp / ep ranks holding the same ones (efsdp) shard them with FSDP2. Both come from one
    root, as FSDP2 wants of a DTensor's mesh and its own."""
    from torch.distributed.device_mesh import init_device_mesh

    world = init_device_mesh(device_type, (strategy.world_size,), mesh_dim_names=("world",))
    dense = world._unflatten(0, (strategy.dp, strategy.tp), ("dp", "tp"))
    sparse = world._unflatten(0, (strategy.world_size // strategy.ep, strategy.ep), ("dp_mod_ep", "ep"))
    return dense["dp"], dense["tp"], sparse["ep"], sparse["dp_mod_ep"]


def _cp_meshes(strategy: Strategy, device_type: str) -> Meshes:
    """Context parallelism's meshes, as torchtitan's ``ParallelDims`` builds them
    (``distributed/parallel_dims.py``): one (dp, cp, tp) mesh, tp innermost; FSDP2 (or DDP) over
    dp x cp flattened (torchtitan's dp_shard_cp, its "fsdp" mesh: parameters are sharded over the
    cp ranks too, which hold the same parameters and see other tokens of the same samples), the
    ring over cp, TP over tp. A dimension of size 1 is kept (a group of one rank talks to nobody)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (strategy.dp, strategy.cp, strategy.tp), mesh_dim_names=("dp", "cp", "tp"))
    dp = mesh["dp", "cp"]._flatten("dp_cp") if strategy.shard != "none" else None
    cp, tp = mesh["cp"], mesh["tp"] if strategy.tp > 1 else None
    groups: dict[str, tuple[str, int]] = {}
    for label, sub in (("cp", cp), ("tp", tp), ("dp", dp)):  # at dp 1 the dp x cp group may be the ring's:
        if sub is not None:                                   # labelled dp, the ring's calls told by ring_groups
            for group in sub.get_all_groups():
                groups[group.group_name] = (label, group.size())
    return Meshes(dp=dp, tp=tp, groups=groups, cp=cp,
                  ring_groups=frozenset(group.group_name for group in cp.get_all_groups()))


def mixed_precision(precision: str):
    """FSDP2's policy for a mixed-precision step: gather low-precision parameters, reduce in fp32."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision in ("bf16-mixed", "fp8-tensorwise", "fp8-rowwise"):  # float8: torchtitan's bf16 policy
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision == "fp16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


@contextlib.contextmanager
def _no_cross_rank_checks() -> Iterator[None]:
    """DDP's constructor compares parameter shapes across ranks by reading tensor data in
    C++, which fake tensors do not have; on the fake process group there are no other ranks
    to compare with. The check is skipped while DDP is built, and nothing else."""
    import torch.nn.parallel.distributed as ddp_module

    check = ddp_module._verify_param_shape_across_processes
    ddp_module._verify_param_shape_across_processes = lambda *args, **kwargs: None
    try:
        yield
    finally:
        ddp_module._verify_param_shape_across_processes = check


def _fake_allreduce_hook(on_bucket: Callable[[torch.Tensor], None] | None):
    """DDP's default communication hook (divide by the world size, all-reduce in place), in
    Python: the fake process group's C++ future carries no tensor, which DDP's built-in hook
    needs. The same ops on the same bucket, so the same memory."""
    import torch
    import torch.distributed as dist

    def hook(group, bucket):
        tensor = bucket.buffer()
        if on_bucket is not None:
            on_bucket(tensor)
        tensor.div_(group.size() if group is not None else dist.get_world_size())
        dist.all_reduce(tensor, group=group)
        future = torch.futures.Future()
        future.set_result(tensor)
        return future

    return hook


def _ddp_bucket_caps_mb() -> list[float]:
    """What DDP's rebuild uses by default: a small first bucket (its gradients are ready
    first), then 25 MiB buckets (dist._DEFAULT_FIRST_BUCKET_BYTES, _DEFAULT_BUCKET_CAP_MB)."""
    import torch.distributed as dist

    return [dist._DEFAULT_FIRST_BUCKET_BYTES / 2**20, 25]


class _RebuildsOnce:
    """DDP's reducer, rebuilding its gradient buckets once as DDP does, without reading tensor values.

    DDP puts every gradient in one bucket for the first step (``_BucketCapacityConfig.
    compute_bucket_size_limits``: ``sys.maxsize`` unless static_graph or find_unused_parameters)
    and in the second step's forward (``DistributedDataParallel._pre_forward`` ->
    ``reducer._rebuild_buckets``) rebuilds them in the order gradients became ready: a 1 MiB
    bucket, then 25 MiB ones. ``Reducer::initialize_buckets`` (reducer.cpp) clears the old
    buckets (``buckets_.clear()``) before it allocates the new ones. The C++ rebuild first syncs
    the bucket indices across ranks (``sync_bucket_indices`` reads an index tensor's values,
    which fake tensors do not have), so here the old reducer is dropped (its buckets freed) and
    DDP's own ``_ddp_init_helper`` (as ``DistributedDataParallel.__setstate__`` uses it) builds a
    new one with those caps (``_ddp_bucket_caps_mb``) over the parameters in definition order,
    bucket list reversed (DDP's own approximation of the ready order; a real rebuild uses the
    order the first backward saw). The steady step then holds the same bucket bytes; the one
    big bucket of the first step and the rebuild itself are in the traced stream, where the
    allocator model sees them (``plan``'s ``peak_step``)."""

    def __init__(self, ddp, hook) -> None:
        object.__setattr__(self, "_ddp", ddp)
        object.__setattr__(self, "_hook", hook)
        object.__setattr__(self, "_reducer", ddp.reducer)
        object.__setattr__(self, "rebuilt_at", None)
        """(first event, last event) of the tracker's stream while the buckets were rebuilt."""
        object.__setattr__(self, "_forwards", 0)

    def __getattr__(self, name: str):
        return getattr(self._reducer, name)

    def _rebuild_buckets(self) -> bool:
        import torch.distributed as dist

        from batchfit.trace.memory import active_tracker

        object.__setattr__(self, "_forwards", self._forwards + 1)
        if self.rebuilt_at is not None or self._forwards < 2:  # the first forward: no ready order known yet
            return False  # (Reducer::rebuild_buckets returns false while rebuilt_params_ is empty)
        ddp = self._ddp
        tracker = active_tracker()
        start = len(tracker.events) if tracker is not None else 0
        parameters, expect_sparse = ddp._build_params_for_reducer()
        names = ddp._build_debug_param_to_name_mapping(parameters)
        object.__setattr__(self, "_reducer", None)
        ddp.reducer = ddp.logger = None  # the old reducer, and with it its buckets, is gone first
        ddp._bucket_config = type(ddp._bucket_config).create(None, _ddp_bucket_caps_mb(), False)
        ddp._ddp_init_helper(parameters, expect_sparse, names, ddp.static_graph)
        dist._register_comm_hook(ddp.reducer, None, self._hook)
        ddp.reducer.prepare_for_forward()  # what _pre_forward did to the old one before the rebuild
        object.__setattr__(self, "_reducer", ddp.reducer)
        ddp.reducer = self
        object.__setattr__(self, "rebuilt_at", (start, len(tracker.events) if tracker is not None else 0))
        return True


def _ddp(model: nn.Module, *, fake: bool, device: torch.device | None,
         on_bucket: Callable[[torch.Tensor], None] | None) -> nn.Module:
    from torch import nn

    if fake:
        with _no_cross_rank_checks():
            ddp = nn.parallel.DistributedDataParallel(model, init_sync=False)
        hook = _fake_allreduce_hook(on_bucket)
        ddp.register_comm_hook(None, hook)
        ddp.reducer = _RebuildsOnce(ddp, hook)
        return ddp
    # device_ids names the rank's own GPU (cuda:LOCAL_RANK); on the CPU (gloo) DDP wants None.
    device_ids = [device] if device is not None and device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


def _fully_shard_blocks(model: nn.Module, mesh, *, reshard: bool, precision: str,
                        cpu_offload: bool = False, experts_mesh=None) -> nn.Module:
    """FSDP2 on each block of every stack of repeated blocks (an encoder-decoder's both), then
    at the root (in place); with ``cpu_offload`` (``--offload params``) FSDP2's
    ``CPUOffloadPolicy(pin_memory=True)``: sharded parameters, their gradients and the
    optimizer state live in pinned host memory."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    from batchfit.train.model import block_lists

    policy = mixed_precision(precision)
    if precision == "fp8-tensorwise":  # torchtitan's enable_fsdp_float8_all_gather=True: one byte per element
        from batchfit.train.float8 import enable_float8_all_gather

        enable_float8_all_gather(model)
    # Pinned on a GPU, as torchtitan's and torchtune's FSDP2 CPU offload; a CPU has no pinned
    # allocator (a gloo run on CPU, the fake trace), and pinning changes no byte counts.
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if cpu_offload else OffloadPolicy()
    # One FSDP group per block, so one block's parameters are gathered at a time; the root
    # group holds the rest (embeddings, final norm, head) and any model without blocks. The
    # root keeps its own gathered after forward (backward needs them at once), FSDP2's default.
    if experts_mesh is not None:  # ep<N>: each rank's experts over the dp ranks holding the same ones
        from batchfit.distributed.expert_parallel import shard_experts

        shard_experts(model, experts_mesh, reshard_after_forward=reshard, mp_policy=policy, offload_policy=offload)
    for block in (block for stack in block_lists(model) for block in stack):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy, offload_policy=offload)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard if reshard is False else None, mp_policy=policy,
                offload_policy=offload)
    return model


def check_step_options(strategy: Strategy, options, model: nn.Module) -> None:
    """Refuse, in one line and before any trace, what ``strategy`` cannot run with ``options``
    (``batchfit.StepOptions``) on ``model`` (built on the meta device): each would fail inside the
    real step as it fails inside the trace."""
    from batchfit.train.quantize import BNB_OPTIMIZERS

    dtensors = strategy.tp > 1 or strategy.ep > 1 or strategy.shard in ("fsdp", "fsdp-noreshard", "hsdp")
    if dtensors and options.optimizer in BNB_OPTIMIZERS:
        raise OptionError(f"{strategy.name}: `optimizer` {options.optimizer} is bitsandbytes', whose step takes plain "
                          "tensors, not the DTensor shards of FSDP2 / TP / ep (bitsandbytes issues #89, #1633): use "
                          "ddp, zero1 or zero2, or `optimizer` adamw")
    if strategy.tp > 1 and options.precision_spec.fp8_recipe and type(model).__name__.startswith("GPT2"):
        # Its TP plan (distributed/tp_plans.py) turns GPT-2's Conv1D layers into nn.Linear after float8's
        # converter ran (which skips Conv1D), and the step's second preparation would convert those.
        raise OptionError(f"{strategy.name}: float8 on GPT-2 under tensor parallelism is not traced (its Conv1D layers "
                          "become linears only inside the TP plan, after float8's conversion): use `precision` "
                          "bf16-mixed, or ddp / fsdp")
    if (strategy.tp > 1 or strategy.cp > 1) and options.offload_spec.activations:
        # torchtune's / TRL's hooks copy each saved tensor into a plain host tensor (copy_), and under
        # TP or cp autograd saves DTensors: the copy fails in the real step as in the trace.
        raise OptionError(f"{strategy.name}: `offload` activations copies each saved tensor into a plain host tensor "
                          "(torchtune's OffloadActivations), and tensor / context parallelism saves DTensors: use "
                          "it with ddp / fsdp / hsdp, or use `checkpointing` instead")
    if strategy.cp > 1 and not _causal(model):
        raise OptionError(f"{strategy.name}: context parallelism's load-balanced ring attention is causal only, and "
                          f"{type(model).__name__} attends both ways: use fsdp / tp without cp<N>")


def _causal(model: nn.Module) -> bool:
    """Whether every attention of ``model`` is causal: a transformers model says so per module
    (``is_causal``) and in its config (encoder-decoders hold a bidirectional encoder)."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "is_encoder_decoder", False):
        return False
    return all(getattr(m, "is_causal", True) is not False for m in model.modules())


def apply_strategy(model: nn.Module, strategy: Strategy, meshes: Meshes, *, precision: str, fake: bool,
                   parallelize: Callable | None = None, on_bucket: Callable[[torch.Tensor], None] | None = None,
                   device: torch.device | None = None, cpu_offload: bool = False,
                   routing: Routing = Routing("balanced")) -> nn.Module:
    """``model`` as a rank of ``strategy`` trains it: expert parallelism first (ep<N>: the rank's
    experts only, tokens dispatched by all-to-all; under TP each tensor-parallel rank dispatches its
    1/tp of the tokens), TP next (on the tp mesh; an MoE model's plan leaves those experts alone), then
    the data-parallel wrap (DDP, or FSDP2 per block and at the root with the mixed-precision
    policy of ``precision``, as torchtitan does).

    ``parallelize`` is the TP plan (``plan.tp_plans.tp_plan`` or the Workload's own); ``fake``
    says the model is on fake tensors and the process group is the fake one (DDP then gets
    a Python all-reduce hook, ``on_bucket`` sees each gradient bucket); ``device`` is the
    rank's own device (a real DDP on CUDA names it); ``cpu_offload``: FSDP2's CPUOffloadPolicy
    (``--offload params``), FSDP strategies only; ``routing`` (--routing) gives the expert-parallel
    dispatch its token counts on fake tensors (a real run routes by the router's values).
    """
    if strategy.tp > 1 and precision == "fp8-tensorwise":
        raise OptionError(f"{strategy.name}: float8 tensorwise under tensor parallelism needs torchao's float8 TP "
                          "styles (Float8ColwiseParallel, torchtitan's), not traced yet: use ddp / fsdp strategies, "
                          "or `precision` fp8-rowwise (its TP collectives are bf16)")
    if cpu_offload and strategy.shard not in ("fsdp", "fsdp-noreshard", "hsdp"):
        raise OptionError(f"`offload` params is FSDP2's CPUOffloadPolicy: {strategy.name} has no FSDP; use "
                          "`strategies` fsdp (or hsdp<R>, fsdp+tp<N>), or `offload` activations")
    if strategy.tp > 1 and parallelize is None:
        from batchfit.distributed.tp_plans import no_plan_reason

        raise OptionError(f"{strategy.name}: {type(model).__name__} has no tensor-parallel plan "
                          f"({no_plan_reason(model)}): give the Workload a parallelize(model, mesh) function, "
                          "or pick ddp / fsdp")
    if strategy.ep > 1:  # before TP: the MoE TP plan leaves the expert-parallel experts to their own mesh
        from batchfit.distributed.expert_parallel import apply_expert_parallel

        model = apply_expert_parallel(model, meshes.ep, routing=routing, name=strategy.name, token_mesh=meshes.tp)
    if strategy.tp > 1:
        model = parallelize(model, meshes.tp)
    if strategy.shard in ("ddp", "zero1"):  # zero1's optimizer: distributed/zero.py, when the step builds it
        return _ddp(model, fake=fake, device=device, on_bucket=on_bucket)
    if strategy.shard in ("fsdp", "fsdp-noreshard", "hsdp"):
        return _fully_shard_blocks(model, meshes.dp, reshard=strategy.shard != "fsdp-noreshard", precision=precision,
                                   cpu_offload=cpu_offload, experts_mesh=meshes.dp_mod_ep if strategy.ep > 1 else None)
    return model
