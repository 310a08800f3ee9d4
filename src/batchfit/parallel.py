"""Wrap a model as a multi-GPU run would: PyTorch's own DDP or FSDP2, never a formula.

    ddp    DistributedDataParallel: every rank keeps the whole model, gradients are
           all-reduced in buckets during backward (the buckets are memory too).
    fsdp   FSDP2 ``fully_shard`` on each block of the model's main stack and at the root,
           as torchtitan does: each rank keeps 1/N of the parameters, gradients and
           optimizer state, and all-gathers one block at a time.

The wrap needs the process group that torchrun set up (``probe/ranks.py`` joins it), so it
runs only on real tensors: the traced step (fake tensors, the virtual device) cannot be
wrapped and stays the single-GPU step on every rank.
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
        raise OptionError(f"unknown --strategy '{strategy}': use one of {', '.join(STRATEGIES)}")


def wrap_model(model: nn.Module, strategy: str, device: torch.device) -> nn.Module:
    """``model`` as ``strategy`` runs it on ``device``, over the default process group."""
    import torch.distributed as dist
    from torch import nn

    from batchfit.train.step import block_list

    check_strategy(strategy)
    if not (dist.is_available() and dist.is_initialized()):
        raise OptionError(f"--strategy {strategy} needs torch.distributed's process group: run under "
                          "torchrun, e.g. torchrun --nproc-per-node 2 -m batchfit.cli.app probe ...")
    if strategy == "ddp":
        # device_ids names the rank's own GPU (cuda:LOCAL_RANK); on the CPU (gloo) DDP wants None.
        device_ids = [device] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    # Imported here: torch builds without torch.distributed cannot import them, and the
    # single-GPU step never needs them.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # A 1-D mesh over the whole world reuses the default group (no new communicator per probe).
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    # One FSDP group per block, so only one block's full parameters are gathered at a time;
    # the root group holds the rest (embeddings, final norm, head) and any model without blocks.
    # FSDP2's defaults: blocks free their gathered parameters after forward, the root keeps
    # its own (backward needs them at once). fully_shard changes the modules in place.
    for block in block_list(model) or ():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def choose_strategy(strategy: str | None, *, virtual: bool, world_size: int, isolate: bool = False) -> str | None:
    """The wrap a probe's real step gets: 'ddp' by default under torchrun; None (the
    single-GPU step) alone, or on the virtual device, whose fake tensors cannot join a
    real process group (there each rank traces the single-GPU step, as before)."""
    if strategy is None and (world_size <= 1 or virtual):
        return None
    if strategy is not None:
        check_strategy(strategy)
        if virtual:
            raise OptionError(f"--strategy {strategy} wraps real steps in torch.distributed; the virtual device "
                              "traces one GPU's step on fake tensors: drop --strategy, or probe --device cuda")
        if world_size <= 1:
            raise OptionError(f"--strategy {strategy} needs several ranks: run under torchrun, e.g. "
                              "torchrun --nproc-per-node 2 -m batchfit.cli.app probe MODEL --device cuda")
    strategy = strategy or "ddp"
    if isolate:
        raise OptionError(f"--isolate runs each probe in a fresh process outside torchrun's process group, "
                          f"so it cannot wrap the model in {strategy}: drop --isolate")
    return strategy


def step_wrapper(strategy: str | None, device: torch.device) -> Callable[[nn.Module], nn.Module] | None:
    """What ``TrainingStep(wrap=...)`` takes: None keeps the single-GPU step."""
    if strategy is None:
        return None
    check_strategy(strategy)
    return lambda model: wrap_model(model, strategy, device)
