"""The Workload (what to train) and the StepOptions (how to train it).

A Workload is the contract every engine uses: the tracer, the probe and the bench call the
same four functions, only on different tensors (fake, virtual-capped or real).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch
    from torch import nn

from batchfit.errors import OptionError
from batchfit.options import (  # noqa: F401  (the grammars, re-exported where they were always imported from)
    CHECKPOINTING,
    FP8_PRECISIONS,
    LORA,
    LOSSES,
    OFFLOAD,
    OFFLOAD_PARTS,
    PRECISIONS,
    QUANTIZE,
    ROUTINGS,
    Checkpointing,
    LoRA,
    Loss,
    Offload,
    ParamGroups,
    PrecisionSpec,
    Quantize,
    Routing,
    RoutingSchedule,
)

Precision = Literal["fp32", "bf16-mixed", "fp16-mixed", "bf16", "fp8-tensorwise", "fp8-rowwise"]


def _installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing, or sys.modules holds None
        return False


OPTIMIZERS: tuple[str, ...] = ("adamw", "adam", "sgd", "sgd-momentum", "adafactor", "muon",
                               "adamw-8bit", "paged-adamw-8bit", "lion-8bit", "paged-lion-8bit",
                               "adamw-torchao-8bit", "adamw-torchao-4bit")
"""muon: train/muon.py; the last six: bitsandbytes' 8-bit (and paged) AdamW and Lion, torchao's low-bit
AdamW (``train/quantize.py``; the ``[quant]`` extra)."""


COMPILE: tuple[str, ...] = ("none", "model", "blocks")
TP_LOSSES: tuple[str, ...] = ("sharded", "gathered")
"""The --tp-loss values (``distributed/tp_plans.py``): the vocabulary-sharded loss (loss_parallel)
or the logits all-gathered onto every tensor-parallel rank."""


def check_tp_loss(value: str) -> None:
    """Raise a one-line OptionError unless ``value`` is one of :data:`TP_LOSSES`."""
    if value not in TP_LOSSES:
        raise OptionError(f"unknown `tp_loss` '{value}': use sharded (the logits split by the vocabulary, "
                          "loss_parallel) or gathered (the whole logits on every tensor-parallel rank)")


ATTENTIONS: tuple[str, ...] = ("eager", "sdpa", "flash")
"""The --attention values (``train/attention.py``): a transformers model's attention implementation,
eager (the model's own softmax(QK^T)V, which holds the [B, H, T, T] scores), sdpa (PyTorch's
scaled_dot_product_attention: CUDA's fused kernels, no T x T scores) or flash (the flash_attn
package's FlashAttention-2, transformers' ``flash_attention_2``: run on a CUDA GPU, traced as that
kernel saves, fp16/bf16 only)."""
HF_ATTENTION = {"eager": "eager", "sdpa": "sdpa", "flash": "flash_attention_2"}
"""batchfit's --attention value -> transformers' ``attn_implementation``."""


def check_attention(value: str | None) -> None:
    """Raise a one-line OptionError unless ``value`` is None (the model's own) or one of :data:`ATTENTIONS`."""
    if value is not None and value not in ATTENTIONS:
        raise OptionError(f"unknown attention '{value}': use eager, sdpa or flash (transformers' "
                          "attn_implementation eager, sdpa, flash_attention_2)")


def attention_words(value: str | None) -> str:
    """The attention implementation in words, for every output."""
    return {"eager": "eager (softmax(QK^T)V: [B, H, T, T] scores per layer)",
            "sdpa": "sdpa (fused CUDA kernels: no T x T scores)",
            "flash": "flash (flash_attn's FlashAttention-2)"}.get(value or "", "the model's own")


PARAMS_OFFLOAD_NEEDS_FSDP = ("`offload` params is FSDP2's CPUOffloadPolicy, for sharded steps: use it with "
                             "`batchfit plan --strategies fsdp`; on one GPU use `offload` activations")


def check_memory_budget(value: float | None, compile: str) -> None:
    """Raise a one-line OptionError unless ``value`` is None, or a fraction in torch's range
    (0 <= F <= 1, ``_optimize_runtime_with_given_memory`` in torch/_functorch/partitioners.py)
    for a step that is compiled (the budget is the compiled partitioner's)."""
    if value is None:
        return
    if not 0 <= value <= 1:
        raise OptionError(f"`memory_budget` must be a fraction from 0 to 1 (e.g. 0.5), got {value:g}")
    if compile == "none":
        raise OptionError("`memory_budget` is torch.compile's activation memory budget: add `compile` model "
                          "(or blocks)")


def shape_only_call(key: object, rows: int, device: torch.device, run: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``run()``: a call that returns one tensor on ``device`` and whose allocations depend only on ``key``
    (the shapes it is given but their rows, dtypes, modes) and ``rows`` (a generation loop: fake tensors
    have no values). A tracer on the dispatch-mode stack that writes such calls (``write_call``:
    ``trace/written.py``) may write its allocations into the trace instead of running it again."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    for mode in reversed(_get_current_dispatch_mode_stack()):
        write = getattr(mode, "write_call", None)
        if write is not None:
            return write(key, rows, device, run)
    return run()


KEEP_FP32 = "batchfit_keep_fp32"
"""A module of a Workload's model with this attribute set keeps its parameters in fp32 when the step casts
the model to the precision's dtype (``train/model.py`` move_module; TRL's ``cast_lm_head_to_fp32``:
``zoo/grpo.py``); a parameter it shares (a tied embedding) is fp32 too, as ``Module.float()`` leaves it."""


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
    reference: Callable[[nn.Module, Any], Any] | None = None
    """(model, generated batch) -> batch: the no-gradient scoring pass between generation and the
    update (GRPO's reference log-probs, TRL's ``_generate_and_score_completions``), announced as
    its own phase ('reference'); runs under torch.no_grad() and the step's autocast."""
    group_size: int | None = None
    """The batch must be a multiple of this (GRPO's completions per prompt)."""
    train_batches: Callable[[int, str, int], Iterable[Any]] | None = None
    """(batch_size, split, seed) -> batches of real data for ``batchfit sweep`` ("train" or
    "val"); without it, sweep trains on ``--data`` text or on ``make_batch``."""
    parallelize: Callable[[nn.Module, Any], nn.Module] | None = None
    """(model, tp_mesh) -> model: the tensor-parallel plan ``batchfit plan`` applies (DTensor
    ``parallelize_module``); the built-in plans cover the zoo's and HF's decoders."""
    parallelize_all: Callable[[nn.Module, Any, dict], nn.Module] | None = None
    """(model, strategy, groups) -> model: the model's own way to apply a whole strategy (TP,
    activation checkpointing, FSDP2), used by ``batchfit plan`` instead of its own
    (``zoo/torchtitan_model.py``: torchtitan's ``parallelize_llama``); it fills ``groups`` with
    {process group name: ("dp" | "tp", ranks)} for the collectives it creates."""
    lm_parts: Callable[[nn.Module, Any], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    """(model, batch) -> (hidden states before the output head [B, T, H], the head's weight [V, H],
    the targets [B, T], -100 where ignored), what ``--loss chunked:N`` and ``--loss fused-linear``
    need (``train/losses.py``); the zoo's Transformer LMs and HF causal LMs have it."""
    attention: str | None = None
    """The attention implementation the model is built with (one of :data:`ATTENTIONS`): for hf:
    the config's ``attn_implementation``, else sdpa where transformers' class supports it
    (``_supports_sdpa``), else eager; None: a model with its own attention code, which
    ``StepOptions.attention`` cannot change."""
    cache_key: str | None = None
    """What names this workload in the trace cache (``trace/cache.py``): its spec, a digest of the
    file the spec names, and ``--seq-len``; set by ``load_workload``. None (a Workload built in
    Python, whose functions have no content to key): never cached."""

    def batch_multiple(self, multiple_of: int = 1) -> int:
        """The granularity of batch sizes: ``multiple_of`` and the group size, both."""
        return math.lcm(multiple_of, self.group_size or 1)


@dataclass(kw_only=True)
class StepOptions:
    """How the step runs, separate from what it trains."""

    precision: Precision = "fp32"
    """fp32; bf16-mixed / fp16-mixed (fp32 weights, autocast); bf16 (weights and states in bf16);
    fp8-tensorwise / fp8-rowwise (torchao float8 linears, the rest bf16-mixed)."""
    optimizer: str | None = None
    """Override the Workload's optimizer: one of adamw, adam, sgd, sgd-momentum, adafactor, muon (Muon
    for the hidden 2-D matrices, AdamW for embeddings, head, norms and biases: train/muon.py)."""
    param_groups: str = "one"
    """The optimizer's parameter groups: one (every trainable parameter, as ``Optimizer(model.parameters())``)
    or decay:WD (the HF Trainer's two: weight decay WD on the weights, none on biases and norm weights;
    ``--trainer`` sets it). Muon keeps its own split. A Workload's own optimizer gets the two group dicts."""
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
    tp_loss: str = "sharded"
    """Under tensor parallelism, where the plan splits the output head by the vocabulary: sharded
    (the logits stay split, the cross-entropy runs under loss_parallel, as torchtitan) or
    gathered (the whole logits all-gathered onto every rank). No effect without TP."""
    offload: str = "none"
    """What moves to pinned host memory: none; activations (the tensors autograd saves in the
    forward, moved out and back by saved-tensor hooks, as torchtune's and TRL's
    OffloadActivations do); params (FSDP2's CPUOffloadPolicy: sharded parameters, their gradients
    and the optimizer state, stepped on the CPU; plan only); or both, joined by '+'."""
    quantize: str = "none"
    """The frozen base's linear layers (not the output head) in bitsandbytes: nf4, nf4-dq, fp4,
    fp4-dq (4-bit, compute dtype from the precision) or int8; none keeps them as they are."""
    lora: str = "none"
    """PEFT LoRA adapters on top (``r=16[,alpha=32][,dora][,targets=q_proj+v_proj]``); the base is
    frozen and only the adapters train."""
    memory_budget: float | None = None
    """torch.compile's activation memory budget (``torch._functorch.config.activation_memory_budget``,
    0 to 1: the fraction of the activations the partitioner may save; the rest is recomputed);
    None leaves torch's default (1.0). Needs ``compile``."""
    routing: str = "balanced"
    """How many tokens each expert of an MoE layer gets on fake tensors (a router's values decide it
    on real ones): balanced (tokens x top_k / experts each), capacity:F (filled to a capacity of
    ceil(F x tokens x top_k / experts) in turn, the rest dropped) or worst (every token to the same
    top_k experts). No effect on a dense model."""
    attention: str | None = None
    """A transformers model's attention implementation (:data:`ATTENTIONS`): eager, sdpa or flash;
    None: the Workload's (``Workload.attention``). Engines name the one used in every output."""
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

    if TYPE_CHECKING:  # set by __post_init__, not fields: to_json and the constructor stay the text
        precision_spec: PrecisionSpec
        checkpointing_spec: Checkpointing
        loss_spec: Loss
        offload_spec: Offload
        quantize_spec: Quantize
        param_groups_spec: ParamGroups
        lora_spec: LoRA | None
        """None for 'none'."""
        routing_spec: Routing
        """Step 0's routing: the one every one-step trace runs."""
        routing_schedule: RoutingSchedule
        """A routing per step (``estimate --data --replay-steps K`` replays each step with its own)."""

    def __post_init__(self) -> None:
        # Each grammar parsed once, here (batchfit/options.py): downstream code reads these fields,
        # never the text (tests/test_layout.py pins it).
        self.precision_spec = PrecisionSpec.parse(self.precision)
        if self.precision_spec.fp8_recipe and not _installed("torchao"):  # looked up, not imported
            raise OptionError(f"`precision` {self.precision} needs torchao (float8 training): "
                              "pip install 'batchfit[fp8]'")
        if self.optimizer is not None and self.optimizer not in OPTIMIZERS:
            raise OptionError(
                f"unknown optimizer '{self.optimizer}': use one of {', '.join(OPTIMIZERS)}"
            )
        self.param_groups_spec = ParamGroups.parse(self.param_groups)
        self.checkpointing_spec = Checkpointing.parse(self.checkpointing)
        if self.compile not in COMPILE:
            raise OptionError(f"unknown compile '{self.compile}': use one of {', '.join(COMPILE)}")
        self.loss_spec = Loss.parse(self.loss)
        check_tp_loss(self.tp_loss)
        self.offload_spec = Offload.parse(self.offload)
        self.quantize_spec = Quantize.parse(self.quantize)
        self.lora_spec = LoRA.parse(self.lora)
        if self.quantize != "none" and self.precision in FP8_PRECISIONS:
            raise OptionError(f"`precision` {self.precision} makes the linear layers torchao float8 ones "
                              f"and `quantize` {self.quantize} makes them bitsandbytes ones: use one of them (QLoRA: "
                              "`precision` bf16-mixed)")
        if self.quantize != "none" and self.lora == "none":  # the step would find no parameter to train
            raise OptionError(f"`quantize` {self.quantize} freezes the whole base model (QLoRA: only the adapters "
                              "train), so nothing would train: add `lora`, e.g. `lora` r=16")
        check_memory_budget(self.memory_budget, self.compile)
        self.routing_schedule = RoutingSchedule.parse(self.routing)
        self.routing_spec = self.routing_schedule.at(0)  # a one-step trace's: step 0's
        check_attention(self.attention)
        if self.accumulation_steps < 1:
            raise OptionError(
                f"`accumulation_steps` must be 1 or more, got {self.accumulation_steps}"
            )
        self.frozen = tuple(self.frozen)
        self.trainable = tuple(self.trainable)

    @property
    def blocks_alike(self) -> bool:
        """Every block of the main stack runs under the same policy: not every:N with N > 1,
        which checkpoints blocks by position, so a stack cut to 2, 3 and 4 blocks says nothing
        of the whole one (``trace/depth.py`` extrapolates only when this holds)."""
        return not self.checkpointing_spec.by_position

    @property
    def autocast_dtype(self) -> str | None:
        """The autocast dtype's name of a mixed-precision step (float8 runs the rest bf16-mixed)."""
        if self.precision in ("bf16-mixed", *FP8_PRECISIONS):
            return "bfloat16"
        return "float16" if self.precision == "fp16-mixed" else None

    def with_attention_of(self, workload: Workload) -> StepOptions:
        """These options with the attention implementation named: the one asked for, else the
        workload's (what every output shows; None where the model has its own attention)."""
        return self if self.attention is not None else replace(self, attention=workload.attention)

    def to_json(self) -> dict:
        return asdict(self)
