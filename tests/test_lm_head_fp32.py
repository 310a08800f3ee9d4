"""TRL's ``cast_lm_head_to_fp32`` (a GRPOConfig field, trl 1.16: ``grpo_trainer.py`` ``_cast_lm_head_to_fp32``
and ``add_fused_lm_head``): the policy's and the reference's LM head kept in fp32 whatever the weights' dtype,
run outside autocast on an fp32 copy of the hidden states, so TRL's fused head tiles in fp32; traced as
``Rollout.fp32_head`` (``zoo/grpo.py``, ``zoo/fused_logprobs.py``, ``workload.KEEP_FP32``).

Checked against TRL's own GRPOTrainer: a real step (``tests/trl_truth.py``, bf16 weights from
``model_init_kwargs``) under the profiler, its phases against the trace of the same GRPOConfig as ``--trainer``
reads it. Before the field was mapped, the trace was the one without it: 3,858,036 B against TRL's 7,336,200 B
for the reference log-probs (47% low: the fused head's 32,768-wide tile buffer is fp32, not bf16).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

transformers = pytest.importorskip("transformers")

from batchfit.errors import OptionError  # noqa: E402
from batchfit.integrations.trainer_args import from_training_arguments  # noqa: E402
from batchfit.options import Rollout  # noqa: E402
from batchfit.trace.session import TraceSession  # noqa: E402
from batchfit.train.model import move_module  # noqa: E402
from batchfit.workload import KEEP_FP32, StepOptions  # noqa: E402
from batchfit.zoo.grpo import grpo_workload  # noqa: E402
from batchfit.zoo.hf_grpo import hf_grpo_workload  # noqa: E402

VOCAB, HIDDEN = 256, 32


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def llama(request, tmp_path_factory) -> tuple[str, bool]:
    folder = tmp_path_factory.mktemp("llama")
    transformers.LlamaConfig(num_hidden_layers=2, hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                             tie_word_embeddings=request.param).save_pretrained(folder)
    return str(folder), request.param


def test_the_grpo_config_field_is_mapped():
    fields = {"per_device_train_batch_size": 2, "num_generations": 2, "max_prompt_length": 8}
    mapping = from_training_arguments({**fields, "cast_lm_head_to_fp32": True}, check_fields=False)
    assert mapping.rollout.fp32_head
    assert any(u.field == "cast_lm_head_to_fp32" and "fp32" in u.option for u in mapping.used)
    off = from_training_arguments({**fields, "cast_lm_head_to_fp32": False}, check_fields=False)
    assert not off.rollout.fp32_head and {u.field: u.why for u in off.unused}["cast_lm_head_to_fp32"] == "off"


def test_the_heads_stay_fp32_in_a_bf16_step(llama):
    """Pure bf16 weights: each of the two heads (policy, reference) holds 256 x 32 x 4 B instead of x 2; a tied
    head shares its weight with the embedding (one tensor, fp32 too, as TRL's ``lm_head.float()`` leaves it)."""
    folder, tied = llama
    params = {}
    for fp32 in (False, True):
        rollout = Rollout(prompt_len=8, new_tokens=4, group_size=2, fp32_head=fp32)
        with TraceSession(hf_grpo_workload(folder, rollout), StepOptions(precision="bf16")) as session:
            head = session.step.model.policy.get_output_embeddings().weight
            assert head.dtype == (torch.float32 if fp32 else torch.bfloat16)
            params[fp32] = session.trace(2).snapshot.breakdown_by_phase["optimizer"]["parameters"]
    assert params[True] - params[False] == 2 * VOCAB * HIDDEN * 2


def test_moving_a_model_keeps_each_fp32_head_its_own():
    """Before the fix one build in about fifteen gave the reference model the policy's fp32 head (the
    parameters 32 KB low): ``move_module`` matched tensors by ``id`` and let the originals die, so a copy
    made later at a dead one's address was taken for it. 16 heads x 20 moves made that all but certain
    (16 or 17 of 20 moves here); each head must keep a storage of its own, in fp32, the rest in bf16."""
    copies = 16
    with FakeTensorMode():
        for _ in range(20):
            model = nn.ModuleList(nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16, bias=False))
                                  for _ in range(copies))
            for copy in model:
                setattr(copy[1], KEEP_FP32, True)
            move_module(model, torch.device("cpu"), torch.bfloat16)
            heads = [copy[1].weight for copy in model]
            assert len({head.untyped_storage()._cdata for head in heads}) == copies
            assert {head.dtype for head in heads} == {torch.float32}
            assert {copy[0].weight.dtype for copy in model} == {torch.bfloat16}


def test_a_step_that_is_not_trls_refuses_it():
    with pytest.raises(OptionError, match="cast_lm_head_to_fp32 is traced on TRL's fused LM head") as error:
        grpo_workload(rollout=Rollout(fp32_head=True))
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_each_phase_against_a_real_trl_step_with_the_head_in_fp32(tmp_path, monkeypatch):
    """trl 1.16.0, bf16 weights, a reference model, 4 completions per update (15 s here): reference, forward,
    backward within 0.1%, the optimizer within 0.3% (-0.07%, -0.07%, -0.01%, -0.22% here); generation within 1 KB
    (-428 B; 3.2% low before generation mirrored min_new_tokens' logits processors: ``zoo/hf_sampling.py``)."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    from tests import trl_truth
    from tests.cpu_truth import same_kernels_on_any_x86

    plain = trl_truth.grpo_args

    def bf16_fp32_head(case, folder):
        args = plain(case, folder)
        args.model_init_kwargs, args.cast_lm_head_to_fp32 = {"dtype": "bfloat16"}, True
        return args

    monkeypatch.setattr(trl_truth, "grpo_args", bf16_fp32_head)
    case = trl_truth.CASES[0]
    folder = trl_truth.tiny_llama(tmp_path)
    with same_kernels_on_any_x86():  # bf16 matmuls: no oneDNN scratch (cpu_truth)
        real = trl_truth.trl_phase_peaks(case, folder)
    mapping = from_training_arguments(trl_truth.config_json(case, folder))
    assert mapping.rollout.fp32_head and mapping.step["precision"] == "bf16"
    options = StepOptions(**{k: v for k, v in mapping.step.items() if k != "accumulation_steps"})
    with TraceSession(hf_grpo_workload(str(folder), mapping.rollout), options, cuda_semantics=False) as session:
        traced = session.trace(case.batch).snapshot.peak_by_phase
    assert abs(traced["generate"] - real["generate"]) <= 1024, (traced["generate"], real["generate"])
    for phase, within in (("reference", 0.001), ("forward", 0.001), ("backward", 0.001), ("optimizer", 0.003)):
        assert abs(traced[phase] - real[phase]) <= within * real[phase], (phase, traced[phase], real[phase])
