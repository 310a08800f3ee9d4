"""The independent measurement the GRPO step is held to: a REAL ``trl.GRPOTrainer`` step on this CPU (a tiny
transformers Llama built from its config, a one-character-a-token tokenizer, a Python reward), under the torch
profiler's memory timeline, cut at TRL's own phases; and batchfit's trace of the same GRPOConfig (read through
``from_training_arguments``, as ``--trainer`` reads it). Needs ``pip install trl``.

The phases are cut where TRL runs them: ``generate`` around ``_generate_single_turn`` (``model.generate``),
``reference`` around each no-grad ``_get_per_token_logps_and_entropies`` (the reference's and the old
log-probs), ``forward`` around ``compute_loss``, ``backward`` around ``accelerator.backward``, ``optimizer``
from the Trainer's ``on_pre_optimizer_step`` to ``on_optimizer_step``. A phase's peak is the timeline's largest
total from the one live as it begins to its end (as ``cpu_truth.profiled_phase_peaks``). The profiled step is
the second that generates (the optimizer state exists, as in the trace)."""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from batchfit.integrations.trainer_args import from_training_arguments
from batchfit.trace.session import TraceSession
from batchfit.workload import StepOptions
from batchfit.zoo.hf_grpo import hf_grpo_workload

PHASES = ("generate", "reference", "forward", "backward", "optimizer")
VOCAB = 256


@dataclass(frozen=True)
class Case:
    """One GRPOConfig of the comparison (AdamW, no gradient checkpointing, transformers' generate)."""

    label: str
    batch: int = 4
    """per_device_train_batch_size."""
    group: int = 2
    """num_generations."""
    prompt_len: int = 8
    new_tokens: int = 6
    """max_completion_length (every completion runs to it: EOS is held back by min_new_tokens)."""
    steps_per_generation: int = 1
    beta: float = 0.04
    dtype: str = "float32"
    """The weights' dtype (``model_init_kwargs``; bfloat16 is traced as ``--precision bf16``)."""
    sampling: tuple[tuple[str, float], ...] = ()
    """GRPOConfig sampling fields (temperature, top_k, ...) beside the min_new_tokens every case has."""


CASES = (
    Case("reference model (beta 0.04)"),
    Case("2 update steps per generation (old log-probs), group 4", group=4, steps_per_generation=2),
    Case("no reference model (beta 0), group 4", group=4, beta=0.0),
)
WARPERS = (("temperature", 0.7), ("top_k", 50), ("top_p", 0.9), ("min_p", 0.05), ("repetition_penalty", 1.1))
"""Every sampling field of a GRPOConfig away from its default: five logits processors more at each new token."""
BF16_CASES = (
    Case("reference model (beta 0.04), bf16 weights", dtype="bfloat16"),
    Case("reference model (beta 0.04), bf16 weights, temperature 0.7, top_k 50, top_p 0.9, min_p 0.05, "
         "repetition_penalty 1.1", dtype="bfloat16", sampling=WARPERS),
)
"""bf16 weights: the prompt's activations halve while sampling stays fp32, so generation peaks at a new token
(transformers' logits processors: min_new_tokens' two, and the five of WARPERS in the second case)."""


def tiny_llama(folder: Path) -> Path:
    """A 2-layer Llama (hidden 32, vocabulary 256) saved with random weights and a tokenizer whose 256 tokens are
    one CJK character each (so a prompt of 8 characters is 8 tokens, no special tokens added)."""
    import transformers
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=VOCAB,
                             max_position_embeddings=128).save_pretrained(folder)
    transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(folder)).save_pretrained(folder)
    chars = [chr(0x4E00 + i) for i in range(VOCAB)]
    backend = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=chars[0]))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=chars[-1], pad_token=chars[-2],
                                         unk_token=chars[0]).save_pretrained(folder)
    return folder


def grpo_args(case: Case, folder: Path):
    import trl

    generate_every = case.steps_per_generation
    weights = {} if case.dtype == "float32" else {"model_init_kwargs": {"dtype": case.dtype}}
    return trl.GRPOConfig(
        output_dir=str(folder / "out"), per_device_train_batch_size=case.batch, num_generations=case.group,
        steps_per_generation=case.steps_per_generation, max_completion_length=case.new_tokens, beta=case.beta,
        bf16=False, gradient_checkpointing=False, optim="adamw_torch", use_cpu=True, report_to="none",
        save_strategy="no", logging_steps=10_000, max_steps=generate_every + 1, seed=0,
        generation_kwargs={"min_new_tokens": case.new_tokens}, dataloader_num_workers=0, **weights,
        **dict(case.sampling))


