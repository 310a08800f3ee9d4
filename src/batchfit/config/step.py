"""The flags of the training step (``--precision``, ``--checkpointing``, ...) as one StepOptions, and the
small values every command reads (``--batch-sizes``, ``--host-memory``).

A command's flags arrive as a typed group (:class:`StepFlags`) picked from its parameters by name, so
a command without ``--quantize`` (plan) gets the field's default, and nothing is passed by position.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

from batchfit.errors import OptionError
from batchfit.search import MAX_BATCH_SIZE
from batchfit.targets import Target, resolve_target
from batchfit.workload import StepOptions


def quiet(message: str) -> None:
    """The default ``say``: called from Python, nothing is printed."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class Flags:
    """A group of flags, as a command's parameters name them."""

    @classmethod
    def pick(cls, values: Mapping[str, Any]):
        """The fields of ``cls`` found in ``values`` (a command's ``locals()``); those it lacks keep their defaults."""
        return cls(**{field.name: values[field.name] for field in dataclasses.fields(cls) if field.name in values})


@dataclasses.dataclass(kw_only=True, frozen=True)
class TargetFlags(Flags):
    """What to train and the device options every command shares (``targets.py``: one grammar)."""

    model: str
    """The MODEL spec (``specs.py``)."""
    gpu: str | None = None
    gpu_memory: str | None = None
    device: str | None = None

    def target(self, say: Callable[[str], None] = quiet) -> Target:
        """The device the flags name; ``say``: which one was chosen when none was named."""
        return resolve_target(gpu=self.gpu, gpu_memory=self.gpu_memory, device=self.device, say=say)


@dataclasses.dataclass(kw_only=True, frozen=True)
class DataFlags(TargetFlags):
    """The tokens per sample and the data of a run, as estimate, probe and bench take them."""

    seq_len: int | None = None
    data: str | None = None
    batching: str | None = None
    length_column: str | None = None
    tokenizer: str | None = None


@dataclasses.dataclass(kw_only=True, frozen=True)
class StepFlags(Flags):
    """The flags that become :class:`~batchfit.workload.StepOptions` (each field the flag of its name)."""

    precision: str = "fp32"
    optimizer: str | None = None
    param_groups: str = "one"
    checkpointing: str = "none"
    freeze: list[str] | None = None
    train_only: list[str] | None = None
    accumulation_steps: int = 1
    compile_: str = "none"
    loss: str = "plain"
    offload: str = "none"
    quantize: str = "none"
    lora: str = "none"
    memory_budget: float | None = None
    routing: str = "balanced"
    attention: str | None = None

    def options(self, say: Callable[[str], None] = quiet, *, routing_per_step: bool = False) -> StepOptions:
        """The StepOptions these flags say (StepOptions checks each grammar); ``say``: a line for the user;
        ``routing_per_step``: as :func:`step_options`'."""
        return step_options(self.precision, self.optimizer, self.checkpointing, self.freeze, self.train_only,
                            self.accumulation_steps, self.compile_, self.loss, self.offload, quantize=self.quantize,
                            lora=self.lora, memory_budget=self.memory_budget, routing=self.routing,
                            attention=self.attention, param_groups=self.param_groups, say=say,
                            routing_per_step=routing_per_step)


def step_options(precision: str, optimizer: str | None, checkpointing: str, freeze: list[str] | None,
                 train_only: list[str] | None, accumulation_steps: int, compile: str = "none",
                 loss: str = "plain", offload: str = "none", *, quantize: str = "none",
                 lora: str = "none", memory_budget: float | None = None,
                 routing: str = "balanced", attention: str | None = None, param_groups: str = "one",
                 say: Callable[[str], None] = quiet, routing_per_step: bool = False) -> StepOptions:
    """The step's options from the flags; ``routing_per_step``: the command replays a run's steps, so
    ``routing`` may give one per step (``options.RoutingSchedule``)."""
    if accumulation_steps > MAX_BATCH_SIZE:  # 0 and below: StepOptions says "1 or more"
        raise OptionError(f"`accumulation_steps` must be from 1 to {MAX_BATCH_SIZE:,} (2^24), e.g. 8")
    if freeze and train_only:
        say("--train-only picks the parameters that train; --freeze then freezes some of those")
    options = StepOptions(precision=precision, optimizer=optimizer, checkpointing=checkpointing,
                          frozen=tuple(freeze or ()), trainable=tuple(train_only or ()),
                          accumulation_steps=accumulation_steps, compile=compile, loss=loss,
                          offload=offload, quantize=quantize, lora=lora, memory_budget=memory_budget,
                          routing=routing, attention=attention, param_groups=param_groups)
    if options.routing_schedule.varies and not routing_per_step:
        raise OptionError(f"`routing` {routing} gives a routing per step, which only estimate `data` FILE "
                          "`replay_steps` K replays: give one routing here (e.g. `routing` worst, the bound)")
    return options


def parse_batch_sizes(text: str | None) -> list[int] | None:
    """'8,16,32' -> [8, 16, 32]."""
    if text is None:
        return None
    if not re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*", text):
        raise OptionError(f"cannot read `batch_sizes` '{text}': give positive integers separated by commas, "
                          "e.g. 8,16,32")
    sizes = [int(s) for s in text.split(",")]
    if not 1 <= min(sizes) <= max(sizes) <= MAX_BATCH_SIZE:  # beyond: overflows inside torch
        raise OptionError(f"`batch_sizes` must all be from 1 to {MAX_BATCH_SIZE:,} (2^24), e.g. 8,16,32")
    return sizes


def parse_host_memory(text: str | None) -> int | None:
    """--host-memory as bytes (devices.py's size grammar), or None: not checked."""
    if text is None:
        return None
    from batchfit.devices import parse_size
    from batchfit.errors import SizeError

    try:
        size = parse_size(text)
    except SizeError:
        raise OptionError(f"`host_memory`: cannot read the size '{text}': write a number and a unit, e.g. "
                          "`host_memory` 512GiB (2**30 bytes) or 512GB (10**9 bytes)") from None
    if size <= 0:
        raise OptionError("`host_memory` must be more than 0 bytes, e.g. `host_memory` 512GiB")
    return size
