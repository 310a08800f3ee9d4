"""What a HF TrainingArguments / TRL SFTConfig holds, as batchfit reads it: the tables of fields
(which change memory and how), the record of each field's use, and the mapping's result. Data
only: ``trainer_mapper.py`` fills a :class:`TrainerMapping` from them, ``trainer_args.py`` is the
entry point."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

SECTIONS = ("peft_config", "quantization_config")
"""Sections batchfit reads beside the TrainingArguments fields (its own design, see the module)."""

TRL_FIELDS = frozenset({
    # trl/trainer/sft_config.py: SFTConfig's own fields (TRL need not be installed to read them)
    "model_init_kwargs", "chat_template_path", "dataset_text_field", "dataset_kwargs", "dataset_num_proc",
    "eos_token", "pad_token", "max_length", "max_seq_length", "truncation_mode", "shuffle_dataset", "packing",
    "packing_strategy", "padding_free", "pad_to_multiple_of", "eval_packing", "completion_only_loss",
    "assistant_only_loss", "loss_type", "activation_offloading", "dataset_batch_size", "use_liger",
    "model_init_kwargs", "dataset_test_split", "dataset_train_split",
})

GRPO_FIELDS = frozenset({
    # trl/trainer/grpo_config.py: GRPOConfig's own fields, those of TRL's current version and the ones
    # earlier versions had (max_prompt_length, wandb_log_unique_prompts, ...); TRL need not be installed
    "num_generations", "num_generations_eval", "max_prompt_length", "max_completion_length", "generation_batch_size",
    "steps_per_generation", "beta", "num_iterations", "disable_dropout", "cast_lm_head_to_fp32",
    "ds3_gather_for_generation", "trust_remote_code", "router_aux_loss_coef", "pad_to_multiple_of",
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "generation_kwargs", "chat_template_kwargs",
    "use_transformers_paged", "use_transformers_continuous_batching", "transformers_continuous_batching_config",
    "cache_implementation", "use_vllm", "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode",
    "vllm_guided_decoding_regex", "vllm_structured_outputs_regex", "vllm_server_base_url", "vllm_server_host",
    "vllm_server_port", "vllm_server_timeout", "vllm_group_port", "vllm_gpu_memory_utilization",
    "vllm_max_model_length", "vllm_tensor_parallel_size", "epsilon", "epsilon_high", "delta", "sapo_temperature_neg",
    "sapo_temperature_pos", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg",
    "importance_sampling_level", "reward_weights", "multi_objective_aggregation", "scale_rewards",
    "mask_truncated_completions", "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps",
    "top_entropy_quantile", "entropy_coef", "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max",
    "entropy_coef_delta", "entropy_target", "max_tool_calling_iterations", "use_liger_loss",
    "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min", "vllm_importance_sampling_cap", "off_policy_mask_threshold",
    "use_bias_correction_kl", "log_completions", "log_multimodal", "num_completions_to_print", "log_unique_prompts",
    "log_completions_hub_repo", "wandb_log_unique_prompts", "shuffle_dataset", "remove_unused_columns",
})

PPO_FIELDS = frozenset({
    # trl/trainer/ppo_config.py (with OnPolicyConfig): the fields that tell a PPOConfig
    "response_length", "local_rollout_forward_batch_size", "num_mini_batches", "num_ppo_epochs", "whiten_rewards",
    "kl_coef", "kl_estimator", "cliprange", "vf_coef", "cliprange_value", "gamma", "lam", "reward_model_path",
    "sft_model_path", "stop_token", "stop_token_id", "missing_eos_penalty", "total_episodes", "local_mini_batch_size",
    "num_sample_generations", "model_adapter_name", "ref_adapter_name", "micro_batch_size", "local_batch_size",
    "batch_size", "mini_batch_size", "num_total_batches", "dataset_num_proc", "temperature",
})
PPO_MARKS = ("response_length", "local_rollout_forward_batch_size", "num_ppo_epochs", "vf_coef")
"""Fields only a PPOConfig has: args holding one are read as PPO's."""

