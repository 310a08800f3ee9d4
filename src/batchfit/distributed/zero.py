"""ZeRO stages 1 and 2 over replicated parameters, with PyTorch's own ``ZeroRedundancyOptimizer``.

    zero1  DDP (every rank keeps every parameter and gradient; gradients all-reduced in
           DDP's buckets) + ``torch.distributed.optim.ZeroRedundancyOptimizer``: each rank
           keeps the optimizer state of its partition of the parameters only, steps it, and
           broadcasts the updated parameters to the others (``ZeroRedundancyOptimizer.step``
           -> ``_sync_params``). This is ZeRO stage 1 as PyTorch ships it.
    zero2  ZeroRedundancyOptimizer's partition and step, and the gradients sharded too: as each
           parameter's gradient is accumulated in backward, it is reduced to the rank that
           owns the parameter (``dist.reduce``) and dropped everywhere else
           (``Tensor.register_post_accumulate_grad_hook``). Each rank then keeps all the
           parameters, and only its partition's gradients and optimizer state: the memory of
           DeepSpeed ZeRO stage 2 (``deepspeed/runtime/zero/stage_1_and_2.py``), without its
           flat buffers (below).

PyTorch has no ZeRO-2 over replicated parameters of its own: DDP's reducer keeps a bucket for
every gradient for the whole run (a reduce-scatter comm hook cannot free it), and FSDP's
"ZeRO-2" (FSDP1 ``SHARD_GRAD_OP``, FSDP2 ``reshard_after_forward=False``: batchfit's
``fsdp-noreshard``) shards the parameters at rest. So zero2 is ZeroRedundancyOptimizer plus
the per-parameter reduce above, torch's own calls, run the same way on the fake process group
(``plan``) and in the tests' real gloo runs.

What zero2 leaves out of DeepSpeed's stage 2: the partition is by whole parameters
(ZeroRedundancyOptimizer's greedy largest-first split), not a flat 1/N slice, so a rank's
share can exceed 1/N on a model with few large tensors; DeepSpeed's fp32 master copy of a
bf16 model's partition, its flat gradient partition buffer and its reduce bucket
(``reduce_bucket_size``, 5e8 elements by default when ``contiguous_gradients``) are not
allocated (batchfit's bf16-mixed keeps fp32 parameters; its bf16 has no master copy).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING, Protocol

from batchfit.errors import OptionError

if TYPE_CHECKING:
    import torch

    from batchfit.workload import StepOptions, Workload

ZERO_SHARDS = ("zero1", "zero2")


class _Wrapped(Protocol):
    """What :func:`with_sharded_optimizer` reads of a ``Strategy`` (not imported: strategy_name.py reads the
    registry, ``parallelisms.py``, that imports this module)."""

    shard: str


def zero_optimizer(inner: torch.optim.Optimizer, *, shard_gradients: bool, model: torch.nn.Module | None = None):
    """``inner``'s class, hyper-parameters and parameter groups, as a ZeroRedundancyOptimizer over
    the default process group (built before ``inner`` made any state). ``shard_gradients``
    (zero2) reduces each gradient to its owner as backward accumulates it, and drops it elsewhere.
    ``model`` names the parameters in the error about their dtypes."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    cls = type(inner)
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in inner.defaults.items() if k in accepted}  # AdamW's defaults name more
    groups = [{**group, "params": list(group["params"])} for group in inner.param_groups]
    _require_one_dtype([p for g in groups for p in g["params"]], "zero2" if shard_gradients else "zero1", model)
    try:
        zero = ZeroRedundancyOptimizer(groups, optimizer_class=cls, **defaults)
    except (TypeError, ValueError) as error:
        raise OptionError(f"ZeroRedundancyOptimizer builds each rank's optimizer as {cls.__name__}(param groups, "
                          "**defaults), which failed "
                          f"({str(error).splitlines()[0] if str(error) else type(error).__name__}): "
                          "pick `optimizer` adamw, or ddp / fsdp for this optimizer") from None
    # The rank's state lives in its local optimizer; ZeroRedundancyOptimizer's own .state stays
    # empty. batchfit labels optimizer state (and clears it for a fresh trace) through .state.
    zero.state = zero.optim.state
    if shard_gradients:
        world = dist.get_world_size(zero.process_group)
        owners = {param: dist.get_global_rank(zero.process_group, rank) for param, rank in zero._param_to_rank.items()}
        me = dist.get_rank()
        for param, owner in owners.items():
            param.register_hook(_keep_the_mean(param, world))
            param.register_post_accumulate_grad_hook(_reduce_to_owner(owner, me, world, zero.process_group))
    return zero


