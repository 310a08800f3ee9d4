"""The Workload (what to train) and the StepOptions (how to train it).

A Workload is the contract every engine uses: the tracer, the probe and the bench call the
same four functions, only on different tensors (fake, virtual-capped or real).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch
    from torch import nn

from batchfit.errors import OptionError

Precision = Literal["fp32", "bf16-mixed", "fp16-mixed", "bf16"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16-mixed", "fp16-mixed", "bf16")
OPTIMIZERS: tuple[str, ...] = ("adamw", "adam", "sgd", "sgd-momentum", "adafactor")
CHECKPOINTING: tuple[str, ...] = ("none", "full", "selective", "every:N")
"""The --checkpointing grammar (``train/checkpointing.py``); N is a positive integer."""


def check_checkpointing(value: str) -> None:
    """Raise a one-line OptionError unless ``value`` is one of :data:`CHECKPOINTING`."""
    if value in ("none", "full", "selective"):
        return
    n = value.removeprefix("every:") if value.startswith("every:") else None
    if n is None or not (n.isascii() and n.isdigit()) or int(n) < 1:  # no sign, no spaces
        raise OptionError(f"unknown checkpointing '{value}': use none, full, selective or every:N "
                          "(e.g. every:2), N a positive integer")
COMPILE: tuple[str, ...] = ("none", "model", "blocks")
LOSSES: tuple[str, ...] = ("plain", "chunked:N", "fused-linear")
"""The --loss grammar (``train/losses.py``); N is a positive integer."""


def check_loss(value: str) -> None:
    """Raise a one-line OptionError unless ``value`` is one of :data:`LOSSES`."""
    if value in ("plain", "fused-linear"):
        return
    n = value.removeprefix("chunked:") if value.startswith("chunked:") else None
    if n is None or not (n.isascii() and n.isdigit()) or int(n) < 1:
        raise OptionError(f"unknown loss '{value}': use plain, chunked:N (e.g. chunked:8), fused-linear; "
                          "N a positive integer")


def check_memory_budget(value: float | None, compile: str) -> None:
    """Raise a one-line OptionError unless ``value`` is None, or a fraction in torch's range
    (0 <= F <= 1, ``_optimize_runtime_with_given_memory`` in torch/_functorch/partitioners.py)
    for a step that is compiled (the budget is the compiled partitioner's)."""
    if value is None:
        return
    if not 0 <= value <= 1:
        raise OptionError(f"--memory-budget must be a fraction from 0 to 1 (e.g. 0.5), got {value:g}")
    if compile == "none":
        raise OptionError("--memory-budget is torch.compile's activation memory budget: add --compile model "
                          "(or blocks)")


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW with PyTorch's defaults: on CUDA it takes the foreach path."""
    import torch

    return torch.optim.AdamW(params, lr=3e-4)


@dataclass(kw_only=True)
class Workload:
    """A model and its training step, as four functions batchfit can call on any device."""

    name: str
    """Shown in reports, e.g. 'gpt2-124m'."""
    build_model: Callable[[], nn.Module]
    """Builds the model on the CPU (or on fake tensors); batchfit moves it to the device."""
    make_batch: Callable[[int, torch.device], Any]
    """(batch_size, device) -> the batch one step consumes."""
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    """(model, batch) -> scalar loss."""
    build_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = default_optimizer
    """(trainable params) -> optimizer; AdamW by default."""
    tokens_per_sample: int | None = None
    """Tokens in one sample (sequence length), for tokens/s; None when not a sequence model."""
    description: str = ""
    """One line for reports: architecture, size, sequence length."""
    generate: Callable[[nn.Module, Any], Any] | None = None
    """(model, batch) -> batch: a generation phase before the update (RL rollouts with a KV
    cache, as GRPO has); runs under torch.no_grad() and the step's autocast."""
    group_size: int | None = None
    """The batch must be a multiple of this (GRPO's completions per prompt)."""
    train_batches: Callable[[int, str, int], Iterable[Any]] | None = None
    """(batch_size, split, seed) -> batches of real data for ``batchfit sweep`` ("train" or
    "val"); without it, sweep trains on ``--data`` text or on ``make_batch``."""
    parallelize: Callable[[nn.Module, Any], nn.Module] | None = None
    """(model, tp_mesh) -> model: the tensor-parallel plan ``batchfit plan`` applies (DTensor
    ``parallelize_module``); the built-in plans cover the zoo's and HF's decoders."""
    lm_parts: Callable[[nn.Module, Any], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    """(model, batch) -> (hidden states before the output head [B, T, H], the head's weight [V, H],
    the targets [B, T], -100 where ignored), what ``--loss chunked:N`` and ``--loss fused-linear``
    need (``train/losses.py``); the zoo's Transformer LMs and HF causal LMs have it."""

    def batch_multiple(self, multiple_of: int = 1) -> int:
        """The granularity of batch sizes: ``multiple_of`` and the group size, both."""
        return math.lcm(multiple_of, self.group_size or 1)


@dataclass(kw_only=True)
class StepOptions:
    """How the step runs, separate from what it trains."""

    precision: Precision = "fp32"
    """fp32; bf16-mixed / fp16-mixed (fp32 weights, autocast); bf16 (weights and states in bf16)."""
    optimizer: str | None = None
    """Override the Workload's optimizer: one of adamw, adam, sgd, sgd-momentum, adafactor."""
    checkpointing: str = "none"
    """Activation checkpointing of the model's main stack of blocks: none; full (recompute every
    block); selective (torchtitan's per-op policy: keep matmuls and attention, recompute the rest
    and every second matmul); every:N (recompute every N-th block, keep the others)."""
    compile: str = "none"
    """torch.compile: none, model (the whole model) or blocks (each block of the main stack, as
    torchtitan does). Real steps compile with inductor; the traced step is compiled with AOTAutograd's
    partition (``trace/compiled.py``), except in ``plan``."""
    loss: str = "plain"
    """The language-model loss: plain (the Workload's loss_fn), chunked:N (cross-entropy over N
    chunks of the sequence, torchtune's) or fused-linear (Liger's fused linear + cross-entropy)."""
    memory_budget: float | None = None
    """torch.compile's activation memory budget (``torch._functorch.config.activation_memory_budget``,
    0 to 1: the fraction of the activations the partitioner may save; the rest is recomputed);
    None leaves torch's default (1.0). Needs ``compile``."""
    frozen: tuple[str, ...] = ()
    """Glob patterns of parameter names to freeze (no grad, no optimizer state)."""
    trainable: tuple[str, ...] = ()
    """If given, only parameters matching these glob patterns train (e.g. adapters)."""
    accumulation_steps: int = 1
    """Micro-batches per optimizer step (gradient accumulation)."""
    set_to_none: bool = True
    """zero_grad(set_to_none=...) after each optimizer step."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form notes carried into reports."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise OptionError(
                f"unknown precision '{self.precision}': use one of {', '.join(PRECISIONS)}"
            )
        if self.optimizer is not None and self.optimizer not in OPTIMIZERS:
            raise OptionError(
                f"unknown optimizer '{self.optimizer}': use one of {', '.join(OPTIMIZERS)}"
            )
        check_checkpointing(self.checkpointing)
        if self.compile not in COMPILE:
            raise OptionError(f"unknown compile '{self.compile}': use one of {', '.join(COMPILE)}")
        check_loss(self.loss)
        check_memory_budget(self.memory_budget, self.compile)
        if self.accumulation_steps < 1:
            raise OptionError(
                f"--accumulation-steps must be 1 or more, got {self.accumulation_steps}"
            )
        self.frozen = tuple(self.frozen)
        self.trainable = tuple(self.trainable)

    @property
    def blocks_alike(self) -> bool:
        """Every block of the main stack runs under the same policy: not every:N with N > 1,
        which checkpoints blocks by position, so a stack cut to 2, 3 and 4 blocks says nothing
        of the whole one (``trace/depth.py`` extrapolates only when this holds)."""
        return not self.checkpointing.startswith("every:") or self.checkpointing == "every:1"

    def to_json(self) -> dict:
        return asdict(self)
