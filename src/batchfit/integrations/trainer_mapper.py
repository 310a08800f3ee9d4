"""The field-by-field mapping behind :func:`batchfit.integrations.trainer_args.from_training_arguments`:
one handler per concern (batch, precision, checkpointing, optimizer, sequence, kernels,
sharding, PEFT, quantization), each marking the fields it read as used or unused."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from batchfit.errors import OptionError
from batchfit.integrations.trainer_fields import (
    MEMORY_FIELDS_NOT_MAPPED,
    NO_MEMORY,
    OPTIMIZERS_BY_OPTIM,
    OUTSIDE_THE_STEP,
    PPO_MARKS,
    RL_MEMORY_FIELDS_NOT_MAPPED,
    FieldUse,
    TrainerMapping,
    _plain,
    args_to_dict,
)
from batchfit.workload import HF_ATTENTION

PROMPT_TOKENS = 512
"""Prompt tokens traced where a GRPOConfig has no max_prompt_length (TRL's former default; its current
GRPOConfig does not cut prompts, so the args cannot say)."""


class Mapper:
    """One pass over the fields; each handler marks what it read."""

    def __init__(self, data: dict, world_size: int, deepspeed_config: Mapping | None,
                 fields: frozenset[str] | None) -> None:
        self.data, self.fields, self.deepspeed_config = data, fields, deepspeed_config
        self.mapping = TrainerMapping(world_size=world_size)
        self.seen: set[str] = set()

    # -- bookkeeping
    def use(self, name: str, option: str, why: str = "", value: Any = None) -> None:
        self.seen.add(name.split(".")[0])
        self.mapping.used.append(FieldUse(field=name, value=self.data.get(name) if value is None else value,
                                          option=option, why=why))

    def skip(self, name: str, why: str, value: Any = None) -> None:
        self.seen.add(name.split(".")[0])
        self.mapping.unused.append(FieldUse(field=name, value=self.data.get(name) if value is None else value,
                                            why=why))

    def set_step(self, name: str, value: Any, source_field: str, why: str = "", shown: Any = None) -> bool:
        """Set StepOptions' ``name`` if this batchfit has the field and takes ``value``; else unused."""
        from batchfit.workload import StepOptions

        if name == "offload" and self.mapping.step.get("offload", "none") not in ("none", value):
            value = f"{self.mapping.step['offload']}+{value}"  # DeepSpeed offloads optimizer and parameters
        option = "--accumulation-steps" if name == "accumulation_steps" else f"--{name.replace('_', '-')}"
        if name not in {f.name for f in dataclasses.fields(StepOptions)}:
            self.skip(source_field, f"this batchfit has no {option} option yet", shown)
            return False
        try:
            StepOptions(**{name: value})
        except OptionError as error:
            self.skip(source_field, f"this batchfit cannot take {option} {value}: {error}", shown)
            return False
        before = self.mapping.step.get(name)
        if before is not None and before != value and name != "offload":
            why = f"{why}; it replaces {option} {before}" if why else f"it replaces {option} {before}"
        self.mapping.step[name] = value
        self.use(source_field, f"{option} {value}", why, shown)
        return True

    def run(self) -> TrainerMapping:
        data = self.data
        self.batch()
        self.rollout()
        self.evaluation()
        self.precision()
        self.checkpointing()
        self.optimizer()
        self.sequence()
        self.kernels()
        self.sharding()
        self.peft(data.get("peft_config"))
        quantization = data.get("quantization_config")
        init_kwargs = data.get("model_init_kwargs")
        if isinstance(init_kwargs, Mapping):
            quantization = self.model_init(init_kwargs, quantization)
        self.quantization(quantization)
        for name, value in data.items():
            if name in self.seen or name == "world_size":
                continue
            if name in MEMORY_FIELDS_NOT_MAPPED or name in OUTSIDE_THE_STEP or name in RL_MEMORY_FIELDS_NOT_MAPPED:
                self.skip(name, MEMORY_FIELDS_NOT_MAPPED.get(name) or OUTSIDE_THE_STEP.get(name)
                          or RL_MEMORY_FIELDS_NOT_MAPPED[name])
            elif self.fields is not None and name not in self.fields:
                self.skip(name, "not a field of the TrainingArguments / SFTConfig batchfit knows")
            else:
                self.skip(name, NO_MEMORY)
        return self.mapping

    # -- the handlers, one concern each
    def batch(self) -> None:
        m, data = self.mapping, self.data
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
            value = data.get(name)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise OptionError(f"{name} must be a positive integer, got {value!r}")
            if name == "per_device_train_batch_size":
                m.per_device_train_batch_size = value
                self.use(name, f"--batch-sizes {value}", "traced as one of the sizes, to say whether it fits")
            elif self.set_step("accumulation_steps", value, name):
                m.gradient_accumulation_steps = value
        if "gradient_accumulation_steps" in data and "accumulation_steps" not in m.step:
            m.gradient_accumulation_steps = data["gradient_accumulation_steps"]

    def _count(self, name: str, default: int | None) -> int | None:
        """A positive integer field (``default`` where the args do not set it)."""
        value = self.data.get(name, default)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise OptionError(f"{name} must be a positive integer, got {value!r}")
        return value

    def rollout(self) -> None:
        """A TRL GRPOConfig's generation settings -> the GRPO step (``options.Rollout``), with TRL's
        defaults and checks (trl/trainer/grpo_config.py, grpo_trainer.py). A PPOConfig is refused:
        its value model trains beside the policy, which no traced step has yet."""
        from batchfit.options import Rollout

        data, m = self.data, self.mapping
        if any(n in data for n in PPO_MARKS) and not any(n in data for n in ("num_generations",
                                                                              "max_completion_length")):
            self.ppo_rollout()
            return
        if not any(n in data for n in ("num_generations", "max_completion_length", "max_prompt_length",
                                       "steps_per_generation", "generation_batch_size")):
            return
        group = self._count("num_generations", 8)
        prompt = self._count("max_prompt_length", PROMPT_TOKENS)
        if prompt is None:
            raise OptionError("max_prompt_length is null (prompts not cut): give the longest prompt's tokens as "
                              "max_prompt_length, the length every generation is traced at")
        new_tokens = self._count("max_completion_length", 512)
        per_step = self._count("steps_per_generation", None)
        global_generation = self._count("generation_batch_size", None)
        update = m.per_device_train_batch_size * m.world_size
        # A saved GRPOConfig holds both (its __post_init__ fills one from the other): steps_per_generation is
        # per device, so it is the one read; generation_batch_size only where it is alone
        if per_step is None and global_generation is not None:
            if global_generation % update:
                raise OptionError(f"generation_batch_size {global_generation} must be a multiple of "
                                  f"per_device_train_batch_size x devices ({update}), as TRL requires")
            per_step = global_generation // update
        per_step = per_step or m.gradient_accumulation_steps
        if (update * per_step) % group:
            raise OptionError(f"the generation batch ({update * per_step} completions) must be a multiple of "
                              f"num_generations ({group}), as TRL requires: change one of them")
        beta, iterations = data.get("beta", 0.0), self._count("num_iterations", 1)
        old = (m.gradient_accumulation_steps % (per_step * iterations) != 0
               or bool(data.get("use_vllm") and data.get("vllm_importance_sampling_correction", True)))
        fp32_head = bool(data.get("cast_lm_head_to_fp32"))
        m.rollout = Rollout(prompt_len=prompt, new_tokens=new_tokens, group_size=group, steps_per_generation=per_step,
                            reference=bool(beta), old_logprobs=old, fp32_head=fp32_head, sampling=self.sampling())
        rows = m.per_device_train_batch_size * per_step
        self.use("num_generations", f"GRPO group {group}", "rewards normalised within each group", group)
        self.use("max_prompt_length", f"{prompt}-token prompts", "every prompt traced at the longest" if
                 "max_prompt_length" in data else "not in the args (TRL's current GRPOConfig does not cut prompts): "
                 f"traced at {PROMPT_TOKENS} tokens; give max_prompt_length for your longest prompt", prompt)
        self.use("max_completion_length", f"{new_tokens} new tokens", "every completion traced at the longest, its "
                 "KV cache growing token by token", new_tokens)
        for name in ("steps_per_generation", "generation_batch_size"):
            if name in data:
                self.use(name, f"{per_step} update steps per generation", f"each generation makes {rows} completions "
                         "per device (per_device_train_batch_size x steps per generation)"
                         + ("; steps_per_generation is the one read" if name == "generation_batch_size"
                            and "steps_per_generation" in data else ""))
        self.use("beta", "a frozen reference model" if beta else "no reference model",
                 "its log-probs traced in their own phase, before the update" if beta else
                 "TRL loads none where beta is 0", beta)
        if "num_iterations" in data or old:
            self.use("num_iterations", "the policy's old log-probs computed before the update" if old else
                     "on-policy: no old log-probs", "TRL computes them when a generation serves more than one "
                     "optimizer step", iterations)
        if fp32_head:
            self.use("cast_lm_head_to_fp32", "the LM head in fp32", "the policy's and the reference's head weight (its "
                     "gradient and optimizer state) in fp32 whatever the precision, run outside autocast on fp32 "
                     "hidden states: fp32 tiles in TRL's fused head")
        elif "cast_lm_head_to_fp32" in data:
            self.skip("cast_lm_head_to_fp32", "off")
        if "loss_type" in data:
            self.skip("loss_type", "GRPO's loss normalisations (grpo, dapo, dr_grpo, bnpo, ...) hold no more memory "
                      "than the traced one")
        for use in m.used:
            if use.field == "gradient_accumulation_steps" and use.value > 1:
                use.why = ("each micro-batch traced with its own generation: those after the first generate beside "
                           "the accumulated gradients, which TRL's one generation per optimizer step does not (high "
                           "by the gradients' bytes in the generation and reference phases, never low)")

    def sampling(self) -> tuple[tuple[str, float], ...]:
        """The sampling settings TRL hands generate (``trainer_sampling.py``): each that adds a logits processor (a
        field at a value that adds none, as TRL's defaults, is left to "does not change training memory")."""
        from batchfit.integrations.trainer_sampling import sampling

        read = sampling(self.data)
        why = "transformers' logits processor for it runs on every new token's fp32 logits: its temporaries traced"
        for name in read.from_fields:
            self.use(name, f"sampling with {name} {dict(read.settings)[name]}", why)
        if read.from_kwargs:
            not_read = (f"; not read, traced as plain sampling: {', '.join(read.kwargs_not_read)}"
                        if read.kwargs_not_read else "")
            self.use("generation_kwargs", "sampling with " + ", ".join(
                f"{name} {dict(read.settings)[name]}" for name in read.from_kwargs), why + not_read)
        return read.settings

    def ppo_rollout(self) -> None:
        """A TRL PPOConfig (trl/experimental/ppo/ppo_config.py) -> TRL's PPO step (``zoo/hf_ppo.py``): a rollout
        of per-device batch x gradient accumulation x mini-batches queries, generated and scored
        local_rollout_forward_batch_size rows at a time."""
        from batchfit.options import Rollout

        data, m = self.data, self.mapping
        new_tokens = self._count("response_length", 53)
        chunk = self._count("local_rollout_forward_batch_size", 64)
        minis = self._count("num_mini_batches", 1)
        per_rollout = m.gradient_accumulation_steps * minis
        prompt = self._count("max_prompt_length", PROMPT_TOKENS) or PROMPT_TOKENS
        m.rollout = Rollout(prompt_len=prompt, new_tokens=new_tokens, group_size=1,
                            steps_per_generation=per_rollout, algorithm="ppo",
                            chunk_rows=min(chunk, m.per_device_train_batch_size * per_rollout))
        self.use("response_length", f"{new_tokens} new tokens", "every response traced at the longest, every new "
                 "token's logits kept (generate's output_scores)", new_tokens)
        self.use("local_rollout_forward_batch_size", f"{chunk} rows generated and scored at once",
                 "TRL's batch_generation and scoring chunks", chunk)
        self.use("num_mini_batches", f"{per_rollout} micro-batches per rollout", "the rollout holds per-device batch "
                 "x gradient_accumulation_steps x num_mini_batches queries", minis)
        self.use("max_prompt_length", f"{prompt}-token queries", "not a PPOConfig field: batchfit reads it for the "
                 "queries' length, which the dataset's tokenization sets" if "max_prompt_length" in data else
                 f"a PPOConfig says nothing of the queries' length: traced at {PROMPT_TOKENS} tokens; add "
                 "max_prompt_length to the args for your longest query", prompt)
        for name in ("sft_model_path", "reward_model_path"):
            if name in data:
                self.skip(name, "the value and reward models are traced as the policy's architecture with one score "
                          "head (TRL loads them from these paths: another size there is not traced)")
        if "num_ppo_epochs" in data:
            self.skip("num_ppo_epochs", "each epoch passes over the same rollout again: no more memory")

    def evaluation(self) -> None:
        """per_device_eval_batch_size and eval_accumulation_steps, where the args evaluate at all."""
        m, data = self.mapping, self.data
        strategy = str(data.get("eval_strategy", data.get("evaluation_strategy")) or "no").lower()
        evaluates = strategy.rsplit(".", 1)[-1] != "no" or bool(data.get("do_eval"))
        for name in ("per_device_eval_batch_size", "eval_accumulation_steps"):
            value = data.get(name)
            if name not in data:
                continue
            if not evaluates:
                self.skip(name, f"eval_strategy {strategy}: no evaluation runs")
            elif value is None:
                self.skip(name, "not set: with compute_metrics the Trainer keeps every eval step's logits on the "
                                "device until the loop ends; traced: one step's (give --eval-accumulation-steps K)")
            elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise OptionError(f"{name} must be a positive integer, got {value!r}")
            elif name == "per_device_eval_batch_size":
                m.per_device_eval_batch_size = value
                self.use(name, f"--eval-batch-size {value}", "the eval loop traced after the training step "
                                                             "(estimate); the larger peak decides")
            else:
                m.eval_accumulation_steps = value
                self.use(name, f"--eval-accumulation-steps {value}", "the logits of this many eval steps held on "
                                                                     "the device together (with compute_metrics)")

    def precision(self) -> None:
        bf16, fp16 = bool(self.data.get("bf16")), bool(self.data.get("fp16"))
        if bf16 and fp16:
            raise OptionError("the args set both bf16 and fp16: the Trainer refuses that too; keep one")
        for name, on, value in (("bf16", bf16, "bf16-mixed"), ("fp16", fp16, "fp16-mixed")):
            if on:
                self.set_step("precision", value, name, "autocast over fp32 weights, as the Trainer runs it")
            elif name in self.data:
                self.skip(name, "off")
        if "tf32" in self.data:
            self.skip("tf32", "TF32 changes how fp32 matmuls round, not the bytes they hold")

    def checkpointing(self) -> None:
        data = self.data
        on_name = next((n for n in ("activation_checkpointing", "gradient_checkpointing") if data.get(n)), None)
        kwargs_name = next((n for n in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs")
                            if data.get(n)), None)
        if on_name is None:
            for name in ("activation_checkpointing", "gradient_checkpointing", "activation_checkpointing_kwargs",
                         "gradient_checkpointing_kwargs"):
                if name in data:
                    self.skip(name, "off" if name.endswith("checkpointing") else "checkpointing is off")
            return
        kwargs = dict(data.get(kwargs_name) or {})
        every = kwargs.pop("every_n_layers", 1)
        policy = "full" if every in (None, 1) else f"every:{every}"
        if not self.set_step("checkpointing", policy, on_name, "each decoder layer recomputed in backward"
                             if policy == "full" else f"one decoder layer in {every} recomputed"):
            return
        for name, read in (("activation_checkpointing", on_name), ("gradient_checkpointing", on_name),
                           ("activation_checkpointing_kwargs", kwargs_name),
                           ("gradient_checkpointing_kwargs", kwargs_name)):
            if name == read or name not in data:
                continue
            if read is None:  # no kwargs given under either name
                self.skip(name, "not set")
            elif data[name] == data.get(read):  # transformers 5 keeps the deprecated alias beside the new name
                self.use(name, f"--checkpointing {policy}", f"the same as {read}")
            else:
                self.skip(name, f"{read} is the one read" if data[name] else "off")
        if kwargs_name:
            if every not in (None, 1):
                self.use(f"{kwargs_name}.every_n_layers", f"--checkpointing {policy}", value=every)
            if kwargs.pop("offload", False):
                self.set_step("offload", "activations", f"{kwargs_name}.offload", shown=True)
            reentrant = kwargs.pop("use_reentrant", None)
            if reentrant is not None:
                self.skip(f"{kwargs_name}.use_reentrant", "reentrant and non-reentrant checkpointing keep the "
                          "same block inputs; traced non-reentrant", reentrant)
            for key, value in kwargs.items():
                self.skip(f"{kwargs_name}.{key}", "a torch.utils.checkpoint setting batchfit does not read", value)
            self.seen.add(kwargs_name)

    def optimizer(self) -> None:
        from batchfit.workload import OPTIMIZERS

        self.param_groups()
        optim = self.data.get("optim")
        if optim is None:
            return
        optim = str(getattr(optim, "value", optim))
        known = OPTIMIZERS_BY_OPTIM.get(optim)
        if known is None:
            self.skip("optim", "its optimizer state is not one batchfit traces (batchfit's: "
                      f"{', '.join(OPTIMIZERS)}); traced with the model's default optimizer instead")
            return
        names, why = known
        if optim == "sgd" and "momentum" in str(self.data.get("optim_args") or ""):
            names = ("sgd-momentum",)
        name = next((n for n in names if n in OPTIMIZERS), None)
        if name is None:
            self.skip("optim", f"this batchfit has no --optimizer {names[0]} yet; traced with the model's default "
                      "optimizer instead")
            return
        self.set_step("optimizer", name, "optim", why)

    def param_groups(self) -> None:
        """weight_decay -> the Trainer's two optimizer groups, which ``Trainer.create_optimizer`` builds
        whatever the optim and the decay (0 included): its order and its per-group temporaries are traced."""
        decay = self.data.get("weight_decay", 0.0)
        if not isinstance(decay, (int, float)) or isinstance(decay, bool) or not decay >= 0:
            raise OptionError(f"weight_decay must be a number >= 0, got {decay!r}")
        self.set_step("param_groups", f"decay:{decay:g}", "weight_decay", "the Trainer's two optimizer groups: "
                      "the weights (this decay), then biases and norm weights (none)"
                      + ("" if "weight_decay" in self.data else "; not in the args: the Trainer's default 0"),
                      shown=decay)

    def sequence(self) -> None:
        data = self.data
        name = next((n for n in ("max_length", "max_seq_length") if data.get(n) is not None), None)
        for other in ("max_length", "max_seq_length"):
            if other in data and other != name:
                self.skip(other, "not set" if name is None else f"{name} is the one read")
        packing = self.mapping.packing = bool(data.get("packing"))
        if name is not None:
            value = data[name]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise OptionError(f"{name} must be a positive integer, got {value!r}")
            self.mapping.seq_len = value
            self.use(name, f"--seq-len {value}", "every sample packed to this length" if packing else
                     "traced at the longest a sample can be: a padded batch is as long as its longest sample")
        if packing and name is None:
            self.skip("packing", "packing needs max_length to set the sequence length; the model's is traced")
        elif packing:
            self.use("packing", f"--seq-len {self.mapping.seq_len}", "samples packed to max_length")
        elif "packing" in data:
            self.skip("packing", "off: batches are padded to their longest sample, traced at max_length")

    def kernels(self) -> None:
        data = self.data
        if data.get("use_liger_kernel") or data.get("use_liger"):
            name = "use_liger_kernel" if data.get("use_liger_kernel") else "use_liger"
            self.set_step("loss", "fused-linear", name, "Liger's fused linear + cross-entropy; its other kernels "
                          "(RMSNorm, RoPE, SwiGLU) are traced as the model's own")
        for name in ("use_liger_kernel", "use_liger"):
            if name in data and name not in self.seen:
                self.skip(name, "off")
        if data.get("torch_compile"):
            self.set_step("compile", "model", "torch_compile", "the whole model, as the Trainer compiles it")
        elif "torch_compile" in data:
            self.skip("torch_compile", "off")
        if data.get("activation_offloading"):
            self.set_step("offload", "activations", "activation_offloading")
        elif "activation_offloading" in data:
            self.skip("activation_offloading", "off")

    def sharding(self) -> None:
        data = self.data
        fsdp, deepspeed = data.get("fsdp"), data.get("deepspeed")
        if isinstance(fsdp, bool):  # transformers 5: fsdp=True, the rest in fsdp_config
            modes = ["full_shard"] if fsdp else []
        else:
            modes = fsdp.split() if isinstance(fsdp, str) else list(fsdp or [])
        if modes:
            self.fsdp(modes, fsdp)
        elif "fsdp" in data:
            self.skip("fsdp", "off")
        if "fsdp_config" in data and "fsdp_config" not in self.seen:
            self.skip("fsdp_config", "fsdp is off")
        if deepspeed:
            self.deepspeed(deepspeed)
        elif "deepspeed" in data:
            self.skip("deepspeed", "off")

    def strategy(self, source_field: str, name: str, why: str, value: Any = None) -> None:
        from batchfit.plan.sharded import parse_strategy

        try:
            parse_strategy(name, 8)
        except OptionError as error:
            self.skip(source_field, f"this batchfit's plan has no '{name}' strategy yet ({error})", value)
            return
        self.mapping.strategy = name
        self.use(source_field, f"plan --strategies {name}", why, value)

    def fsdp(self, modes: list[str], shown: Any) -> None:
        """FSDP (transformers/training_args.py: FSDPOption, fsdp_config) -> plan's strategies."""
        config = self.data.get("fsdp_config")
        config = dict(config) if isinstance(config, Mapping) else {}
        self.seen.add("fsdp_config")
        shard = next((m for m in modes if m in ("full_shard", "shard_grad_op", "hybrid_shard",
                                                "hybrid_shard_zero2", "no_shard")), "full_shard")
        reshard = config.pop("reshard_after_forward", None)
        if shard == "full_shard" and reshard in (False, "SHARD_GRAD_OP", "shard_grad_op"):
            shard = "shard_grad_op"
        table = {"full_shard": ("fsdp", "FSDP2 fully_shard on each block (ZeRO-3)"),
                 "shard_grad_op": ("zero2", "parameters kept gathered from forward to backward (ZeRO-2)"),
                 "no_shard": ("ddp", "no sharding: every rank keeps everything")}
        if shard in table:
            self.strategy("fsdp", *table[shard], value=shown)
        else:
            self.skip("fsdp", f"'{shard}' has no plan strategy here (hybrid sharding: give plan --strategies "
                      "hsdp<R>)", shown)
        if reshard is not None:
            self.mapping.used.append(FieldUse(field="fsdp_config.reshard_after_forward", value=reshard,
                                              option=f"plan --strategies {table.get(shard, ('-',))[0]}"))
        offload = [config.pop("cpu_offload", None), config.pop("offload_params", None), "offload" in modes]
        if any(offload):
            self.set_step("offload", "params", "fsdp_config.cpu_offload", "FSDP's CPUOffload keeps parameters "
                          "(and their gradients and optimizer state) on the host", shown=True)
        if config.pop("activation_checkpointing", False):
            self.set_step("checkpointing", "full", "fsdp_config.activation_checkpointing", shown=True)
        for key, value in config.items():
            self.skip(f"fsdp_config.{key}", "an FSDP setting batchfit does not read", value)
        if "fsdp_config" in self.data and not any(u.field.startswith("fsdp_config")
                                                  for u in self.mapping.used + self.mapping.unused):
            self.skip("fsdp_config", "nothing in it batchfit reads")

    def deepspeed(self, deepspeed: Any) -> None:
        config = deepspeed if isinstance(deepspeed, Mapping) else self.deepspeed_config
        if not isinstance(config, Mapping):
            self.skip("deepspeed", "the DeepSpeed config file was not read (give its path relative to the args "
                      "file)")
            return
        zero = config.get("zero_optimization") or {}
        stage = zero.get("stage", 0) if isinstance(zero, Mapping) else 0
        shown = deepspeed if isinstance(deepspeed, str) else "{...}"
        table = {1: ("zero1", "DeepSpeed ZeRO-1 -> zero1: optimizer state sharded"),
                 2: ("zero2", "DeepSpeed ZeRO-2 -> zero2: optimizer state and gradients sharded"),
                 3: ("fsdp", "DeepSpeed ZeRO-3 -> fsdp: FSDP2 shards parameters, gradients and optimizer state "
                             "as ZeRO-3 does (its buffers differ: stage3_prefetch_bucket_size and co. not read)")}
        if stage in table:
            self.strategy("deepspeed", *table[stage], value=shown)
        else:
            self.skip("deepspeed", f"ZeRO stage {stage}: plain data parallel, plan's ddp", shown)
        for part, offload in (("offload_optimizer", "optimizer"), ("offload_param", "params")):
            device = (zero.get(part) or {}).get("device", "none") if isinstance(zero, Mapping) else "none"
            if device not in (None, "none"):
                self.set_step("offload", offload, f"deepspeed.zero_optimization.{part}",
                              f"DeepSpeed offloads to {device}", shown=device)
        for key in ("bf16", "fp16"):
            if isinstance(config.get(key), Mapping) and config[key].get("enabled") is True \
                    and not self.data.get(key):
                self.skip(f"deepspeed.{key}", f"set {key}=true in the TrainingArguments too (the Trainer requires "
                          "them to agree); the args' precision is traced", True)

    def model_init(self, kwargs: Mapping, quantization: Any) -> Any:
        """TRL's model_init_kwargs (``from_pretrained``'s): the weights' dtype, and a
        quantization_config (returned, unless the args have one of their own)."""
        self.seen.add("model_init_kwargs")
        for key, value in kwargs.items():
            name = f"model_init_kwargs.{key}"
            if key == "quantization_config" and quantization is None:
                quantization = value
                self.mapping.used.append(FieldUse(field=name, value="{...}", option="see quantization_config"))
            elif key in ("dtype", "torch_dtype") and str(value).removeprefix("torch.") == "bfloat16":
                self.set_step("precision", "bf16", name, "weights loaded in bf16: weights, gradients and optimizer "
                              "states in bf16 (autocast on top changes no bytes)", shown=value)
            elif key in ("dtype", "torch_dtype") and value == "auto":
                self.skip(name, "the checkpoint's own dtype (bf16 for most recent LLMs) cannot be read from the "
                          "args: give --precision bf16 if it is bf16", value)
            elif key == "attn_implementation":
                ours = next((k for k, v in HF_ATTENTION.items() if v == value), None)
                if ours is None:
                    self.skip(name, f"batchfit traces eager, sdpa and flash_attention_2, not {value!r}; the model "
                              "spec's attention is traced", value)
                else:
                    self.set_step("attention", ours, name, "the model's attn_implementation", shown=value)
            else:
                self.skip(name, "a from_pretrained setting batchfit does not read", _plain(value))
        return quantization

    def peft(self, config: Any) -> None:
        if config is None:
            return
        config = args_to_dict(config)
        self.seen.add("peft_config")
        kind = str(config.get("peft_type", "LORA")).upper()
        if kind not in ("LORA", "PEFTTYPE.LORA"):
            self.skip("peft_config", f"PEFT type {kind}: batchfit traces LoRA / DoRA adapters only", kind)
            return
        r = config.get("r", 8)
        parts = [f"r={r}"]
        if config.get("use_dora"):
            parts.append("dora")
        targets = config.get("target_modules")
        why = ""
        if isinstance(targets, (list, tuple, set)):
            parts.append("targets=" + "+".join(sorted(targets)))
        elif isinstance(targets, str) and targets != "all-linear":
            parts.append(f"targets={targets}")  # a regex in PEFT: the lora grammar says if it cannot take it
        elif targets is None:
            why = ("no target_modules: PEFT picks per architecture (q_proj, v_proj for Llama); batchfit's default "
                   "is every linear layer: give target_modules")
        if self.set_step("lora", ",".join(parts), "peft_config", why, shown="{...}"):
            for key in ("r", "use_dora", "target_modules"):
                if key in config:
                    self.mapping.used.append(FieldUse(field=f"peft_config.{key}", value=_plain(config[key]),
                                                      option=f"--lora {','.join(parts)}"))
        for key, value in config.items():
            if key in ("r", "use_dora", "target_modules", "peft_type"):
                continue
            why = {"lora_dropout": "PEFT's dropout keeps a copy of each adapted layer's input when > 0: "
                                   "not traced",
                   "modules_to_save": "fully trained extra modules: give them with --train-only"}.get(key, NO_MEMORY)
            self.mapping.unused.append(FieldUse(field=f"peft_config.{key}", value=_plain(value), why=why))

    def quantization(self, config: Any) -> None:
        if config is None:
            return
        config = args_to_dict(config)
        self.seen.add("quantization_config")
        method = config.get("quant_method", "bitsandbytes")
        if config.get("load_in_4bit") or config.get("_load_in_4bit"):
            kind = str(config.get("bnb_4bit_quant_type", "fp4"))
            value = kind + ("-dq" if config.get("bnb_4bit_use_double_quant") else "")
            read = ("load_in_4bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant")
        elif config.get("load_in_8bit") or config.get("_load_in_8bit"):
            value, read = "int8", ("load_in_8bit",)
        else:
            self.skip("quantization_config", f"{method}: batchfit traces bitsandbytes 4-bit and 8-bit bases only",
                      method)
            return
        self.set_step("quantize", value, "quantization_config", "compute dtype follows --precision",
                      shown="{...}")
        for key, item in config.items():
            if key in read or key.startswith("_") or key == "quant_method":
                continue
            why = ("the compute dtype follows --precision (bf16 / fp16 autocast)" if key == "bnb_4bit_compute_dtype"
                   else NO_MEMORY if key.startswith("llm_int8_threshold") else "a bitsandbytes setting batchfit "
                   "does not read")
            self.mapping.unused.append(FieldUse(field=f"quantization_config.{key}", value=_plain(item), why=why))
