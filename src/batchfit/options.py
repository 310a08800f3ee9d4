"""The small text grammars of StepOptions, each parsed once into a frozen value.

A user types ``--checkpointing every:2``, ``--loss chunked:8``, ``--routing capacity:1.25``,
``--lora r=16,dora``, ``--offload activations+params``; ``StepOptions`` keeps that text (its
public constructor) and its ``__post_init__`` parses each here, once, into the values below
(``options.checkpointing_spec.every``, ``options.offload_spec.params``, ...). The step, the tracer,
the planners and the emitters read those fields, never the text: ``tests/test_layout.py`` holds
every other module to it. Each ``parse`` raises the one-line OptionError that shows the grammar;
``str()`` gives the text back. Ground floor: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from batchfit.errors import OptionError

PRECISIONS: tuple[str, ...] = ("fp32", "bf16-mixed", "fp16-mixed", "bf16", "fp8-tensorwise", "fp8-rowwise")
FP8_PRECISIONS: tuple[str, ...] = ("fp8-tensorwise", "fp8-rowwise")
"""float8 training with torchao's ``convert_to_float8_training`` (``train/float8.py``), the
recipe after the dash, the rest of the step in bf16-mixed (autocast), as torchtitan runs it."""
CHECKPOINTING: tuple[str, ...] = ("none", "full", "selective", "every:N")
"""The --checkpointing grammar (``train/checkpointing.py``); N is a positive integer."""
LOSSES: tuple[str, ...] = ("plain", "chunked:N", "fused-linear")
"""The --loss grammar (``train/losses.py``); N is a positive integer."""
OFFLOAD: tuple[str, ...] = ("none", "activations", "params", "activations+params")
"""The --offload grammar: none, or parts joined by '+' (``train/offload.py``)."""
OFFLOAD_PARTS: tuple[str, ...] = ("activations", "params")
ROUTINGS: tuple[str, ...] = ("balanced", "capacity:F", "worst")
"""The --routing grammar (``trace/routing.py``): how many tokens each expert of an MoE layer gets
on fake tensors, where a router's values decide it; F is a positive number."""
QUANTIZE: tuple[str, ...] = ("none", "nf4", "nf4-dq", "fp4", "fp4-dq", "int8")
"""The --quantize grammar: the frozen base's linear layers in bitsandbytes 4-bit (nf4/fp4; -dq:
double quantization of the absmax) or 8-bit (LLM.int8), ``train/quantize.py``."""
PARAM_GROUPS: tuple[str, ...] = ("one", "decay:WD")
"""The --param-groups grammar (``train/model.py``): one group of every trainable parameter, or the HF
Trainer's two (weight decay WD on the weights, none on biases and norm weights); WD a number >= 0."""
LORA = "r=N[,alpha=A][,dora][,targets=a+b]"
"""The --lora grammar: PEFT LoRA adapters of rank N (DoRA with ``dora``) on the linear layers whose
names end in one of the targets (default: every linear layer but the output head, PEFT's all-linear)."""


def _positive_int(text: str | None) -> int | None:
    """``text`` as an integer of 1 or more, written without sign or spaces; None otherwise."""
    return int(text) if text is not None and text.isascii() and text.isdigit() and int(text) >= 1 else None


@dataclass(frozen=True)
class PrecisionSpec:
    """--precision in parts: what the weights are kept in, what autocast runs, the float8 recipe."""

    name: str
    """The text, one of :data:`PRECISIONS`."""

    @classmethod
    def parse(cls, text: str) -> PrecisionSpec:
        if text not in PRECISIONS:
            raise OptionError(f"unknown precision '{text}': use one of {', '.join(PRECISIONS)}")
        return cls(text)

    @property
    def fp8_recipe(self) -> str | None:
        """torchao's float8 recipe (``tensorwise``, ``rowwise``); None when not float8."""
        return self.name.removeprefix("fp8-") if self.name in FP8_PRECISIONS else None

    @property
    def bf16(self) -> bool:
        """The step's math runs in bf16 (bf16 weights or bf16-mixed; float8 is asked apart)."""
        return self.name in ("bf16", "bf16-mixed")

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Checkpointing:
    """--checkpointing: which blocks of the main stack recompute in backward."""

    kind: Literal["none", "full", "selective", "every"]
    every: int | None = None
    """every:N's N (block i recomputed when (i + 1) % N == 0); None for the other kinds."""

    @classmethod
    def parse(cls, text: str) -> Checkpointing:
        if text in ("none", "full", "selective"):
            return cls(text)  # type: ignore[arg-type]
        every = _positive_int(text.removeprefix("every:")) if text.startswith("every:") else None
        if every is None:
            raise OptionError(f"unknown checkpointing '{text}': use none, full, selective or every:N "
                              "(e.g. every:2), N a positive integer")
        return cls("every", every)

    @property
    def by_position(self) -> bool:
        """Blocks are checkpointed by their position (every:N with N > 1), so they differ."""
        return self.kind == "every" and self.every != 1

    def __str__(self) -> str:
        return f"every:{self.every}" if self.kind == "every" else self.kind


