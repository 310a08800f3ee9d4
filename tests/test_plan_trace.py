"""Rank 0 of a sharded step traced on the fake process group, against real gloo runs on CPU.

Truth without a GPU: real processes (2 and 4) on the CPU over gloo run the same strategy
code (``batchfit.distributed``) on real tensors; rank 0's peak in a steady step (the third:
DDP rebuilds its buckets in the second) is measured by the torch profiler's memory
timeline, independently of the tracer, and compared with ``trace_sharded`` at the same
world size and local batch, traced with CPU semantics (no CUDA rounding, CPU kernels).
Collective bytes are checked against the closed form, computed from parameter shapes.

Checked against torch's own DDP, FSDP2 and DTensor code running for real over gloo; the Llama TP plan is batchfit's
own hand plan (checks its counting, not its fidelity to torchtitan's: test_torchtitan.py runs that).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from batchfit.errors import OptionError
from batchfit.plan.sharded import Strategy, parse_strategies, parse_strategy
from batchfit.workload import StepOptions, Workload
from cpu_truth import gloo_step, join_gloo, leave_gloo, spawn_profiled_gloo
from tiny import (
    BLOCK,
    CFG,
    LOCAL_BATCH,
    OPTIONS,
    ROOT,
    TOTAL,
    rank0_profiled_peaks,
    tiny_workload_named,
)
from tiny import collective_bytes as _bytes
from tiny import traced_rank0 as _trace

MEASURED = {2: ("ddp", "fsdp", "fsdp:t5"), 4: ("fsdp+tp2",)}
"""Strategies run for real, by world size; ':t5' runs the tiny encoder-decoder instead."""


# --- the real runs -----------------------------------------------------------------------------
def _gloo_main(rank: int, world_size: int, port: int, out_dir: str, names: tuple[str, ...]) -> None:
    from batchfit.distributed.tp_plans import tp_plan

    join_gloo(rank, world_size, port, timeout_s=60)
    peaks = {}
    for name in names:
        step = gloo_step(tiny_workload_named(name), OPTIONS, parse_strategy(name.removesuffix(":t5"), world_size),
                         tp_plan_of=tp_plan)
        step.run(LOCAL_BATCH)
        step.run(LOCAL_BATCH)  # DDP rebuilds its buckets here
        # rank 0 keeps the smaller peak of two profiled steps (tiny.rank0_profiled_peaks says why)
        peaks[name] = min(rank0_profiled_peaks(step, os.path.join(out_dir, f"timeline-{name}.json")), default=None)
        del step
        dist.barrier()
    leave_gloo(rank, os.path.join(out_dir, "peaks.json"), peaks)


FAST = {(2, "ddp"), (2, "fsdp")}
"""Run in the fast tier, in one gloo run; the encoder-decoder and the 4-rank fsdp+tp2 are slow."""


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """Rank 0's profiled peak of a steady step: one gloo run for the fast tier's strategies (run when
    a test first asks for it), one per world size for the slow tier's."""
    out = {}

    def peak(world_size: int, name: str) -> int:
        fast = (world_size, name) in FAST
        key = "fast" if fast else world_size
        if key not in out:
            names = tuple(n for w, n in sorted(FAST)) if fast else tuple(
                n for n in MEASURED[world_size] if (world_size, n) not in FAST)
            path = tmp_path_factory.mktemp(f"gloo{world_size}")
            spawn_profiled_gloo(_gloo_main, lambda port: (world_size, port, str(path), names), nprocs=world_size)
            out[key] = json.loads((path / "peaks.json").read_text())
        return out[key][name]
    return peak


@pytest.mark.parametrize("world_size,name", [
    (w, n) if (w, n) in FAST else pytest.param(w, n, marks=pytest.mark.slow) for w, names in MEASURED.items()
    for n in names])
def test_traced_rank0_peak_matches_a_real_gloo_run(measured, world_size, name):
    real = measured(world_size, name)
    point = _trace(name, world_size)
    assert point.breakdown["workspace"] == 0  # CPU semantics: no cuBLAS workspace, no rounding
    # tiny T5 under FSDP: -2.2% (104 KB of 4.8 MB; in the forward), unexplained: the same model on one
    # process is within 196 B of the profiler, so the gap is in FSDP2 over its two stacks
    assert abs(point.peak_bytes - real) / real < (0.03 if name.endswith(":t5") else 0.02), (point.peak_bytes, real)


# --- collective bytes, in closed form ----------------------------------------------------------

def test_fsdp_wraps_the_blocks_of_both_stacks_of_an_encoder_decoder():
    # T5's encoder and decoder each hold 2 T5Blocks: with the root, 5 FSDP units, each gathered
    # once in forward and reduce-scattered once in backward (the longest list alone gave 3)
    point = _trace("fsdp:t5", 2)
    assert len(_bytes(point, "all_gather", "forward")) == len(_bytes(point, "reduce_scatter")) == 5
    # (its peak against the real 2-process gloo run: test_traced_rank0_peak_matches_a_real_gloo_run[2-fsdp:t5])


