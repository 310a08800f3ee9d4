"""--routing: MoE expert loops traced on fake tensors by a stated routing (trace/routing.py),
held to real CPU steps under the torch profiler (tests/cpu_truth.py) with the router forced.

Checked against transformers' own MoE blocks running for real on a CPU step with the router forced (the profiler's
timeline)."""

from __future__ import annotations

import warnings

import pytest
import torch

from batchfit.errors import OptionError
from batchfit.options import Routing
from batchfit.trace.memory import MemoryTracker
from batchfit.trace.routing import tokens_per_expert
from batchfit.trace.session import TraceSession
from batchfit.train.step import TrainingStep
from batchfit.workload import StepOptions, Workload
from batchfit.zoo.hf import _unpacked_sequences
from cpu_truth import profiled_step_peak, same_kernels_on_any_x86
from tiny import EXPERTS, TOP_K, B, T, forced, tiny_moe

transformers = pytest.importorskip("transformers")


def test_tokens_per_expert_by_hand():
    parse = Routing.parse
    assert tokens_per_expert(parse("balanced"), 32, 2, 8) == [8] * 8
    assert tokens_per_expert(parse("balanced"), 5, 2, 4) == [3, 3, 2, 2]  # 10 routed, the remainder first
    assert tokens_per_expert(parse("worst"), 32, 2, 8) == [32, 32, 0, 0, 0, 0, 0, 0]
    assert tokens_per_expert(parse("capacity:1.0"), 32, 2, 8) == [8] * 8  # ceil(1.0 x 64 / 8)
    assert tokens_per_expert(parse("capacity:2"), 32, 2, 8) == [16, 16, 16, 16, 0, 0, 0, 0]  # as uneven as allowed
    assert tokens_per_expert(parse("capacity:0.5"), 32, 2, 8) == [4] * 8  # 32 of the 64 routed dropped


@pytest.mark.parametrize("bad", ["even", "capacity:", "capacity:-1", "capacity:x", "capacity:nan"])
def test_a_bad_routing_is_one_line(bad):
    with pytest.raises(OptionError, match="use balanced") as info:
        Routing.parse(bad)
    assert "\n" not in str(info.value)


def traced(workload: Workload, routing: str, precision: str = "fp32") -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with TraceSession(workload, StepOptions(routing=routing, precision=precision, optimizer="sgd"),
                          cuda_semantics=False, tracker=MemoryTracker(round_bytes=1)) as session:
            return session.trace(B).snapshot.peak_bytes


def measured(workload: Workload, tmp_path, precision: str = "fp32") -> int:
    """The real step's peak, on the CPU kernels that allocate alike on every x86 CPU (one thread,
    oneDNN off: cpu_truth.same_kernels_on_any_x86): the trace counts no kernel's own scratch."""
    torch.manual_seed(0)
    with same_kernels_on_any_x86():
        step = TrainingStep(workload, StepOptions(precision=precision, optimizer="sgd"), torch.device("cpu"))
        return profiled_step_peak(step, B, tmp_path)


@pytest.mark.slow
def test_a_forced_balanced_router_matches_the_balanced_trace_and_no_routing_exceeds_them_all(tmp_path):
    """The expert loop on real tensors with the routing forced balanced (64 tokens x top-2 over 8
    experts: 16 each, the counts the trace gives each expert), against the balanced trace: within
    2% (2,541,128 B traced against 2,541,096 B: the 32 B are the rotary embedding's
    original_inv_freq, a buffer the step never reads, which the profiler's timeline never sees). The
    step calls the model as hf: workloads do (zoo/hf.py: _unpacked_sequences): on fake tensors HF
    cannot read that no sequence is packed and builds a [B, 1, T, T] mask with K/V repeated per query
    head, which the real step (is_causal, native GQA) never holds: 38,784 B more before. A real router
    with random weights routes unevenly; on one GPU HF's loop costs more the more experts are hit
    (each hit expert's slice sends back a gradient the size of the whole stacked weight), so `worst`
    (2 experts hit) is not the one-GPU bound: the most of the three routings is (balanced here)."""
    balanced = traced(tiny_moe("balanced"), "balanced")
    forced = measured(tiny_moe("balanced"), tmp_path)
    assert abs(balanced - forced) <= 0.02 * forced, (balanced, forced)
    real = measured(tiny_moe(), tmp_path)  # random router weights: uneven
    bound = max(traced(tiny_moe(), r) for r in ("balanced", "worst", "capacity:1.5"))
    assert real <= bound, (real, bound)


