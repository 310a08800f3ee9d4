"""The frozen-pair zoo workload (seed 001): two frozen bf16 LMs, a trainable encoder + adapters.

Checked against the published sizes of its two LMs, shapes worked out by hand, and a real CPU training step."""

from __future__ import annotations

import pytest
import torch

from batchfit import StepOptions, load_workload
from batchfit.devices import get_device
from batchfit.plan.sharded import parse_strategy, trace_sharded
from batchfit.train.model import block_list
from batchfit.train.step import TrainingStep
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


# --- planning it (README: batchfit plan frozen-pair --gpus 1,2,3,4 --strategies ddp ...) -------------
def _rounded(nbytes: int) -> int:
    return -(-nbytes // 512) * 512  # the CUDA caching allocator's 512-byte blocks


def _tiny_by_hand():
    """frozen-pair-tiny's tensors from their shapes (built on meta: no tracer involved)."""
    with torch.device("meta"):
        model = load_workload("frozen-pair-tiny").build_model()
    params = list({id(p): p for p in model.parameters()}.values())  # the decoder layers are listed twice
    buffers = list({id(b): b for b in model.buffers()}.values())  # rotary inv_freq, original_inv_freq
    trainable = [p for p in params if p.requires_grad]
    assert {p.dtype for p in trainable} == {torch.float32} and len(buffers) == 4
    return params, buffers, trainable


README_OPTIONS = StepOptions(precision="bf16-mixed", checkpointing="full")


@pytest.mark.parametrize("name,gpus", [("ddp", 1), ("ddp", 2)])
def test_tiny_plans_with_ddp_and_on_one_gpu_hold_what_its_shapes_say(name, gpus):
    """Every parameter and buffer (bf16 frozen LMs, fp32 encoder + adapters) and AdamW's two
    fp32 states per trainable parameter, each in 512-byte blocks; DDP on 2 GPUs holds one
    more thing than one GPU: its gradient bucket (every trainable gradient, flat, fp32: one
    bucket, under DDP's 1 MiB first-bucket cap)."""
    params, buffers, trainable = _tiny_by_hand()
    point = trace_sharded(load_workload("frozen-pair-tiny"), README_OPTIONS, get_device("h100-80gb"),
                          parse_strategy(name, gpus), 2)
    assert point.params == point.params_per_rank == sum(p.numel() for p in params) == 291_088
    assert point.breakdown["parameters"] == sum(_rounded(t.numel() * t.element_size()) for t in params + buffers)
    assert point.breakdown["optimizer_state"] == 2 * sum(_rounded(4 * p.numel()) for p in trainable) == 398_336
    bucket = _rounded(4 * sum(p.numel() for p in trainable))
    assert point.breakdown.get("collective", 0) == (bucket if gpus == 2 else 0) and bucket == 193_024
    if gpus == 2:
        one_gpu = trace_sharded(load_workload("frozen-pair-tiny"), README_OPTIONS, get_device("h100-80gb"),
                                parse_strategy("ddp", 1), 2)
        assert point.peak_bytes == one_gpu.peak_bytes + bucket


def test_tiny_plans_with_fsdp_shards_every_parameter_in_two():
    """FSDP2 on 2 GPUs: rank 0 keeps the first half (rows) of every parameter, and AdamW's
    state for its trainable halves."""
    params, _, trainable = _tiny_by_hand()
    point = trace_sharded(load_workload("frozen-pair-tiny"), README_OPTIONS, get_device("h100-80gb"),
                          parse_strategy("fsdp", 2), 2)

    def half(p):
        return -(-p.shape[0] // 2) * (p.numel() // p.shape[0])

    assert point.params_per_rank == sum(half(p) for p in params) == 145_544
    assert point.breakdown["optimizer_state"] == 2 * sum(_rounded(4 * half(p)) for p in trainable) == 210_944


def test_the_readme_command_plans_the_tiny_pair_on_1_and_2_gpus():
    """The README's seed-001 command, at frozen-pair-tiny's size, through the whole plan."""
    from batchfit.plan.engine import plan
    from batchfit.plan.world import World

    result = plan(load_workload("frozen-pair-tiny"), device=get_device("h100-80gb"), worlds=[World(1), World(2)],
                  options=README_OPTIONS, strategies="ddp", target_util=0.8, max_batch=64, processes=1)
    assert [(p.gpus, p.strategy) for p in result.plans] == [(1, "ddp"), (2, "ddp")]
    one, two = result.plans
    # the same model, the same local batches: 2 GPUs add only DDP's bucket, so both fit the cap
    assert one.max_local_batch == two.max_local_batch == 64 and two.max_global_batch == 128
    for local in (1, 2):
        assert two.point(local).peak_bytes - one.point(local).peak_bytes == 193_024