@dataclass(frozen=True)
class Loss:
    """--loss: the language-model loss."""

    kind: Literal["plain", "chunked", "fused-linear"]
    chunks: int | None = None
    """chunked:N's N; None for the other kinds."""

    @classmethod
    def parse(cls, text: str) -> Loss:
        if text in ("plain", "fused-linear"):
            return cls(text)  # type: ignore[arg-type]
        chunks = _positive_int(text.removeprefix("chunked:")) if text.startswith("chunked:") else None
        if chunks is None:
            raise OptionError(f"unknown loss '{text}': use plain, chunked:N (e.g. chunked:8), fused-linear; "
                              "N a positive integer")
        return cls("chunked", chunks)

    def __str__(self) -> str:
        return f"chunked:{self.chunks}" if self.kind == "chunked" else self.kind


@dataclass(frozen=True)
class Routing:
    """--routing: how many tokens each expert of an MoE layer gets on fake tensors."""

    kind: Literal["balanced", "capacity", "worst"]
    capacity_factor: float | None = None
    """capacity:F's F; None for the other kinds."""

    @classmethod
    def parse(cls, text: str) -> Routing:
        if text in ("balanced", "worst"):
            return cls(text)  # type: ignore[arg-type]
        factor = None
        if text.startswith("capacity:"):
            try:
                factor = float(text.removeprefix("capacity:"))
            except ValueError:
                pass
        if factor is None or not math.isfinite(factor) or factor <= 0:
            raise OptionError(f"`routing` {text}: unknown routing; use balanced (tokens x top_k / experts each), "
                              "capacity:F (e.g. capacity:1.25, F a positive number) or worst (every token to "
                              "the same top_k experts)")
        return cls("capacity", factor)

    def __str__(self) -> str:
        return f"capacity:{self.capacity_factor:g}" if self.kind == "capacity" else self.kind


MAX_ROUTED_STEPS = 1 << 20
"""The most steps a --routing schedule spells out (R*N counts N)."""


@dataclass(frozen=True)
class RoutingSchedule:
    """--routing with a routing per step, for the run's replay (``estimate --data --replay-steps K``):
    routings joined by commas, each R or R*N (N steps of R), e.g. ``balanced*20,capacity:1.5*10,worst``;
    step i takes the i-th, and the last holds for every step after. One routing is a schedule of one."""

    steps: tuple[Routing, ...]

    @classmethod
    def parse(cls, text: str) -> RoutingSchedule:
        steps: list[Routing] = []
        for item in text.split(","):
            routing, star, count = item.strip().partition("*")
            times = _positive_int(count) if star else 1
            if times is None:
                raise OptionError(f"`routing` {text}: '{item}' repeats a routing a positive number of times, e.g. "
                                  "balanced*20 (a routing per step: R or R*N joined by commas, e.g. "
                                  "balanced*20,capacity:1.5,worst)")
            steps += [Routing.parse(routing)] * min(times, MAX_ROUTED_STEPS)
            if len(steps) > MAX_ROUTED_STEPS:
                raise OptionError(f"`routing` {text} spells out more than {MAX_ROUTED_STEPS:,} steps: the last routing "
                                  "holds for the steps after it, so end with it")
        return cls(tuple(steps))

    def at(self, step: int) -> Routing:
        """The routing of step ``step`` (from 0): the last one beyond the schedule's end."""
        return self.steps[min(step, len(self.steps) - 1)]

    @property
    def varies(self) -> bool:
        return len(set(self.steps)) > 1

    def __str__(self) -> str:
        runs: list[list] = []
        for routing in self.steps:
            if runs and runs[-1][0] == routing:
                runs[-1][1] += 1
            else:
                runs.append([routing, 1])
        return ",".join(f"{r}*{n}" if n > 1 else str(r) for r, n in runs)