def test_fsdp_gathers_parameters_in_forward_and_backward_and_reduce_scatters_gradients():
    point = _trace("fsdp", 2)
    # Forward: the root group (embedding, norm, head), then each block. Backward: each block
    # again (resharded after forward); the root kept its own. Gradients: one reduce-scatter per
    # group, fp32 as the parameters. Every parameter divides by 2: no padding.
    assert _bytes(point, "all_gather", "forward") == [4 * ROOT, 4 * BLOCK, 4 * BLOCK]
    assert _bytes(point, "all_gather", "backward") == [4 * BLOCK, 4 * BLOCK]
    assert _bytes(point, "reduce_scatter", "backward") == [4 * BLOCK, 4 * BLOCK, 4 * ROOT]
    assert {(c.group, c.group_size) for c in point.collectives} == {("dp", 2)}
    assert point.params == TOTAL and point.params_per_rank == TOTAL // 2
    # The shards are what rank 0 keeps: 1/2 of the fp32 parameters (plus the RoPE tables,
    # buffers FSDP leaves whole: 2 x 64 x 16 fp32), 2 x 1/2 of them as AdamW state.
    assert point.breakdown["parameters"] == 4 * TOTAL // 2 + 2 * 64 * 16 * 4
    assert point.breakdown["optimizer_state"] == 2 * 4 * TOTAL // 2
    assert point.breakdown["collective"] > 0


def test_fsdp_noreshard_gathers_once_and_bf16_mixed_gathers_bf16_and_reduces_fp32():
    point = _trace("fsdp-noreshard", 4, StepOptions(precision="bf16-mixed"))
    assert _bytes(point, "all_gather") == [2 * ROOT, 2 * BLOCK, 2 * BLOCK]  # all in forward
    assert _bytes(point, "reduce_scatter") == [4 * BLOCK, 4 * BLOCK, 4 * ROOT]


def test_hsdp_reduce_scatters_in_the_shard_group_and_all_reduces_across_replicas():
    point = _trace("hsdp2", 4)  # 2 replicas of a 2-rank shard group
    assert _bytes(point, "reduce_scatter") == [4 * BLOCK, 4 * BLOCK, 4 * ROOT]
    assert _bytes(point, "all_reduce") == [4 * BLOCK // 2, 4 * BLOCK // 2, 4 * ROOT // 2]
    assert {c.group_size for c in point.collectives} == {2}
    assert point.params_per_rank == TOTAL // 2


def test_ddp_all_reduces_every_gradient_once_in_buckets():
    point = _trace("ddp", 2)
    reduced = _bytes(point, "all_reduce", "backward")
    assert sum(reduced) == 4 * TOTAL
    # DDP's first bucket holds 1 MiB (dist._DEFAULT_FIRST_BUCKET_BYTES), the next up to 25 MiB.
    assert len(reduced) == 2 and reduced[0] <= 2**20 + 4 * 128 * 512
    assert _bytes(point, "broadcast", "forward") == [2 * 64 * 16 * 4]  # the RoPE buffers, each forward
    assert point.params_per_rank == TOTAL
    # The buckets are their own category: one fp32 copy of every gradient.
    assert point.breakdown["collective"] == 4 * TOTAL


def test_flops_per_rank():
    one = _trace("fsdp", 1)  # one GPU: the plain step
    assert one.strategy.shard == "none" and one.collectives == ()
    assert _trace("fsdp", 2).flops == one.flops  # data parallelism: each rank does the whole step
    # Llama-style TP splits every matmul and attention head (the head too): half each.
    tp = _trace("tp2", 2)
    assert 2 * tp.flops == one.flops
    assert {c.group for c in tp.collectives} == {"tp"}
    # By hand: forward matmuls 2 x tokens x (parameters in linear layers), backward twice that;
    # attention forward 4 x B x heads x T^2 x head_dim per block (QK^T and PV), backward 2.5
    # times that (flop_counter's formula counts flash attention's recomputed QK^T).
    tokens = LOCAL_BATCH * CFG.seq_len
    linear = TOTAL - 512 * 128 - 128 - 2 * 2 * 128  # not the embedding, nor the norms
    attention = 2 * 4 * LOCAL_BATCH * 4 * CFG.seq_len ** 2 * 32
    assert one.flops == 3 * 2 * tokens * linear + 3.5 * attention


def test_fsdp_tp_uses_both_groups():
    point = _trace("fsdp+tp2", 4)
    groups = {(c.group, c.group_size) for c in point.collectives}
    assert groups == {("dp", 2), ("tp", 2)}
    # The dp all-gathers move the TP shards: half of each block's parameters, by the norms
    # (replicated over TP) and the q/k/v, gate/up, o, down splits.
    assert _bytes(point, "all_gather", "forward")[1] == 4 * (BLOCK - 2 * 128) // 2 + 4 * 2 * 128


# --- names and degrees -------------------------------------------------------------------------
def test_strategy_names_and_degrees():
    assert parse_strategies("ddp, fsdp,fsdp+tp2,hsdp2,fsdp-noreshard", 4) == [
        Strategy("ddp", 4, 4, 1, "ddp"), Strategy("fsdp", 4, 4, 1, "fsdp"), Strategy("fsdp+tp2", 4, 2, 2, "fsdp"),
        Strategy("hsdp2", 4, 4, 1, "hsdp", replicas=2), Strategy("fsdp-noreshard", 4, 4, 1, "fsdp-noreshard")]
    assert parse_strategies("tp4,fsdp+tp4", 4) == [Strategy("tp4", 4, 1, 4, "none"),
                                                   Strategy("fsdp+tp4", 4, 1, 4, "fsdp")]
    assert parse_strategies("fsdp", 1) == [Strategy("fsdp", 1, 1, 1, "none")]
    assert [s.name for s in parse_strategies("auto", 8)] == [  # plan/candidates.py's, no model: no pp
        "ddp", "fsdp", "fsdp-noreshard", "zero1", "zero2", "hsdp2", "hsdp4", "fsdp+tp2", "fsdp+tp4", "tp8"]
    for text, world_size, message in [("tp3", 4, "use tp4"), ("fsdp+tp3", 4, "N in 2, 4"),
                                      ("zero3", 4, "unknown strategy"),
                                      ("hsdp3", 4, "R in 2, 4"), ("tp2", 4, "fsdp\\+tp2"), ("", 4, "no strategy"),
                                      ("ddp", 0, "1 or more")]:
        with pytest.raises(OptionError, match=message) as error:
            parse_strategies(text, world_size)
        assert "\n" not in str(error.value)


def test_tp_on_a_model_without_a_plan_is_one_line():
    mlp = Workload(name="mlp", build_model=lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)),
                   make_batch=lambda b, device: torch.randn(b, 8, device=device),
                   loss_fn=lambda m, x: m(x).pow(2).mean())
    with pytest.raises(OptionError, match="has no tensor-parallel plan") as error:
        _trace("tp2", 2, workload=mlp)
    assert "\n" not in str(error.value)


