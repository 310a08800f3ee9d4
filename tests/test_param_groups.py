"""The HF Trainer's two optimizer parameter groups (the weights with ``weight_decay``, then the biases and
norm weights without: ``Trainer.create_optimizer``), traced under ``--trainer`` and ``fit_training`` as
``param_groups`` decay:WD; a plain estimate keeps one group (``Optimizer(model.parameters())``).

Checked against transformers' own Trainer: its ``create_optimizer`` builds the optimizer of the real CPU
step the profiler measures (``cpu_truth.profiled_phase_peaks``), its ``get_decay_parameter_names`` the split.

Why the groups move the optimizer's peak (torch/optim/adam.py, sgd.py):
- the for-loop AdamW (torch's default on CPU) still holds the previous parameter's ``denom`` while it makes
  the next one's, so its peak is the largest parameter's two temporaries plus the one before it: in the
  Trainer's order an MLP weight comes before the head, in the model's order the final norm;
- the foreach AdamW (torch's default on CUDA) makes ``exp_avg_sq_sqrt`` for a whole group at once and frees
  it before the next group: one group holds every parameter's, two hold the larger group's;
- SGD (and Adam) with weight decay add it to a copy of the group's gradients (``_foreach_add``).

The model: a transformers Llama, hidden 32, MLP 64, 2 layers, vocabulary 512, 16 tokens, 2 samples.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.cpu_truth import profiled_phase_peaks, same_kernels_on_any_x86  # noqa: E402

from batchfit.errors import OptionError  # noqa: E402
from batchfit.integrations.trainer_args import from_training_arguments  # noqa: E402
from batchfit.integrations.transformers import hf_model_workload  # noqa: E402
from batchfit.trace.session import TraceSession  # noqa: E402
from batchfit.train.model import decay_parameter_names  # noqa: E402
from batchfit.train.step import TrainingStep  # noqa: E402
from batchfit.workload import StepOptions  # noqa: E402

SEQ, BATCH = 16, 2
NORM_BYTES = 32 * 4
"""One norm weight (hidden 32, fp32): 5 of them (2 per layer and the final one), the only parameters
without decay (Llama has no bias)."""


def tiny_llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=512, max_position_embeddings=64))


def traced_optimizer_phase(model, *, cuda: bool = True, **options) -> int:
    with TraceSession(hf_model_workload(model, SEQ), StepOptions(**options), cuda_semantics=cuda) as session:
        return session.trace(BATCH).snapshot.peak_by_phase["optimizer"]


@pytest.mark.parametrize("config", [
    transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                             vocab_size=128),
    transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=128, bos_token_id=0, eos_token_id=0),
    transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=128),
], ids=["llama-rmsnorm", "gpt2-layernorm-modules", "qwen2-biases"])
def test_the_decayed_parameters_are_the_trainers(config):
    model = transformers.AutoModelForCausalLM.from_config(config)
    names = {name for name, _ in model.named_parameters()}
    theirs = set(transformers.Trainer.get_decay_parameter_names(None, model)) & names
    assert decay_parameter_names(model) == theirs and 0 < len(theirs) < len(names)


def test_the_trainers_real_cpu_step_is_traced_with_its_groups(tmp_path):
    """The truth: the Trainer's own optimizer (create_optimizer, optim adamw_torch, weight_decay 0.1) in a
    real CPU step. One group in the model's order read 8,064 B low: the head's update, the peak, ran beside
    the previous parameter's denom, an MLP weight (64 x 32 x 4 = 8,192 B) in the Trainer's order, the
    final norm (128 B) in the model's."""
    pytest.importorskip("accelerate")  # the Trainer needs it
    model = tiny_llama()
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "run"), report_to=[], use_cpu=True,
                                          optim="adamw_torch", weight_decay=0.1)
    trainer = transformers.Trainer(model=model, args=args)
    optimizer = trainer.create_optimizer()
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    real_step = dataclasses.replace(hf_model_workload(model, SEQ), build_model=lambda: model,
                                    build_optimizer=lambda params: optimizer)
    with same_kernels_on_any_x86():
        real = profiled_phase_peaks(TrainingStep(real_step, StepOptions(), torch.device("cpu")), BATCH, tmp_path)
    # what --trainer maps the args onto
    options = {k: v for k, v in from_training_arguments(args).step.items() if k in ("optimizer", "param_groups")}
    assert options == {"optimizer": "adamw", "param_groups": "decay:0.1"}
    with TraceSession(hf_model_workload(tiny_llama(), SEQ), StepOptions(**options), cuda_semantics=False) as session:
        traced = session.trace(BATCH).snapshot.peak_by_phase
    for phase in ("forward", "backward", "optimizer"):
        assert abs(traced[phase] - real[phase]) <= 128, (phase, traced[phase], real[phase])  # bytes
    one_group = traced_optimizer_phase(tiny_llama(), cuda=False, optimizer="adamw")
    assert traced["optimizer"] - one_group == 64 * 32 * 4 - NORM_BYTES == 8_064


def test_on_cuda_one_foreach_group_holds_every_temporary_at_once():
    """Traced for CUDA (foreach, 512-byte blocks): one group's sqrt temporaries cover the five norm weights
    too; in the Trainer's two they are freed with the weights' before the norms' are made."""
    model = tiny_llama()
    one = traced_optimizer_phase(model, optimizer="adamw")
    two = traced_optimizer_phase(model, optimizer="adamw", param_groups="decay:0.1")
    assert one - two == 5 * 512


def test_sgd_weight_decay_copies_the_decayed_gradients():
    """SGD adds the decay to a copy of its group's gradients (``torch._foreach_add``): the weights' gradients,
    each in 512-byte blocks (the embedding and head 512 x 32, 8 attention and 6 MLP matrices)."""
    model = tiny_llama()
    weights = sum(-(-p.numel() * 4 // 512) * 512 for name, p in model.named_parameters()
                  if name in decay_parameter_names(model))
    assert weights == 2 * 65_536 + 8 * 4_096 + 6 * 8_192
    plain = traced_optimizer_phase(model, optimizer="sgd", param_groups="decay:0")
    decayed = traced_optimizer_phase(model, optimizer="sgd", param_groups="decay:0.01")
    assert decayed - plain == weights


@pytest.mark.parametrize("text", ["decay", "decay:-1", "decay:x", "two", "decay:nan"])
def test_bad_param_groups_are_one_line_errors(text):
    with pytest.raises(OptionError, match="use one or decay:WD") as error:
        StepOptions(param_groups=text)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("given, groups", [(None, "decay:0.1"), ("sgd", "one")])
def test_fit_training_traces_the_trainers_groups_unless_given_an_optimizer(monkeypatch, given, groups):
    """The Trainer builds its optimizer over its two groups; an optimizer passed to Trainer(optimizers=...) is the
    user's, traced as given."""
    import batchfit.integrations.transformers as hf

    seen = {}

    class Stop(Exception):
        pass

    def plan(workload, *, options, **kwargs):
        seen["groups"] = options.param_groups
        raise Stop

    monkeypatch.setattr(hf, "plan_global_batch", plan)
    model = tiny_llama()
    args = {"optim": "adamw_torch", "weight_decay": 0.1, "learning_rate": 1e-3, "adam_beta1": 0.9, "adam_beta2": 0.999,
            "adam_epsilon": 1e-8, "optim_args": None}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1) if given else None
    with pytest.raises(Stop):
        hf.fit_training(model, types.SimpleNamespace(**args), global_batch=8, seq_len=SEQ, gpu_memory="1GiB",
                        optimizer=optimizer)
    assert seen["groups"] == groups
