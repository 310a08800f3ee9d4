"""Tensor-parallel plans of HF families read from their own ``base_model_tp_plan``
(``distributed/tp_plans_hf.py``), and the Llama-shaped ones that get the hand plan.

Truth: two real processes on the CPU over gloo run Phi-3 (fused qkv_proj / gate_up_proj, split by
columns with the output gathered, as transformers' own plan says) and GPT-NeoX (the embedding split
by vocabulary rows, the head-by-head fused query_key_value split by columns) under tp2 with
``batchfit.distributed`` on real tensors; rank 0's peak in a steady step (the profiler's memory
timeline) is compared with the trace on the fake process group (CPU semantics). The rest is counted
by hand: which parameters each rank holds half of.

Checked against torch's own DTensor styles running for real over gloo, with the layouts batchfit reads from
transformers' own base_model_tp_plan (checks the counting of that reading, not its fidelity to transformers' own
TensorParallelLayer code).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from batchfit.devices import get_device
from batchfit.errors import OptionError
from batchfit.plan.sharded import parse_strategy, trace_sharded
from batchfit.workload import StepOptions
from cpu_truth import agreed_profiled_peak, gloo_step, join_gloo, leave_gloo, spawn_profiled_gloo

pytest.importorskip("transformers")

SMALL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=128, pad_token_id=0, bos_token_id=0,
             eos_token_id=0, tie_word_embeddings=False)
FAMILIES = {
    "phi3": dict(model_type="phi3", **SMALL),
    "gpt_neox": dict(model_type="gpt_neox", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, vocab_size=512, max_position_embeddings=128, bos_token_id=0,
                     eos_token_id=0, tie_word_embeddings=False),
    "olmo2": dict(model_type="olmo2", **SMALL),
    "gemma3": dict(model_type="gemma3_text", head_dim=32, **SMALL),
    "starcoder2": dict(model_type="starcoder2", **SMALL),
}
"""Families on their own plan."""
HAND = {
    "qwen3": dict(model_type="qwen3", head_dim=32, **SMALL),
    "granite": dict(model_type="granite", **SMALL),
    "gemma": dict(model_type="gemma", head_dim=32, **SMALL),
}
"""Llama-shaped families on the hand plan (sequence-parallel norms)."""
MEASURED = ("phi3", "gpt_neox")
FAST = ("phi3", "gpt_neox", "qwen3")
"""Traced in the fast tier (~3-5 s each on a loaded machine); the other families' traces are slow."""


def _tiered(families) -> list:
    return [f if f in FAST else pytest.param(f, marks=pytest.mark.slow) for f in families]
SEQ = 32
LOCAL_BATCH = 4


def _workload(config: dict, folder):
    from batchfit.zoo.hf import hf_workload

    path = os.path.join(str(folder), f"{config['model_type']}.json")
    with open(path, "w") as f:
        json.dump(config, f)
    return hf_workload(path, seq_len=SEQ)


def _trace(workload, strategy: str = "tp2", world: int = 2, options: StepOptions = StepOptions()):
    return trace_sharded(workload, options, get_device("h100-80gb"), parse_strategy(strategy, world), LOCAL_BATCH,
                         cuda_semantics=False)


def _gloo_main(rank: int, port: int, out_dir: str, families: tuple[str, ...]) -> None:
    from pathlib import Path

    from batchfit.distributed.tp_plans import tp_plan

    join_gloo(rank, 2, port, timeout_s=120)
    out = {}
    for family in families:
        folder = Path(out_dir) / f"{family}-{rank}"
        folder.mkdir(exist_ok=True)  # spawn_profiled_gloo runs the ranks again after a crash
        workload = _workload(FAMILIES[family], folder)  # one file per rank: the ranks never read a half-written file
        step = gloo_step(workload, StepOptions(), parse_strategy("tp2", 2), tp_plan_of=tp_plan)
        out[family] = agreed_profiled_peak(step, LOCAL_BATCH, folder, best_of=2)
        del step
    leave_gloo(rank, os.path.join(out_dir, "peaks.json"), out)


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("gloo-tp-hf")
    spawn_profiled_gloo(_gloo_main, lambda port: (port, str(path), MEASURED), nprocs=2)
    return json.loads((path / "peaks.json").read_text())