def _require_one_dtype(params: list[torch.Tensor], name: str, model: torch.nn.Module | None) -> None:
    """ZeroRedundancyOptimizer takes parameters of one dense type only: it refuses the rest in its
    constructor (``_verify_same_dense_param_type``: "only supports using the same dense type for
    all parameters"), with no bucket per dtype. A model that trains two dtypes (nanochat keeps its
    embedding in bf16 beside fp32 weights) cannot run zero1 / zero2 in torch: say so, and why."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in params:
        by_dtype.setdefault(param.dtype, []).append(param)
    if len(by_dtype) < 2:
        return
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    parts = []
    for dtype, group in sorted(by_dtype.items(), key=lambda item: -len(item[1])):
        example = names.get(id(group[0]))
        parts.append(f"{str(dtype).removeprefix('torch.')} ({len(group)} tensor{'s' * (len(group) > 1)}"
                     f"{f', e.g. {example!r}' if example else ''})")
    raise OptionError(f"{name} runs torch's ZeroRedundancyOptimizer, which takes trainable parameters of one dtype "
                      f"only (it raises 'only supports using the same dense type for all parameters'), and this "
                      f"model trains {' and '.join(parts)}: use `precision` bf16 (every parameter in bf16), "
                      "freeze the odd ones (`frozen`), or plan ddp / fsdp")


def _keep_the_mean(param: torch.Tensor, world: int):
    """Before a micro-batch's gradient is accumulated: an owner's ``.grad`` holds the mean of the
    earlier micro-batches, which the reduce below divides by ``world`` again; scale it back up
    in place (no new memory). Nothing to do on the first micro-batch."""

    def hook(grad):
        if param.grad is not None:
            param.grad.mul_(world)
        return grad

    return hook


def _reduce_to_owner(owner: int, me: int, world: int, group):
    """After ``param.grad`` is accumulated: divide it by the world size, sum it on its owner
    (the mean over the ranks, as DDP's all-reduce leaves it), free it on every other rank."""
    import torch.distributed as dist

    def hook(param):
        if param.grad is None:  # nothing to reduce: seen on T5, whose encoder, decoder and head share one
            return              # embedding (why its hook fires with no gradient is not traced down)
        param.grad.div_(world)
        dist.reduce(param.grad, dst=owner, group=group)
        if me != owner:
            param.grad = None

    return hook


def with_sharded_optimizer(workload: Workload, options: StepOptions,
                           strategy: _Wrapped) -> tuple[Workload, StepOptions]:
    """``workload`` and ``options`` whose training step builds its optimizer (``--optimizer`` or
    the workload's own) wrapped as ``strategy`` needs it: a ZeroRedundancyOptimizer for zero1 /
    zero2, unchanged otherwise. The same for the traced rank (``plan``) and real gloo ranks."""
    if strategy.shard not in ZERO_SHARDS:
        return workload, options
    from batchfit.train.model import build_optimizer

    name, own, build_model = options.optimizer, workload.build_optimizer, workload.build_model
    shard_gradients = strategy.shard == "zero2"
    built: list = []  # the model the step built: --optimizer muon splits its parameters by module

    def build_and_keep():
        built.append(build_model())
        return built[-1]

    def build(params):
        inner = build_optimizer(name, params, built[-1] if built else None) if name else own(params)
        return zero_optimizer(inner, shard_gradients=shard_gradients, model=built[-1] if built else None)

    return (dataclasses.replace(workload, build_model=build_and_keep, build_optimizer=build),
            dataclasses.replace(options, optimizer=None))


def zero_approximations(strategies) -> list:
    """What a plan with zero1 / zero2 among ``strategies`` says in every output: it traced
    torch's ZeroRedundancyOptimizer, and the config it emits for them runs DeepSpeed (no torch here)."""
    from batchfit.trace.approximation import Approximation

    names = sorted({s.name for s in strategies if getattr(s, "shard", None) in ZERO_SHARDS})
    if not names:
        return []
    return [Approximation(
        what=f"{' and '.join(names)} traced as torch's ZeroRedundancyOptimizer (zero2: each gradient reduced to "
             "its owner), partitioned by whole tensors; DeepSpeed's ZeRO stage 1 / 2 (plan --emit accelerate) "
             "partitions flat 1/N slices and adds its own buffers",
        may_differ_by="nothing for the torch run (2 gloo ranks: within 120 B); under DeepSpeed, more by its reduce "
                      "bucket (reduce_bucket_size, 5e8 elements by default: 1 GB in bf16) and, for a bf16 model, "
                      "fp32 master weights of the partition",
        source="benchmarks/results/zero-gloo-2026-11-25.json; docs/tracing/zero.md")]
