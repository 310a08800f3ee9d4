"""How ``probe`` under torchrun wraps each rank's model: the choice of strategy and its checks.

    ddp    DistributedDataParallel over all ranks
    fsdp   FSDP2 per block and at the root, with the step's mixed-precision policy

The wrap itself is ``batchfit.distributed.apply_strategy``, the code ``plan`` traces on its
fake process group. It needs the process group that torchrun set up (``probe/ranks.py``
joins it), so it runs only on real tensors: the traced step (fake tensors, the virtual
device) cannot be wrapped and stays the single-GPU step on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from batchfit.errors import OptionError

if TYPE_CHECKING:  # torch is imported where a model is wrapped: the CLI's help names STRATEGIES
    import torch
    from torch import nn

STRATEGIES = ("ddp", "fsdp")


def check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise OptionError(f"unknown `strategy` '{strategy}': use one of {', '.join(STRATEGIES)}")


def wrap_model(model: nn.Module, strategy: str, device: torch.device, precision: str = "fp32") -> nn.Module:
    """``model`` as ``strategy`` runs it on ``device`` over the default process group, for a
    step at ``precision`` (FSDP2 gathers bf16 / fp16 parameters and reduces in fp32 for the
    mixed ones, as ``plan`` traces it)."""
    import torch.distributed as dist

    from batchfit.distributed import Meshes, apply_strategy, build_meshes, data_parallel

    check_strategy(strategy)
    if not (dist.is_available() and dist.is_initialized()):
        raise OptionError(f"`strategy` {strategy} needs torch.distributed's process group: run under "
                          "torchrun, e.g. torchrun --nproc-per-node 2 -m batchfit.cli.app probe ...")
    layout = data_parallel(strategy, dist.get_world_size())
    # DDP runs on the default group: no mesh to build
    meshes = Meshes(dp=None, tp=None, groups={}) if strategy == "ddp" else build_meshes(layout, device.type)
    return apply_strategy(model, layout, meshes, precision=precision, fake=False, device=device)


def choose_strategy(strategy: str | None, *, virtual: bool, world_size: int, isolate: bool = False) -> str | None:
    """The wrap a probe's real step gets: 'ddp' by default under torchrun; None (the
    single-GPU step) alone, or on the virtual device, whose fake tensors cannot join a
    real process group (there each rank traces the single-GPU step, as before)."""
    if strategy is None and (world_size <= 1 or virtual):
        return None
    if strategy is not None:
        check_strategy(strategy)
        if virtual:
            raise OptionError(f"`strategy` {strategy} wraps real steps in torch.distributed; the virtual device "
                              "traces one GPU's step on fake tensors: drop `strategy`, or probe `device` cuda")
        if world_size <= 1:
            raise OptionError(f"`strategy` {strategy} needs several ranks: run under torchrun, e.g. "
                              "torchrun --nproc-per-node 2 -m batchfit.cli.app probe MODEL --device cuda")
    strategy = strategy or "ddp"
    if isolate:
        raise OptionError(f"`isolate` runs each probe in a fresh process outside torchrun's process group, "
                          f"so it cannot wrap the model in {strategy}: drop `isolate`")
    return strategy


def step_wrapper(strategy: str | None, device: torch.device,
                 precision: str = "fp32") -> Callable[[nn.Module], nn.Module] | None:
    """What ``TrainingStep(wrap=...)`` takes for a step at ``precision``: None keeps the single-GPU step."""
    if strategy is None:
        return None
    check_strategy(strategy)
    return lambda model: wrap_model(model, strategy, device, precision)
