"""Tracing at depths 2, 3, 4 and extrapolating gives the full trace's bytes, exactly.

Checked against batchfit's own whole-model trace (checks the extrapolation, not the fidelity to a GPU)."""

from __future__ import annotations

import pytest

from batchfit import StepOptions, get_device, load_workload
from batchfit.devices import Device
from batchfit.estimator.engine import estimate
from batchfit.trace import depth
from batchfit.trace.point import TracedCurve
from batchfit.trace.session import TraceSession


@pytest.mark.parametrize("spec,options", [
    ("gpt2-124m", StepOptions()),  # the optimizer step outgrows backward between depth 3 and 12
    # Llama 3.2 1B with 10 of its 16 blocks (conftest.fewer_blocks): still traced by depth, and the
    # whole trace it is held to costs 10/16 of the shipped model's (32 s: the slow tier)
    pytest.param("hf:llama-3.2-1b", StepOptions(precision="bf16-mixed", checkpointing="full"), marks=pytest.mark.slow),
])
def test_by_depth_equals_the_full_trace(spec, options, fewer_blocks):
    workload = load_workload(fewer_blocks(spec, 10) if spec.startswith("hf:") else spec, seq_len=32)
    device = get_device("h100-80gb")
    results = []
    for by_depth in (True, False):
        with TracedCurve(workload, options, device, by_depth=by_depth) as traced:
            points = [traced.point(b) for b in (1, 3)]
            results.append(([(p.peak_bytes, p.phase, p.breakdown, p.peak_by_phase) for p in points],
                            traced.params, traced.trainable_params, traced.by_depth))
    (shallow, *counts_d, by_depth), (full, *counts_f, _) = results
    assert by_depth and shallow == full and counts_d == counts_f
    # and in the same order (estimate.json's peak_by_phase: a set's order, run to run, before)
    assert [list(p[3]) for p in shallow] == [list(p[3]) for p in full]


def test_a_line_that_bends_is_not_extrapolated():
    assert depth.DEPTHS == (2, 3, 4)
    assert depth.line_at([20, 30, 40], 32) == 320  # 10 bytes a block
    assert depth.line_at([20, 30, 41], 32) is None  # not affine: trace the whole model


def test_few_blocks_are_traced_whole(mlp):
    with TracedCurve(mlp, StepOptions(), get_device("t4-16gb")) as traced:
        traced.point(4)
        assert not traced.by_depth and traced.full_traces == [4]


@pytest.mark.slow
def test_a_phase_whose_peak_moves_to_another_part_with_depth():
    # 32 small blocks, 32768-token vocabulary: at depth 4 the backward peaks after the blocks
    # (the embedding's gradient), at depth 32 at its start (every block's activations saved), each by
    # about 1.4 MB. (12 blocks, vocabulary 8192, seq 112 did this while RMSNorm was traced as its CPU
    # composite and SDPA's output was copied to transpose: one more [seq, d] tensor per norm and per
    # attention than CUDA keeps. Without them a block holds less, and the crossing moved deeper.)
    # One line through the backward's peaks at depths 2, 3, 4 would miss that; its parts' lines do not.
    from batchfit.trace.session import TraceSession
    from batchfit.zoo import language_model_workload
    from batchfit.zoo.transformer import Transformer, TransformerConfig

    cfg = TransformerConfig(vocab_size=32768, seq_len=123, d_model=192, n_layers=32, n_heads=4, d_ff=768,
                            llama=True, tied_embeddings=False)
    workload = language_model_workload(name="moving-peak", build_model=lambda: Transformer(cfg),
                                       vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, description="")
    device = get_device("h100-80gb")
    with TracedCurve(workload, StepOptions(), device) as traced:
        deep = traced.point(1)
        assert traced.by_depth and traced.full_traces == []
    snaps = {}
    for d in (2, 3, 4, 32):
        with TraceSession(depth.at_depth(workload, d, depth.Depth()) if d < 32 else workload, StepOptions()) as s:
            snaps[d] = s.trace(1).snapshot
    backward = {d: {k: v for k, v in snap.peak_by_part.items() if k.startswith("backward:")}
                for d, snap in snaps.items()}
    assert max(backward[4], key=backward[4].get) == "backward:tail"
    assert max(backward[32], key=backward[32].get) == "backward:head"
    one_line = depth.line_at([snaps[d].peak_by_phase["backward"] for d in (2, 3, 4)], 32)
    whole = snaps[32]
    assert one_line != whole.peak_by_phase["backward"]  # what a single line per phase would have said
    workspace = device.workspace_bytes
    assert deep.peak_by_phase == {k: v + workspace for k, v in whole.peak_by_phase.items()}
    assert deep.breakdown_by_phase == {k: {**v, "workspace": workspace} for k, v in whole.breakdown_by_phase.items()}


