"""Where a step runs or is sized for: one grammar for ``--gpu``, ``--gpu-memory`` and ``--device``.

    --gpu h100-80gb          a catalog GPU, traced (the same as --device virtual:h100-80gb)
    --gpu-memory 24GiB       any GPU by its memory, traced (the same as --device virtual:24GiB)
    --device cuda[:N]        the real GPU: measured (estimate sizes for its capacity)
    --device cpu             real CPU steps: time only, memory traced where a GPU is named
    (nothing)                the real GPU when there is one, else a traced H100, said out loud

Every command accepts all three, so a user types the same thing everywhere.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchfit.devices import CATALOG, Device, custom_device, detect_cuda_device, get_device, parse_size
from batchfit.errors import OptionError, UsageError

if TYPE_CHECKING:
    import torch

DEFAULT_GPU = "h100-80gb"
DEVICE_HELP = "cuda, cuda:N, cpu, virtual:<gpu> (e.g. virtual:h100-80gb) or virtual:<size> (e.g. virtual:24GiB)"


@dataclass(frozen=True)
class Target:
    """Where probes and benchmarks run, and the GPU whose memory they are sized for."""

    kind: str
    """cuda (real), virtual (the traced step with the GPU's capacity) or cpu."""
    device: Device | None
    """The GPU (catalog entry, custom capacity or the real one); None on cpu."""
    spec: str
    """As the user typed it (``virtual:t4-16gb``), so an isolated probe can rebuild it."""
    index: int = 0
    """The CUDA device index (``cuda:1``)."""

    @property
    def torch_device(self) -> torch.device:
        import torch

        return torch.device("cuda", self.index) if self.kind == "cuda" else torch.device("cpu")

    def release(self) -> None:
        """Give the memory of a finished step back: collect cycles, empty the CUDA cache."""
        gc.collect()
        if self.kind == "cuda":
            import torch

            with torch.cuda.device(self.index):
                torch.cuda.empty_cache()


def parse_target(text: str) -> Target:
    """'cuda', 'cuda:1', 'cpu', 'virtual:rtx4090-24gb', 'virtual:48GiB'."""
    kind, _, rest = text.strip().partition(":")
    if kind == "virtual":
        if not rest:
            raise OptionError("`device` virtual needs a GPU: e.g. virtual:h100-80gb or virtual:24GiB")
        device = custom_device(parse_size(rest)) if rest[0].isdigit() else get_device(rest)
        return Target("virtual", device, text)
    if kind == "cuda":
        if rest and not rest.isdigit():
            raise OptionError(f"unknown `device` '{text}': use cuda or cuda:N, e.g. cuda:1")
        import torch

        if not torch.cuda.is_available():
            raise UsageError("`device` cuda, but no CUDA device is visible here: use virtual:<gpu> to "
                             "trace a GPU instead (e.g. `device` virtual:h100-80gb or `gpu` h100-80gb)")
        index = int(rest) if rest else 0
        if index >= torch.cuda.device_count():
            raise OptionError(f"`device` {text}, but only {torch.cuda.device_count()} CUDA device(s) are "
                              f"visible: use cuda:0 to cuda:{torch.cuda.device_count() - 1}")
        return Target("cuda", detect_cuda_device(index), text, index)
    if kind == "cpu" and not rest:
        return Target("cpu", None, text)
    raise OptionError(f"unknown `device` '{text}': use {DEVICE_HELP}")


def resolve_target(*, gpu: str | None = None, gpu_memory: str | None = None, device: str | None = None,
                   say: Callable[[str], None] | None = None) -> Target:
    """The one device grammar of every command (see the module docstring).

    ``say`` is told which device was chosen when the user named none.
    """
    named = [flag for flag, value in (("`gpu`", gpu), ("`gpu_memory`", gpu_memory), ("`device`", device)) if value]
    if len(named) > 1 and not (device == "cpu" and len(named) == 2):
        raise OptionError(f"give one of {' / '.join(named)}: they all say which GPU "
                          "(only `device` cpu combines with `gpu` or `gpu_memory`: time on the CPU, "
                          "memory traced for that GPU)")
    if device == "cpu" and (gpu or gpu_memory):
        sized = custom_device(parse_size(gpu_memory)) if gpu_memory else get_device(gpu)
        return Target("cpu", sized, "cpu")
    if gpu:
        return Target("virtual", get_device(gpu), f"virtual:{gpu}")
    if gpu_memory:
        return Target("virtual", custom_device(parse_size(gpu_memory)), f"virtual:{gpu_memory}")
    if device:
        return parse_target(device)
    import torch  # no device named: a GPU here if there is one

    if torch.cuda.is_available():
        target = parse_target("cuda")
        if say:
            say(f"no --gpu or --device given: using the GPU here, {target.device.display_name} (cuda:0)")
        return target
    if say:
        say(f"no --gpu or --device given and no GPU here: tracing a virtual {DEFAULT_GPU} "
            f"(choose with --gpu, see `batchfit gpus`)")
    return Target("virtual", CATALOG[DEFAULT_GPU], f"virtual:{DEFAULT_GPU}")


def bytes_at_target(device: Device, target_util: float) -> int:
    """The bytes under ``target_util`` of ``device``'s usable memory: what every answer "at the
    target" (estimate's, plan's) must fit."""
    return int(target_util * device.usable_bytes)


class SizedForTarget:
    """The two limits of a result sized for its ``device`` at its ``target_util`` (EstimateResult,
    PlanResult): what must fit (``capacity_bytes``) and what the answer at the target fits
    (``target_bytes``), written once."""

    device: Device
    target_util: float

    @property
    def capacity_bytes(self) -> int:
        return self.device.usable_bytes

    @property
    def target_bytes(self) -> int:
        return bytes_at_target(self.device, self.target_util)