def trl_phase_peaks(case: Case, folder: Path) -> dict[str, int]:
    """Each phase's peak bytes in the profiler's memory timeline of TRL's second generating step."""
    import transformers
    import trl
    from datasets import Dataset
    from torch.profiler import ProfilerActivity, profile, record_function

    chars = [chr(0x4E00 + i) for i in range(VOCAB)]
    prompts = ["".join(chars[(i * 7 + j) % 200] for j in range(case.prompt_len)) for i in range(256)]
    args = grpo_args(case, folder)
    trainer = trl.GRPOTrainer(model=str(folder), reward_funcs=[lambda completions, **_: [1.0 * len(c) for c in
                                                                                         completions]],
                              args=args, train_dataset=Dataset.from_dict({"prompt": prompts}),
                              processing_class=transformers.AutoTokenizer.from_pretrained(folder))
    state: dict = {"on": False}

    def ranged(name, fn, when=lambda: True):
        def wrapper(*a, **k):
            if state["on"] and when():
                with record_function(f"phase:{name}"):
                    return fn(*a, **k)
            return fn(*a, **k)
        return wrapper

    trainer._generate_single_turn = ranged("generate", trainer._generate_single_turn)
    trainer._get_per_token_logps_and_entropies = ranged(
        "reference", trainer._get_per_token_logps_and_entropies, lambda: not torch.is_grad_enabled())
    trainer.compute_loss = ranged("forward", trainer.compute_loss)
    trainer.accelerator.backward = ranged("backward", trainer.accelerator.backward)
    profiled = case.steps_per_generation  # global step of the second generation

    class Phases(transformers.TrainerCallback):
        def on_step_begin(self, args, st, control, **kwargs):
            if st.global_step == profiled:
                state["prof"] = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                                        with_stack=True)
                state["prof"].__enter__()
                state["on"] = True

        def on_pre_optimizer_step(self, args, st, control, **kwargs):
            if state["on"]:
                state["optimizer"] = record_function("phase:optimizer")
                state["optimizer"].__enter__()

        def on_optimizer_step(self, args, st, control, **kwargs):
            if state["on"]:
                state["optimizer"].__exit__(None, None, None)

        def on_step_end(self, args, st, control, **kwargs):
            if state["on"]:
                state["on"] = False
                state["prof"].__exit__(None, None, None)

    trainer.add_callback(Phases())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
        prof = state["prof"]
        path = folder / "timeline.json"
        prof.export_memory_timeline(str(path), device="cpu")
    times, sizes = json.loads(path.read_text())
    totals = [sum(row) for row in sizes]
    start_us = prof.profiler.kineto_results.trace_start_ns() / 1000  # the timeline's clock, in us
    peaks: dict[str, int] = {}
    for event in prof.events():
        if event.name.startswith("phase:"):
            begin, end = start_us + event.time_range.start, start_us + event.time_range.end
            before = [total for t, total in zip(times, totals) if t < begin][-1:]
            peak = max(before + [total for t, total in zip(times, totals) if begin <= t <= end])
            name = event.name.removeprefix("phase:")
            peaks[name] = max(peaks.get(name, 0), peak)
    return peaks


def config_json(case: Case, folder: Path) -> dict:
    """The GRPOConfig as a saved one reads, with the prompt length TRL's current config has no field for."""
    return {**json.loads(grpo_args(case, folder).to_json_string()), "max_prompt_length": case.prompt_len}


def traced_phase_peaks(case: Case, folder: Path, *, cuda_semantics: bool = False) -> dict[str, int]:
    """batchfit's trace of the same GRPOConfig (``--trainer``'s mapping) at the same per-device batch."""
    mapping = from_training_arguments(config_json(case, folder))
    options = StepOptions(**{k: v for k, v in mapping.step.items() if k != "accumulation_steps"})
    with TraceSession(hf_grpo_workload(str(folder), mapping.rollout), options, cuda_semantics=cuda_semantics) as s:
        return s.trace(case.batch).snapshot.peak_by_phase


def case_json(case: Case) -> dict:
    return asdict(case)
