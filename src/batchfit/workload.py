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

Precision = Literal["fp32", "bf16-mixed", "fp16-mixed", "bf16", "fp8-tensorwise", "fp8-rowwise"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16-mixed", "fp16-mixed", "bf16", "fp8-tensorwise", "fp8-rowwise")
FP8_PRECISIONS: tuple[str, ...] = ("fp8-tensorwise", "fp8-rowwise")
"""float8 training with torchao's ``convert_to_float8_training`` (``train/float8.py``), the
recipe after the dash, the rest of the step in bf16-mixed (autocast), as torchtitan runs it."""


def check_precision(value: str) -> None:
    """Raise a one-line OptionError unless ``value`` is one of :data:`PRECISIONS` (and, for the
    float8 ones, torchao is installed: looked up, not imported)."""
    if value not in PRECISIONS:
        raise OptionError(f"unknown precision '{value}': use one of {', '.join(PRECISIONS)}")
    if value in FP8_PRECISIONS and not _installed("torchao"):
        raise OptionError(f"--precision {value} needs torchao (float8 training): pip install 'batchfit[fp8]'")


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


TP_LOSSES: tuple[str, ...] = ("sharded", "gathered")
"""The --tp-loss values (``distributed/tp_plans.py``): the vocabulary-sharded loss (loss_parallel)
or the logits all-gathered onto every tensor-parallel rank."""


def check_tp_loss(value: str) -> None:
    """Raise a one-line OptionError unless ``value`` is one of :data:`TP_LOSSES`."""
    if value not in TP_LOSSES:
        raise OptionError(f"unknown --tp-loss '{value}': use sharded (the logits split by the vocabulary, "
                          "loss_parallel) or gathered (the whole logits on every tensor-parallel rank)")


OFFLOAD: tuple[str, ...] = ("none", "activations", "params", "activations+params")
"""The --offload grammar: none, or parts joined by '+' (``train/offload.py``)."""
OFFLOAD_PARTS: tuple[str, ...] = ("activations", "params")


def check_offload(value: str) -> None:
    """Raise a one-line OptionError unless ``value`` is none or parts of :data:`OFFLOAD_PARTS`
    joined by '+', each once."""
    parts = value.split("+")
    if value == "none" or (all(p in OFFLOAD_PARTS for p in parts) and len(set(parts)) == len(parts)):
        return
    raise OptionError(f"unknown offload '{value}': use none, activations, params or activations+params "
                      "(params: FSDP2's CPUOffloadPolicy, plan with an fsdp strategy)")


ROUTINGS: tuple[str, ...] = ("balanced", "capacity:F", "worst")
"""The --routing grammar (``trace/routing.py``): how many tokens each expert of an MoE layer gets
on fake tensors, where a router's values decide it; F is a positive number."""


def check_routing(value: str) -> None:
    """Raise a one-line OptionError unless ``value`` is one of :data:`ROUTINGS`."""
    if value in ("balanced", "worst"):
        return
    factor = value.removeprefix("capacity:") if value.startswith("capacity:") else None
    try:
        ok = factor is not None and math.isfinite(float(factor)) and float(factor) > 0
    except ValueError:
        ok = False
    if not ok:
        raise OptionError(f"unknown routing '{value}': use balanced (tokens x top_k / experts each), "
                          "capacity:F (e.g. capacity:1.25, F a positive number) or worst (every token to "
                          "the same top_k experts)")


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


PARAMS_OFFLOAD_NEEDS_FSDP = ("--offload params is FSDP2's CPUOffloadPolicy, for sharded steps: use it with "
                             "`batchfit plan --strategies fsdp`; on one GPU use --offload activations")


QUANTIZE: tuple[str, ...] = ("none", "nf4", "nf4-dq", "fp4", "fp4-dq", "int8")
"""The --quantize grammar: the frozen base's linear layers in bitsandbytes 4-bit (nf4/fp4; -dq:
double quantization of the absmax) or 8-bit (LLM.int8), ``train/quantize.py``."""


def check_quantize(value: str) -> None:
    """Raise a one-line OptionError unless ``value`` is one of :data:`QUANTIZE`."""
    if value not in QUANTIZE:
        raise OptionError(f"unknown quantize '{value}': use one of {', '.join(QUANTIZE)} "
                          "(-dq: double quantization, as BitsAndBytesConfig's bnb_4bit_use_double_quant)")


LORA = "r=N[,alpha=A][,dora][,targets=a+b]"
"""The --lora grammar: PEFT LoRA adapters of rank N (DoRA with ``dora``) on the linear layers whose
names end in one of the targets (default: every linear layer but the output head, PEFT's all-linear)."""


def parse_lora(value: str) -> dict[str, Any] | None:
    """``--lora`` as {'r', 'alpha', 'dora', 'targets'} (None for 'none'); a one-line OptionError
    that shows the grammar otherwise."""
    if value == "none":
        return None
    spec: dict[str, Any] = {"r": None, "alpha": None, "dora": False, "targets": None}
    bad = OptionError(f"bad --lora '{value}': use none or {LORA}, e.g. r=16 or r=16,dora,targets=q_proj+v_proj")
    for part in value.split(","):
        key, _, arg = part.strip().partition("=")
        if key in ("r", "alpha") and arg.isascii() and arg.isdigit() and int(arg) >= 1 and spec[key] is None:
            spec[key] = int(arg)
        elif key == "dora" and not arg and not spec["dora"]:
            spec["dora"] = True
        elif key == "targets" and arg and spec["targets"] is None and all(arg.split("+")):
            spec["targets"] = tuple(arg.split("+"))
        else:
            raise bad
    if spec["r"] is None:
        raise bad
    return spec


def check_lora(value: str) -> None:
    """Raise a one-line OptionError unless ``value`` follows :data:`LORA` (or is 'none')."""
    parse_lora(value)


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

    def __post_init__(self) -> None:
        check_precision(self.precision)
        if self.optimizer is not None and self.optimizer not in OPTIMIZERS:
            raise OptionError(
                f"unknown optimizer '{self.optimizer}': use one of {', '.join(OPTIMIZERS)}"
            )
        check_checkpointing(self.checkpointing)
        if self.compile not in COMPILE:
            raise OptionError(f"unknown compile '{self.compile}': use one of {', '.join(COMPILE)}")
        check_loss(self.loss)
        check_tp_loss(self.tp_loss)
        check_offload(self.offload)
        check_quantize(self.quantize)
        check_lora(self.lora)
        if self.quantize != "none" and self.precision in FP8_PRECISIONS:
            raise OptionError(f"--precision {self.precision} makes the linear layers torchao float8 ones "
                              f"and --quantize {self.quantize} makes them bitsandbytes ones: use one of them (QLoRA: "
                              "--precision bf16-mixed)")
        if self.quantize != "none" and self.lora == "none":  # the step would find no parameter to train
            raise OptionError(f"--quantize {self.quantize} freezes the whole base model (QLoRA: only the adapters "
                              "train), so nothing would train: add --lora, e.g. --lora r=16")
        check_memory_budget(self.memory_budget, self.compile)
        check_routing(self.routing)
        check_attention(self.attention)
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

    @property
    def autocast_dtype(self) -> str | None:
        """The autocast dtype's name of a mixed-precision step (float8 runs the rest bf16-mixed)."""
        if self.precision in ("bf16-mixed", *FP8_PRECISIONS):
            return "bfloat16"
        return "float16" if self.precision == "fp16-mixed" else None

    def offloads(self, part: str) -> bool:
        """Whether ``part`` (one of :data:`OFFLOAD_PARTS`) moves to host memory."""
        return part in self.offload.split("+")

    def with_attention_of(self, workload: Workload) -> StepOptions:
        """These options with the attention implementation named: the one asked for, else the
        workload's (what every output shows; None where the model has its own attention)."""
        return self if self.attention is not None else replace(self, attention=workload.attention)

    def to_json(self) -> dict:
        return asdict(self)