def test_hf_grouped_gemm_reads_no_routing_and_matches_a_real_step(tmp_path):
    """HF's grouped-GEMM experts (grouped_mm_experts_forward: tokens x top_k rows sorted by expert,
    one grouped_mm) read no values: the same bytes under every routing; against a real bf16 CPU step:
    1,137,640 B traced, 1,137,624 B measured (16 B: original_inv_freq, unseen by the profiler)."""
    grouped = tiny_moe(implementation="grouped_mm")
    balanced, worst = traced(grouped, "balanced", "bf16"), traced(grouped, "worst", "bf16")
    assert balanced == worst
    real = measured(tiny_moe(implementation="grouped_mm"), tmp_path, "bf16")
    assert abs(balanced - real) <= 0.02 * real, (balanced, real)


def tiny_mixtral() -> Workload:
    """A tiny Mixtral, its router forced balanced: its own router normalizes topk's output in place
    (``router_top_value /= ...``), which selective checkpointing must not have cached."""
    config = transformers.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
                                        num_experts_per_tok=TOP_K, use_cache=False)

    def build():
        model = transformers.MixtralForCausalLM._from_config(config, attn_implementation="sdpa",
                                                             experts_implementation="eager")
        for layer in model.model.layers:
            forced("balanced")(layer.mlp.gate)
        return model

    def loss_fn(model, ids):
        with _unpacked_sequences(transformers):
            return model(input_ids=ids, labels=ids).loss

    return Workload(name="tiny-mixtral", build_model=build,
                    make_batch=lambda b, device: torch.randint(0, 128, (b, T), device=device), loss_fn=loss_fn)


def test_selective_checkpointing_runs_over_an_hf_router_that_normalizes_in_place():
    """One Mixtral MoE block on real tensors under the selective policy: its router's topk output,
    divided in place, is recomputed (from the kept logits), not cached: forward and backward run, and
    give the gradients of the block run without checkpointing."""
    from torch.utils.checkpoint import checkpoint

    from batchfit.train.checkpointing import selective_context_fn

    torch.manual_seed(0)
    config = transformers.MixtralConfig(hidden_size=16, intermediate_size=32, num_local_experts=4,
                                        num_experts_per_tok=2)
    block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 8, 16)
    checkpoint(block, x, use_reentrant=False, context_fn=selective_context_fn(block)).square().sum().backward()
    kept = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad()
    block(x).square().sum().backward()
    for name, p in block.named_parameters():
        torch.testing.assert_close(kept[name], p.grad, msg=name)


@pytest.mark.slow
def test_selective_checkpointing_over_an_hf_moe_block_matches_a_real_step(tmp_path):
    """torchtitan's selective policy keeps topk's output, which Mixtral's router then divides in place:
    the trace (and a real step, the same check) failed with "Tensor cached during selective activation
    checkpoint has been mutated". Over an HF MoE block the router's logits are kept and topk recomputed
    from them (train/checkpointing.py). Against a real CPU step with the same (forced) routing:
    1,515,848 B traced, 1,515,816 B measured (32 B: original_inv_freq, unseen by the profiler)."""
    options = StepOptions(checkpointing="selective", optimizer="sgd")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with TraceSession(tiny_mixtral(), options, cuda_semantics=False, tracker=MemoryTracker(round_bytes=1)) as s:
            selective = s.trace(B).snapshot.peak_bytes
    torch.manual_seed(0)
    with same_kernels_on_any_x86():
        real = profiled_step_peak(TrainingStep(tiny_mixtral(), options, torch.device("cpu")), B, tmp_path)
    assert abs(selective - real) <= 0.01 * real, (selective, real)
