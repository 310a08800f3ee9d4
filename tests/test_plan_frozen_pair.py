"""The frozen-pair zoo workload (seed 001): two frozen bf16 LMs, a trainable encoder + adapters."""

from __future__ import annotations

import torch

from batchfit import StepOptions, load_workload
from batchfit.train.step import TrainingStep, block_list
from batchfit.zoo.frozen_pair import FrozenLayer


def test_seed_001_size_has_100m_trainable_and_both_lms_frozen_in_bf16():
    with torch.device("meta"):
        model = load_workload("frozen-pair").build_model()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    d = 1024
    block = 12 * d * d + 13 * d  # attention 4d^2+4d, FFN 8d^2+5d, two LayerNorms 4d
    adapters = (d * 4096 + 4096 + 4096 * 4096 + 4096) + (d * 3584 + 3584 + 3584 * 3584 + 3584)
    assert trainable == 5 * block + 256 * d + 32 * d + (4 * d * d + 4 * d) + adapters == 104_976_384
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert {p.dtype for p in frozen} == {torch.bfloat16}
    # Llama-3.1-8B (8,030,261,248) + Qwen2.5-7B (7,615,616,512), their published sizes
    assert sum(p.numel() for p in frozen) == 8_030_261_248 + 7_615_616_512
    blocks = block_list(model)
    assert len(blocks) == 32 + 28 and {type(b) for b in blocks} == {FrozenLayer}


def test_tiny_trains_on_the_cpu_with_checkpointing_and_only_the_encoder_learns():
    workload = load_workload("frozen-pair-tiny", seq_len=8)
    step = TrainingStep(workload, StepOptions(checkpointing="full"), torch.device("cpu"))
    before = {n: p.detach().clone() for n, p in step.model.named_parameters()}
    loss = step.run(2)
    assert torch.isfinite(loss)
    changed = {n for n, p in step.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(not n.startswith(("lm_a.", "lm_b.")) for n in changed)
    assert any(n.startswith("adapter_a.") for n in changed) and any(n.startswith("encoder.") for n in changed)
