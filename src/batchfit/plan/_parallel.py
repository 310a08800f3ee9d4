"""Apply a strategy to a model with PyTorch's own distributed code: DDP, FSDP2, HSDP, TP.

The same function wraps the model of a real multi-process run (gloo on CPU, in the tests)
and of the traced rank 0 on the fake process group, so the trace is checked against the
code that really runs. The device mesh is built before anything is traced (a mesh made
under ``FakeTensorMode`` would hold a fake rank table).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from batchfit.errors import OptionError
from batchfit.train.step import block_list


@dataclass
class Meshes:
    """The device meshes of one strategy, and what each process group is called."""

    dp: object | None  # DeviceMesh over the data-parallel ranks (2-D for HSDP), None without one
    tp: object | None  # DeviceMesh over the tensor-parallel ranks, None without TP
    groups: dict[str, tuple[str, int]]  # process group name -> ("dp" | "tp", ranks in it)


def build_meshes(strategy, device_type: str = "cpu") -> Meshes:
    """The meshes of ``strategy`` over the default process group (one per rank, all ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    if strategy.tp > 1 and strategy.dp > 1:
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
    for label, mesh in (("dp", dp), ("tp", tp)):
        if mesh is not None:
            for group in mesh.get_all_groups():
                groups[group.group_name] = (label, group.size())
    if strategy.shard == "ddp":
        default = dist.distributed_c10d._get_default_group()
        groups[default.group_name] = ("dp", default.size())
    return Meshes(dp=dp, tp=tp, groups=groups)


def mixed_precision(precision: str):
    """FSDP2's policy for a mixed-precision step: gather low-precision parameters, reduce in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16-mixed":
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


# What DDP's rebuild uses by default: a small first bucket (its gradients are ready first),
# then 25 MiB buckets (dist._DEFAULT_FIRST_BUCKET_BYTES, nn.parallel.distributed._DEFAULT_BUCKET_CAP_MB).
_DDP_BUCKET_CAPS = [dist._DEFAULT_FIRST_BUCKET_BYTES / 2**20, 25]


class _BucketsAsBuilt:
    """DDP's reducer, except that it keeps the gradient buckets it was built with.

    DDP first puts every gradient in one bucket, and in the second step's forward rebuilds
    its buckets (1 MiB, then 25 MiB each) in the order gradients became ready in the first
    backward; the C++ rebuild reads an index tensor's values, which fake tensors do not
    have. The traced DDP is built with those caps from the start (``_DDP_BUCKET_CAPS``),
    over the parameters in reverse (DDP's own approximation of the ready order): the same
    gradients in buckets of the same sizes, so the steady step holds the same bucket bytes
    and calls about as many all-reduces. The rebuild's own moment, with the old and new
    buckets alive together, happens once in a real run (step 2), not in a steady step."""

    def __init__(self, reducer) -> None:
        object.__setattr__(self, "_reducer", reducer)

    def __getattr__(self, name: str):
        return getattr(self._reducer, name)

    def _rebuild_buckets(self) -> bool:
        return False


def apply_strategy(model: nn.Module, strategy, meshes: Meshes, *, precision: str, fake: bool,
                   parallelize: Callable | None = None,
                   on_bucket: Callable[[torch.Tensor], None] | None = None) -> nn.Module:
    """``model`` as rank 0 of ``strategy`` trains it: TP first (on the tp mesh), then the
    data-parallel wrap (DDP, or FSDP2 per block and at the root, as torchtitan does).

    ``parallelize`` is the TP plan (``tp_plans.tp_plan`` or the Workload's own); ``fake``
    says the model is on fake tensors and the process group is the fake one (DDP then gets
    a Python all-reduce hook, ``on_bucket`` sees each gradient bucket).
    """
    if strategy.tp > 1:
        if parallelize is None:
            raise OptionError(f"{strategy.name}: {type(model).__name__} has no tensor-parallel plan: give the "
                              "Workload a parallelize(model, mesh) function, or pick ddp / fsdp")
        model = parallelize(model, meshes.tp)
    if strategy.shard == "ddp":
        if fake:
            with _no_cross_rank_checks():
                ddp = nn.parallel.DistributedDataParallel(model, init_sync=False, bucket_cap_mb_list=_DDP_BUCKET_CAPS)
            ddp.register_comm_hook(None, _fake_allreduce_hook(on_bucket))
            ddp.reducer = _BucketsAsBuilt(ddp.reducer)
            return ddp
        return nn.parallel.DistributedDataParallel(model)
    if strategy.shard in ("fsdp", "fsdp-noreshard", "hsdp"):
        from torch.distributed.fsdp import fully_shard

        reshard = strategy.shard != "fsdp-noreshard"
        policy = mixed_precision(precision)
        # One FSDP group per block, so one block's parameters are gathered at a time; the
        # root group holds the rest (embeddings, final norm, head). The root keeps its own
        # gathered after forward (backward needs them at once), as FSDP2 does by default.
        for block in block_list(model) or ():
            fully_shard(block, mesh=meshes.dp, reshard_after_forward=reshard, mp_policy=policy)
        fully_shard(model, mesh=meshes.dp, reshard_after_forward=reshard if reshard is False else None,
                    mp_policy=policy)
    return model