RL_MEMORY_FIELDS_NOT_MAPPED: dict[str, str] = {
    # GRPOConfig fields that change memory, not traced
    "use_vllm": "generation in vLLM (its own engine and KV cache, colocated or on a server) is not traced: the "
                "generation phase is traced as transformers' sampling on the policy",
    "vllm_mode": "vLLM is not traced",
    "vllm_gpu_memory_utilization": "vLLM is not traced (colocated, it reserves this fraction of the GPU)",
    "vllm_enable_sleep_mode": "vLLM is not traced",
    "use_liger_loss": "Liger's fused GRPO loss is not traced: the log-probs come from TRL's own fused LM head",
    "cache_implementation": "the KV cache is traced as transformers' DynamicCache, not this implementation",
    "use_transformers_paged": "paged generation is not traced: DynamicCache is",
    "generation_kwargs": "only its sampling settings (min_new_tokens, top_k, top_p, ...) are read; others (beams, "
                         "no_repeat_ngram_size, bad_words_ids, ...) are not: plain sampling is traced",
    "top_entropy_quantile": "the entropies this computes (one more pass over the logits) are not traced",
    "ds3_gather_for_generation": "ZeRO-3 gathering the weights for generation is plan's, not estimate's",
    "num_generations_eval": "the eval loop of an RL trainer is not traced",
    "entropy_coef": "an entropy bonus's gradient (folded into TRL's fused head's tiles) is not traced",
    "use_transformers_continuous_batching": "continuous-batching generation is not traced: DynamicCache is",
    "vllm_max_model_length": "vLLM is not traced",
}

OPTIMIZERS_BY_OPTIM: dict[str, tuple[tuple[str, ...], str]] = {
    # transformers' OptimizerNames -> batchfit's --optimizer (first one this batchfit accepts), and what
    # differs (transformers/trainer_optimizer.py, _OPTIMIZER_HANDLERS)
    "adamw_torch": (("adamw",), ""),
    "adamw_torch_fused": (("adamw",), "fused AdamW holds the same two fp32 states; it also keeps each "
                                      "parameter's step counter on the GPU (one 512-byte block each)"),
    "adamw_hf": (("adamw",), ""),
    "adamw_torch_xla": (("adamw",), ""),
    "adamw_torch_npu_fused": (("adamw",), ""),
    "adamw_apex_fused": (("adamw",), ""),
    "adafactor": (("adafactor",), "transformers' Adafactor traced as torch.optim.Adafactor: both keep factored "
                                  "second moments"),
    "sgd": (("sgd",), ""),
    "adamw_bnb_8bit": (("adamw-8bit",), ""),
    "adamw_8bit": (("adamw-8bit",), ""),
    "paged_adamw_8bit": (("paged-adamw-8bit",), ""),
    "lion_8bit": (("lion-8bit",), ""),
    "paged_lion_8bit": (("paged-lion-8bit",), ""),
    "paged_adamw_32bit": (("paged-adamw-32bit", "paged-adamw"), ""),
    "lion_32bit": (("lion-32bit", "lion"), ""),
    "paged_lion_32bit": (("paged-lion-32bit", "paged-lion"), ""),
    "adamw_torch_8bit": (("adamw-torchao-8bit",), ""),
    "adamw_torch_4bit": (("adamw-torchao-4bit",), ""),
}
"""Every other optim value (ademamix, galore, apollo, lomo, rmsprop, adagrad, schedule-free, ...)
is listed unused: its state is not what any batchfit optimizer holds."""

NO_MEMORY = "does not change training memory"