def test_a_workloads_own_parallelize_is_used():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def parallelize(model, mesh):
        return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})

    mlp = Workload(name="mlp", build_model=lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)),
                   make_batch=lambda b, device: torch.randn(b, 8, device=device),
                   loss_fn=lambda m, x: m(x).pow(2).mean())
    mlp.parallelize = parallelize  # the field the coordinator adds to Workload
    point = _trace("tp2", 2, workload=mlp)
    assert point.params == 8 * 16 + 16 + 16 * 8 + 8
    assert point.params_per_rank == (8 * 16 + 16) // 2 + 16 * 8 // 2 + 8  # the row-split bias stays whole
    assert [(c.op, c.group, c.bytes) for c in point.collectives if c.phase == "forward"] == [
        ("all_reduce", "tp", LOCAL_BATCH * 8 * 4)]


# --- HF architectures --------------------------------------------------------------------------
HF_TINY = {
    "llama": dict(model_type="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
    "gpt2": dict(model_type="gpt2", vocab_size=512, n_positions=128, n_embd=128, n_layer=2, n_head=4,
                 bos_token_id=0, eos_token_id=0),
    "bert": dict(model_type="bert", vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=256, max_position_embeddings=128, architectures=["BertForMaskedLM"]),
}


@pytest.mark.parametrize("model_type", list(HF_TINY))
def test_hf_architectures_have_tp_plans(model_type, tmp_path):
    """Mistral is Llama's module tree (the same plan); Qwen2 adds q/k/v biases."""
    pytest.importorskip("transformers")
    from batchfit.zoo.hf import hf_workload

    config = tmp_path / "config.json"
    config.write_text(json.dumps(HF_TINY[model_type]))
    work = hf_workload(str(config), seq_len=32)
    tp = _trace("tp2", 2, workload=work)
    assert {(c.group, c.group_size) for c in tp.collectives} == {("tp", 2)}
    assert tp.params / 2 <= tp.params_per_rank < tp.params  # the blocks split; GPT-2's, BERT's embeddings whole
    if model_type == "llama":  # everything split, as in PyTorch's Llama example: half the FLOPs
        assert 2 * tp.flops == _trace("fsdp", 1, workload=work).flops
        norms = 2 * 2 * 128 + 128  # two per layer and the final one: replicated (sequence parallel)
        assert tp.params_per_rank == (tp.params - norms) // 2 + norms