def test_generation_is_traced_whole_with_the_bytes_depths_then_whole_gave():
    # GRPO's generate phase runs the policy's stack once per new token with a growing cache: no line
    # through depths 2, 3, 4 says where it peaks at 12 (it said 2.129 GB for 2.161), so a step that
    # generates is traced whole from its first size, its depths never traced. The figures are those of
    # de1c1c9, which traced batch 8 at depths 2, 3, 4 first, found the stack repeating, then traced it whole.
    workload = load_workload("grpo-gpt2-124m", seq_len=2)  # 2 new tokens: the same loop, quick
    said: list[str] = []
    with TracedCurve(workload, StepOptions(), get_device("rtx4090-24gb"), said.append, keep_streams=True) as traced:
        point = traced.reserved(8)  # a multiple of its group size
        assert not traced.by_depth and traced._shallow == [] and traced._forked is None
        assert traced.full_traces == traced.whole_reserved == [8]
    assert not any("at depths" in message for message in said)
    assert (point.peak_bytes, point.peak_reserved_bytes) == (2985347584, 3458203648)
    assert point.peak_by_phase == {"inputs": 1995913216, "generate": 2078905856, "reference": 2051429888,
                                   "forward": 2213477888, "backward": 2799409152, "optimizer": 2985347584,
                                   "idle": 1995911680}


def test_a_generating_step_cut_in_depth_cuts_the_policy():
    # The stack cut is the policy's, not the longer reference's (for whoever traces GRPO by depth)
    seen = depth.Depth()
    workload = depth.at_depth(load_workload("grpo-gpt2-124m", seq_len=2), 2, seen)
    with TraceSession(workload, StepOptions()) as session:
        assert seen.blocks == 12 and len(session.tracker._blocks) == 2


@pytest.mark.slow
def test_generation_traces_whole_at_every_size():
    # No size of a generating step extrapolates: every size is traced whole (no depths), and the
    # reserved peaks replay the whole model's own stream. Every figure equals the whole model's curve.
    workload = load_workload("grpo-gpt2-124m", seq_len=2)
    device = get_device("rtx4090-24gb")
    said: list[str] = []
    with TracedCurve(workload, StepOptions(), device, said.append, keep_streams=True, parallel=False) as traced, \
            TracedCurve(workload, StepOptions(), device, keep_streams=True, by_depth=False) as whole:
        for b in (8, 16, 24):
            assert traced.reserved(b) == whole.reserved(b)
        assert traced.full_traces == traced.whole_reserved == [8, 16, 24]
    assert not any("at depths" in message for message in said)


@pytest.mark.slow
def test_generation_estimate_is_the_one_traced_before():
    # GRPO with 4 new tokens on a 5 GiB GPU, traced whole only after batch 8 and replayed from the whole model's
    # streams. When written (speed2), the answer and every size's bytes equalled e38f4c0's, which traced depths
    # 2, 3, 4 and the whole model at each size (96 and 80 at target then). The figures pinned here are the
    # step after the reference log-probs became their own phase (the phases merge): 72, 64 at target
    # (the same once generation sampled as `generate` does: the update decides here, from its whole logits).
    # Since sizes whose replay needs no trace are replayed as probed (search.curve_search), 96 (88 cannot
    # reserve) is no longer traced to confirm the allocated answer; since the target's reserved guess takes the
    # ratio of the replayed size nearest the answer (search.reserved_guess), 56 is not traced either (64 fits
    # at target, 72 does not: the answer needs no more). Every other figure is unchanged.
    gpu = Device(name="g5", display_name="a 5 GiB GPU", total_bytes=5 << 30, context_bytes=0, workspace_bytes=8 << 20)
    result = estimate(load_workload("grpo-gpt2-124m", seq_len=4), device=gpu, cache=False, suggest=False).to_json()
    assert (result["max_batch_size"], result["max_batch_size_at_target"]) == (72, 64)
    assert {p["batch_size"]: (p["peak_bytes"], p["peak_reserved_bytes"]) for p in result["points"]} == {
        8: (2976733696, None), 16: (2976733696, None), 64: (4392498688, 4714397696),
        72: (4693171200, 5062524928), 80: (4993815552, None), 88: (5294460416, None), 112: (6196421632, None)}
    assert result["traced_by_depth"] is None  # whole at every size: a step that generates is not cut in depth