@dataclass(frozen=True)
class Offload:
    """--offload: what moves to pinned host memory."""

    activations: bool = False
    """The tensors autograd saves in the forward (saved-tensor hooks)."""
    params: bool = False
    """FSDP2's CPUOffloadPolicy: sharded parameters, gradients and optimizer state."""

    @classmethod
    def parse(cls, text: str) -> Offload:
        parts = text.split("+")
        if text == "none":
            return cls()
        if all(p in OFFLOAD_PARTS for p in parts) and len(set(parts)) == len(parts):
            return cls(activations="activations" in parts, params="params" in parts)
        raise OptionError(f"unknown offload '{text}': use none, activations, params or activations+params "
                          "(params: FSDP2's CPUOffloadPolicy, plan with an fsdp strategy)")

    def __str__(self) -> str:
        return "+".join(p for p in OFFLOAD_PARTS if getattr(self, p)) or "none"


@dataclass(frozen=True)
class Quantize:
    """--quantize: the frozen base's linear layers in bitsandbytes."""

    kind: Literal["none", "nf4", "fp4", "int8"]
    double: bool = False
    """-dq: double quantization of the absmax (BitsAndBytesConfig's bnb_4bit_use_double_quant)."""

    @classmethod
    def parse(cls, text: str) -> Quantize:
        if text not in QUANTIZE:
            raise OptionError(f"unknown quantize '{text}': use one of {', '.join(QUANTIZE)} "
                              "(-dq: double quantization, as BitsAndBytesConfig's bnb_4bit_use_double_quant)")
        return cls(text.removesuffix("-dq"), text.endswith("-dq"))  # type: ignore[arg-type]

    def __str__(self) -> str:
        return self.kind + "-dq" * self.double


@dataclass(frozen=True)
class LoRA:
    """--lora: PEFT LoRA adapters (None on StepOptions for 'none')."""

    r: int
    alpha: int | None = None
    """None: PEFT's default."""
    dora: bool = False
    targets: tuple[str, ...] | None = None
    """Endings of the linear layers' names; None: every linear layer but the output head."""

    @classmethod
    def parse(cls, text: str) -> LoRA | None:
        """None for 'none'; a one-line OptionError that shows the grammar otherwise."""
        if text == "none":
            return None
        spec: dict = {"r": None, "alpha": None, "dora": False, "targets": None}
        bad = OptionError(f"bad `lora` '{text}': use none or {LORA}, e.g. r=16 or r=16,dora,targets=q_proj+v_proj")
        for part in text.split(","):
            key, _, arg = part.strip().partition("=")
            if key in ("r", "alpha") and _positive_int(arg) is not None and spec[key] is None:
                spec[key] = int(arg)
            elif key == "dora" and not arg and not spec["dora"]:
                spec["dora"] = True
            elif key == "targets" and arg and spec["targets"] is None and all(arg.split("+")):
                spec["targets"] = tuple(arg.split("+"))
            else:
                raise bad
        if spec["r"] is None:
            raise bad
        return cls(**spec)

    def __str__(self) -> str:
        return ",".join([f"r={self.r}", *([f"alpha={self.alpha}"] if self.alpha is not None else []),
                         *(["dora"] if self.dora else []),
                         *([f"targets={'+'.join(self.targets)}"] if self.targets else [])])


@dataclass(frozen=True)
class ParamGroups:
    """--param-groups: how the optimizer's parameter groups split the trainable parameters. A foreach
    optimizer (torch's default on CUDA) makes its temporaries per group and frees them before the next
    group, and a for-loop one holds each parameter's last temporary into the next: the split and its order
    move the optimizer's peak (``tests/test_param_groups.py``)."""

    decay_split: bool = False
    """The HF Trainer's two groups (``Trainer.create_optimizer``): the weights first, then the biases and
    norm weights (``Trainer.get_decay_parameter_names``); False: one group in the model's order."""
    weight_decay: float = 0.0
    """The first group's weight decay (the second has none): AdamW decays in place, SGD and Adam add it to
    a copy of the gradients (a temporary the size of the group's gradients)."""

    @classmethod
    def parse(cls, text: str) -> ParamGroups:
        if text == "one":
            return cls()
        kind, _, value = text.partition(":")
        try:
            decay = float(value)
        except ValueError:
            decay = -1.0
        if kind != "decay" or not math.isfinite(decay) or decay < 0:
            raise OptionError(f"unknown param groups '{text}': use one or decay:WD (the HF Trainer's two groups, "
                              "weight decay WD >= 0 on the weights, e.g. decay:0.01)")
        return cls(True, decay)

    def __str__(self) -> str:
        return f"decay:{self.weight_decay:g}" if self.decay_split else "one"