MEMORY_FIELDS_NOT_MAPPED: dict[str, str] = {
    # fields that do change memory, with why they are not traced
    "label_smoothing_factor": "the Trainer's LabelSmoother takes a log-softmax of the whole logits, not traced",
    "max_grad_norm": "gradient clipping (clip_grad_norm_: one norm per parameter tensor, small) is not traced",
    "torch_empty_cache_steps": "emptying the cache changes reserved memory between steps, not the peak",
    "neftune_noise_alpha": "NEFTune's noise on the embeddings (one activation more) is not traced",
    "ddp_bucket_cap_mb": "DDP's buckets are traced at torch's default size (plan)",
    "auto_find_batch_size": "batchfit answers that question itself: see per_device_train_batch_size below",
    "padding_free": "padding-free batches (one flattened sequence) are traced as padded [batch, seq_len]",
    "loss_type": "TRL's chunked_nll / dft losses are traced as the model's own loss (--loss chunked:N is the "
                 "nearest; give it as a flag)",
    "torch_compile_mode": "the compile mode (e.g. max-autotune) is not traced; --compile model is",
    "torch_compile_backend": "the compile backend is not traced; --compile model (inductor) is",
    "liger_kernel_config": "Liger's other kernels (RMSNorm, RoPE, SwiGLU) are not traced; --loss fused-linear is",
    "optim_args": "hyper-parameters of the optimizer, not its state",
    "optim_target_modules": "GaLore / APOLLO target modules: those optimizers are not traced",
    "half_precision_backend": "apex is not traced",
    "parallelism_config": "accelerate's ParallelismConfig is not read (give plan --strategies)",
    "full_determinism": "enable_full_determinism sets CUBLAS_WORKSPACE_CONFIG=:16:8 (128 KiB a cuBLAS handle, traced "
                        "at torch's default, 32 MiB on sm90+: high by up to 64 MiB) and deterministic algorithms, "
                        "whose kernels' own scratch is not traced",
    "prediction_loss_only": "the eval loop then keeps no logits; it is traced keeping them (high)",
    "batch_eval_metrics": "compute_metrics then runs per eval batch, keeping no logits across eval steps; traced as "
                          "eval_accumulation_steps says (high where that is above 1)",
    "include_for_metrics": "the eval inputs kept beside the logits for compute_metrics are not traced (token ids: "
                           "small beside the logits)",
    "debug": "underflow_overflow's forward hooks (an abs-max of every module's output) are not traced",
}

OUTSIDE_THE_STEP: dict[str, str] = {
    # fields that change memory, but not the training step's: listed, not shown in the terminal
    "use_cpu": "batchfit sizes the GPU given with --gpu",
    "bf16_full_eval": "the eval loop is traced at the training precision, not on a half-precision copy",
    "fp16_full_eval": "the eval loop is traced at the training precision, not on a half-precision copy",
    "accelerator_config": "accelerate's data-loading settings are outside the training step",
}


@dataclass(kw_only=True)
class FieldUse:
    """One field of the args and what batchfit made of it."""

    field: str
    """The field's name, as in the args (peft_config.r for a section's key)."""
    value: Any
    """Its value, as read."""
    option: str = ""
    """The batchfit option it became (``--precision bf16-mixed``); empty when unused."""
    why: str = ""
    """For an unused field: why. For a used one: what differs from what the Trainer runs, if anything."""

    def line(self) -> str:
        value = self.value if isinstance(self.value, str) else json.dumps(_plain(self.value), default=str)
        if self.option:
            return f"{self.field}={value} -> {self.option}" + (f" ({self.why})" if self.why else "")
        return f"not used: {self.field}={value} ({self.why})"

    def to_json(self) -> dict:
        value = json.loads(json.dumps(_plain(self.value), default=str))  # a .py file's args may hold any object
        return {"field": self.field, "value": value, **({"option": self.option} if self.option else {}),
                "why": self.why}

    @property
    def matters(self) -> bool:
        """Worth a terminal line: it changes memory, or it was set (unknown fields always)."""
        if self.why == NO_MEMORY or self.field in OUTSIDE_THE_STEP:
            return False
        return self.value not in (None, False, 0, "", [], {}, "no")