@pytest.mark.slow  # the gloo run: ~60 s on a loaded 2-core machine
@pytest.mark.parametrize("family", MEASURED)
def test_own_plan_peak_matches_a_real_gloo_run(measured, family, tmp_path):
    point = _trace(_workload(FAMILIES[family], tmp_path))
    real = measured[family]
    print(f"{family} tp2: traced {point.peak_bytes} B, gloo {real} B, {(point.peak_bytes - real) / real:+.2%}")
    assert abs(point.peak_bytes - real) / real < 0.02, (point.peak_bytes, real)


def _split_by_hand(model) -> tuple[int, int]:
    """(elements a tp2 rank holds, all elements) of an HF model on its own plan, counted from the
    plan's names: colwise weights and biases halve, rowwise weights halve (their bias whole),
    the vocabulary-split embedding and the head halve; everything else (the replicated styles too) whole."""
    from batchfit.distributed.tp_plans_hf import WHOLE, resolved_plan

    base = getattr(model, model.base_model_prefix)
    halves = set()
    for name, style in resolved_plan(model).items():
        if style in WHOLE:  # Gemma 3's per-head q/k norms
            continue
        module = base.get_submodule(name)
        halves.add(id(module.weight))
        if style.startswith("colwise") and getattr(module, "bias", None) is not None:
            halves.add(id(module.bias))
    halves.add(id(model.get_output_embeddings().weight))
    total = sum(p.numel() for p in model.parameters())
    return sum(p.numel() // 2 if id(p) in halves else p.numel() for p in model.parameters()), total


@pytest.mark.parametrize("family", _tiered(FAMILIES))
def test_own_plans_split_what_they_name(family, tmp_path):
    workload = _workload(FAMILIES[family], tmp_path)
    point = _trace(workload)
    with torch.device("meta"):
        per_rank, total = _split_by_hand(workload.build_model())
    assert point.params == total
    assert point.params_per_rank == per_rank
    assert {(c.group, c.group_size) for c in point.collectives} == {("tp", 2)}
    assert point.tp_loss == "sharded"  # the untied head keeps its logits split on the vocabulary


@pytest.mark.parametrize("family", _tiered(HAND))
def test_llama_shaped_families_get_the_sequence_parallel_hand_plan(family, tmp_path):
    """Everything but the norms split (the norms replicated, sequence-parallel): PyTorch's Llama
    example's count, and its reduce-scatters onto the sequence shards."""
    workload = _workload(HAND[family], tmp_path)
    point = _trace(workload)
    with torch.device("meta"):
        model = workload.build_model()
    norms = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    assert point.params_per_rank == (point.params - norms) // 2 + norms
    assert "reduce_scatter" in {c.op for c in point.collectives}


def test_a_fused_projection_split_as_one_matrix_is_refused_in_one_line(tmp_path):
    """Phi-3's qkv_proj is [q; k; v] stacked: a column split of the whole would cut across q, k, v."""
    workload = _workload(FAMILIES["phi3"], tmp_path)
    build = workload.build_model

    def colwise_qkv():
        model = build()
        model.config.base_model_tp_plan = {**model.config.base_model_tp_plan,
                                           "layers.*.self_attn.qkv_proj": "colwise"}
        return model

    import dataclasses

    with pytest.raises(OptionError, match="fused qkv_proj by columns as one matrix") as error:
        _trace(dataclasses.replace(workload, build_model=colwise_qkv))
    assert "\n" not in str(error.value)


def test_a_style_with_no_dtensor_counterpart_is_named(tmp_path):
    """DeepSeek-V3's plan splits its experts with transformers' moe_tp_experts: named, one line."""
    config = dict(model_type="deepseek_v3", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, vocab_size=256,
                  max_position_embeddings=128, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                  first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
                  v_head_dim=16, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    with pytest.raises(OptionError, match="has no tensor-parallel plan .*'moe_tp_experts', which has no "
                                          "DTensor style") as error:
        _trace(_workload(config, tmp_path))
    assert "\n" not in str(error.value)