SAMPLING_SETTINGS: tuple[str, ...] = ("repetition_penalty", "min_length", "min_new_tokens", "temperature", "top_k",
                                     "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")
"""The GenerationConfig settings that add a logits processor to transformers' sampling, as ``generate`` builds them
(``GenerationMixin._get_logits_processor``), in its order; traced in ``zoo/hf_sampling.py``."""


def adds_logits_processor(name: str, value: float) -> bool:
    """Whether ``generate`` adds the logits processor of the sampling setting ``name`` at ``value``
    (``_get_logits_processor``'s conditions; min_new_tokens always adds one: generate makes it a min_length of the
    prompt's length plus it, whose processor runs even at 0)."""
    if name in ("temperature", "repetition_penalty"):
        return value != 1.0
    if name in ("top_p", "typical_p"):
        return value < 1.0
    if name in ("epsilon_cutoff", "eta_cutoff"):
        return 0.0 < value < 1.0
    if name == "top_k":
        return value != 0
    if name == "min_length":
        return value > 0
    return True  # min_p, min_new_tokens


@dataclass(frozen=True, kw_only=True)
class Rollout:
    """An RL step's generation settings (``zoo/grpo.py``): from a TRL GRPOConfig / PPOConfig
    (``integrations/trainer_mapper.py``), else the zoo's GRPO step's own."""

    prompt_len: int = 32
    """Tokens per prompt (TRL's max_prompt_length: prompts are left-padded to the longest, at most this)."""
    new_tokens: int = 144
    """Tokens generated per completion (max_completion_length; PPO's response_length)."""
    group_size: int = 8
    """Completions per prompt (num_generations): rewards are normalised within each group."""
    steps_per_generation: int = 1
    """Update steps each generation serves: the generation batch is this many update batches."""
    reference: bool = True
    """A frozen reference model scores every completion (TRL loads one where beta is not 0)."""
    old_logprobs: bool = False
    """The policy's own log-probs computed with no gradients before the update (TRL: when a
    generation serves more than one optimizer step, or num_iterations > 1)."""
    algorithm: str = "grpo"
    """grpo (``zoo/grpo.py``) or ppo (``zoo/hf_ppo.py``: a trained value model beside the policy, a reward
    model, and generation that keeps every step's logits)."""
    chunk_rows: int | None = None
    """PPO's local_rollout_forward_batch_size: the rows generated and scored at once (None: all of them)."""
    fp32_head: bool = False
    """TRL's cast_lm_head_to_fp32 (GRPO): the policy's and the reference's LM head kept in fp32 whatever the
    precision (its weight, gradient and optimizer state), run outside autocast on an fp32 copy of the hidden
    states (``zoo/fused_logprobs.py``: fp32 tiles)."""
    sampling: tuple[tuple[str, float], ...] = ()
    """GenerationConfig settings (SAMPLING_SETTINGS) generation samples with, as TRL passes them to transformers'
    ``generate`` (GRPOConfig's temperature, top_k, top_p, min_p, repetition_penalty and its generation_kwargs): each
    adds a logits processor whose fp32 ``[rows, vocab]`` temporaries are traced at every new token. A setting at
    its no-op value (temperature 1, top_k 0, top_p 1, ...) adds none, as in ``generate``."""

    def __post_init__(self) -> None:
        if self.algorithm not in ("grpo", "ppo"):
            raise OptionError(f"unknown RL algorithm '{self.algorithm}': grpo or ppo")
        if self.chunk_rows is not None and (not isinstance(self.chunk_rows, int) or self.chunk_rows < 1):
            raise OptionError(f"the rollout's chunk_rows must be a positive integer, got {self.chunk_rows!r}")
        for name, value in self.sampling:
            if name not in SAMPLING_SETTINGS or isinstance(value, bool) or not isinstance(value, (int, float)):
                raise OptionError(f"the rollout's sampling setting {name}={value!r} is not one batchfit traces: "
                                  f"a number for one of {', '.join(SAMPLING_SETTINGS)}")
        for name in ("prompt_len", "new_tokens", "group_size", "steps_per_generation"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise OptionError(f"the rollout's {name} must be a positive integer, got {value!r}")

    @property
    def batch_multiple(self) -> int:
        """The update batch's granularity: a generation batch (``steps_per_generation`` update batches)
        must hold whole groups."""
        return self.group_size // math.gcd(self.group_size, self.steps_per_generation)