@dataclass(kw_only=True)
class TrainerMapping:
    """A TrainingArguments in batchfit's terms."""

    step: dict[str, Any] = field(default_factory=dict)
    """StepOptions keyword arguments (only those the args set)."""
    seq_len: int | None = None
    """Tokens per sample (max_length / max_seq_length); None: the model's."""
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    packing: bool = False
    """TRL's ``packing``: samples packed into rows of max_length (``--batching pack:max_length`` with --data)."""
    per_device_eval_batch_size: int | None = None
    """Set when the args evaluate (eval_strategy not 'no'): ``estimate`` traces the eval loop at it."""
    eval_accumulation_steps: int | None = None
    """Eval steps whose logits the Trainer holds on the device together (None: not set)."""
    rollout: Any = None
    """A TRL GRPOConfig's generation settings (``options.Rollout``): the step traced is the GRPO step
    (``zoo/grpo.py``); None for a supervised TrainingArguments / SFTConfig."""
    world_size: int = 1
    """Devices the args train on (1 unless given: a saved TrainingArguments does not record it)."""
    strategy: str | None = None
    """plan's strategy for fsdp / deepspeed (None: one device or DDP)."""
    used: list[FieldUse] = field(default_factory=list)
    unused: list[FieldUse] = field(default_factory=list)

    @property
    def global_batch(self) -> int:
        """per_device_train_batch_size x gradient_accumulation_steps x world size."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.world_size

    def flags(self, command: str = "estimate") -> list[str]:
        """The equivalent batchfit flags, e.g. ['--precision', 'bf16-mixed', '--batch-sizes', '4']."""
        flags: list[str] = []
        for name, value in self.step.items():
            if name == "accumulation_steps":
                if command != "plan":
                    flags += ["--accumulation-steps", str(value)]
                continue
            flags += [f"--{name.replace('_', '-')}", str(value)]
        if self.seq_len is not None:
            flags += ["--seq-len", str(self.seq_len)]
        if command == "plan" and self.strategy:
            flags += ["--strategies", self.strategy]
        if command in ("estimate", "plan"):
            flags += ["--batch-sizes", str(self.per_device_train_batch_size)]
        return flags

    def to_json(self) -> dict:
        return {"step_options": dict(self.step), "seq_len": self.seq_len,
                "per_device_train_batch_size": self.per_device_train_batch_size,
                "gradient_accumulation_steps": self.gradient_accumulation_steps, "world_size": self.world_size,
                "packing": self.packing, "per_device_eval_batch_size": self.per_device_eval_batch_size,
                "eval_accumulation_steps": self.eval_accumulation_steps,
                "rollout": dataclasses.asdict(self.rollout) if self.rollout is not None else None,
                "global_batch": self.global_batch, "strategy": self.strategy,
                "trainer_fields_used": [u.to_json() for u in self.used],
                "trainer_fields_unused": [u.to_json() for u in self.unused]}


def traced_in_a_trainer(mapping: TrainerMapping, say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The StepOptions of a step traced from inside a Trainer (the HF and Lightning
    integrations): the mapping's, less the optimizer and its parameter groups (the integration
    traces the Trainer's own optimizer object, or the HF Trainer's groups where it builds it) and the
    accumulation (the integration picks it for the global batch).
    ``say`` gets a line for each unused field that can change memory, and for a sharded
    strategy (the integrations trace one device's whole step)."""
    for use in mapping.unused:
        if use.matters and say is not None:
            say(use.line())
    if mapping.strategy and mapping.strategy != "ddp" and say is not None:
        say(f"not traced: the {mapping.strategy} strategy (one device's whole step is traced, an upper bound); "
            f"batchfit plan --strategies {mapping.strategy} traces it sharded")
    return {k: v for k, v in mapping.step.items() if k not in ("optimizer", "param_groups", "accumulation_steps")}


def args_to_dict(args: Any) -> dict[str, Any]:
    """A TrainingArguments object (or any dataclass / object / mapping) as the dict its
    ``to_json_string()`` would write: ``to_dict()`` where it has one (enums become strings)."""
    if isinstance(args, Mapping):
        return dict(args)
    if hasattr(args, "to_dict"):
        data = dict(args.to_dict())
    elif dataclasses.is_dataclass(args):
        data = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    else:
        data = {k: v for k, v in getattr(args, "__dict__", {}).items() if not k.startswith("_")}
    return {k: getattr(v, "value", v) for k, v in data.items()}


def _plain(value: Any) -> Any:
    """A JSON-able form of a config value (PEFT keeps target_modules as a set)."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, (str, int, float, bool, type(None), list, dict)):
        return value
    return str(value)
