"""Pipeline parallelism on HF causal LMs, cut by their own ``base_model_pp_plan``
(``distributed/pipeline_hf.py``).

Truths: the stages run one after the other give the whole model's logits and loss on real tensors
(each family, same weights: the rotary tables, the causal mask, the per-layer attention kinds and
Granite's embedding multiplier each stage rebuilds are the whole model's); a real 2-process gloo
pipeline of Qwen3 runs torch's own ``PipelineStage`` + ``Schedule1F1B`` (and ``ScheduleZBVZeroBubble`` with
full activation checkpointing) on those stages, each rank's
profiled peak against the trace of that pipeline rank (``tests/pipeline_truth.py``'s gloo run, with
the HF model and its own loss); under tp2 (2 gloo processes) the stages in a row, each parallelized alone,
give the whole model's logits too; the rest is counted by hand (which parameters each pipeline rank holds).

Checked against torch's own schedules running for real over gloo, on stages cut by transformers' own
base_model_pp_plan.
"""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch

from batchfit.devices import get_device
from batchfit.errors import OptionError
from batchfit.plan.pipeline import PipelineSession
from batchfit.plan.sharded import parse_strategy
from batchfit.workload import StepOptions
from pipeline_truth import MICRO, MICROBATCHES, WORLD, measure_pipeline, real_schedule

pytest.importorskip("transformers")

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=128, pad_token_id=0, bos_token_id=0, eos_token_id=0,
            tie_word_embeddings=False)
FAMILIES = {
    "llama": dict(model_type="llama", **TINY),
    "qwen2": dict(model_type="qwen2", **TINY),
    "qwen3": dict(model_type="qwen3", head_dim=16, **TINY),
    "mistral": dict(model_type="mistral", **TINY),
    "phi3": dict(model_type="phi3", **TINY),
    "gpt_neox": dict(model_type="gpt_neox", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, vocab_size=256, max_position_embeddings=128, bos_token_id=0,
                     eos_token_id=0, tie_word_embeddings=False),
    "olmo2": dict(model_type="olmo2", **TINY),
    # a multiplier other than 1, applied by the first stage only
    "granite": dict(model_type="granite", embedding_multiplier=3.0, logits_scaling=2.0, **TINY),
    "gemma": dict(model_type="gemma", head_dim=16, **{**TINY, "tie_word_embeddings": True}),
    # full attention in the first stage's layers, a 4-token window in the second's: a stage that read
    # the whole model's layer_types by its own layer index would mask its layers as full
    "gemma3": dict(model_type="gemma3_text", head_dim=16, sliding_window=4,
                   layer_types=["full_attention"] * 2 + ["sliding_attention"] * 2, **TINY),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, **TINY),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      head_dim=16, **TINY),
}
SEQ = 32
MEASURED = "qwen3"


def _config_path(family: str, folder) -> str:
    path = folder / f"{family}.json"
    path.write_text(json.dumps(FAMILIES[family]))
    return str(path)


def _workload(family: str, folder):
    from batchfit.zoo.hf import hf_workload

    return hf_workload(_config_path(family, folder), seq_len=SEQ)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_stages_in_a_row_compute_the_whole_models_logits_and_loss(family, tmp_path):
    from batchfit.distributed.pipeline import split_stage
    from batchfit.distributed.pipeline_hf import hf_stage_loss

    workload = _workload(family, tmp_path)
    torch.manual_seed(0)
    model = workload.build_model()
    batch = workload.make_batch(2, torch.device("cpu"))
    with torch.no_grad():
        whole = model(**batch)
        out = batch["input_ids"]
        for s in range(2):
            stage = split_stage(copy.deepcopy(model), s, 2)
            assert sum(p.numel() for p in stage.parameters()) < sum(p.numel() for p in model.parameters())
            out = stage(out)
        loss = hf_stage_loss(stage, out, batch["labels"])
    torch.testing.assert_close(out, whole.logits)
    torch.testing.assert_close(loss, whole.loss)


def _session(workload, name: str = "pp2", schedule: str = "1f1b", world: int = WORLD,
             microbatches: int = MICROBATCHES, micro: int = MICRO, checkpointing: str = "none"):
    strategy = parse_strategy(name, world, pp_schedule=schedule, microbatches=microbatches)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        session = PipelineSession(workload, StepOptions(checkpointing=checkpointing), get_device("h100-80gb"),
                                  strategy, cuda_semantics=False)
        session.trace(micro * microbatches)
    return session


FAST = ("llama", "gpt_neox", "gemma")
"""In the fast tier (~3-5 s each on a loaded machine: two pipeline ranks traced): Llama's tree (Qwen2/3,
Mistral, Phi-3, Granite, OLMo 2, the MoEs name their parts alike), GPT-NeoX's own names and its embedding
dropout, a tied head; the rest slow (the stages-in-a-row truth above covers every family in the fast tier)."""


@pytest.mark.parametrize("family", [f if f in FAST else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES])
def test_each_pipeline_rank_holds_its_stages_parameters(family, tmp_path):
    """The first rank: the embedding and the first half of the layers; the last: the other half, the
    final norm and the head (Gemma's head tied to the embedding: a copy on each end). Counted by hand
    from the whole model's parameter names."""
    workload = _workload(family, tmp_path)
    with torch.device("meta"):
        model = workload.build_model()
    base = model.base_model_prefix
    embed = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings().weight.numel()
    layer = sum(p.numel() for n, p in model.named_parameters() if n.startswith(f"{base}.layers.0."))
    rest = sum(p.numel() for p in model.parameters()) - embed - 4 * layer - (0 if model.config.tie_word_embeddings
                                                                             else head)  # the final norm
    session = _session(workload, microbatches=2, micro=1)  # the fewest actions: the parameters are the point
    first, last = (s.point for s in session.stage_points)
    assert first.params_per_rank == embed + 2 * layer
    assert last.params_per_rank == 2 * layer + rest + head
    assert first.peak_bytes > 0 and last.peak_bytes > 0


def test_a_tied_head_across_stages_is_written_down(tmp_path):
    from batchfit.distributed.pipeline import pipeline_approximations

    strategy = parse_strategy("pp2", WORLD, pp_schedule="1f1b", microbatches=MICROBATCHES)
    tied = pipeline_approximations([strategy], _workload("gemma", tmp_path))
    untied = pipeline_approximations([strategy], _workload("llama", tmp_path))
    assert len(tied) == len(untied) + 1 and "tied to its embedding" in tied[-1].what


TP_ROWS = ("llama", "gemma", "phi3", "gpt_neox")
"""Under tp2: the sequence-parallel hand plan (Llama; Gemma's tied head), the models' own plans (Phi-3's
gathered fused projections, GPT-NeoX's vocabulary-split embedding)."""


def _tp_rows_main(rank: int, port: int, out_dir: str, paths: dict) -> None:
    """Each family's stages in a row under tp2 (each stage parallelized alone, the hidden state handed on as
    this rank's plain tensor, as PipelineStage sends it), against the whole model's logits without TP."""
    import os

    from torch.distributed.device_mesh import init_device_mesh

    from batchfit.distributed.pipeline import split_stage
    from batchfit.distributed.tp_plans import tp_plan
    from batchfit.zoo.hf import hf_workload
    from cpu_truth import join_gloo

    join_gloo(rank, 2, port, timeout_s=120)
    mesh = init_device_mesh("cpu", (2,))
    out = {}
    for family, path in paths.items():
        workload = hf_workload(path, seq_len=SEQ)
        torch.manual_seed(0)  # the same weights and batch on both ranks
        model = workload.build_model()
        batch = workload.make_batch(2, torch.device("cpu"))
        with torch.no_grad():
            whole = model(**batch).logits
            hidden = batch["input_ids"]
            for s in range(2):
                stage = split_stage(copy.deepcopy(model), s, 2)
                stage = tp_plan(stage, "gathered")(stage, mesh)
                hidden = stage(hidden)
                if s == 0:
                    sent = list(hidden.shape)
        out[family] = {"error": (hidden - whole).abs().max().item(), "sent": sent}
    if rank == 0:
        with open(os.path.join(out_dir, "rows.json"), "w") as f:
            json.dump(out, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.slow  # two processes, four families: ~40 s on a loaded machine
def test_stages_in_a_row_under_tp_compute_the_whole_models_logits(tmp_path):
    from cpu_truth import spawn_profiled_gloo

    paths = {family: _config_path(family, tmp_path) for family in TP_ROWS}
    spawn_profiled_gloo(_tp_rows_main, lambda port: (port, str(tmp_path), paths), nprocs=2)
    rows = json.loads((tmp_path / "rows.json").read_text())
    for family in TP_ROWS:
        assert rows[family]["error"] < 1e-5, (family, rows[family])
    # the sequence-parallel plans send this rank's half of the sequence, the models' own plans all of it
    assert {family: rows[family]["sent"][1] for family in TP_ROWS} == {"llama": SEQ // 2, "gemma": SEQ // 2,
                                                                       "phi3": SEQ, "gpt_neox": SEQ}


def test_a_split_backward_under_sequence_parallel_tp_is_one_line(tmp_path):
    with pytest.raises(OptionError, match="stage_backward_input cannot detach") as error:
        _session(_workload("llama", tmp_path), "pp2+tp2", schedule="zbv", world=4)
    assert "\n" not in str(error.value)


def test_auto_lists_hf_pipelines_with_tp_but_not_under_zero_bubble_on_sequence_parallel_plans(tmp_path):
    from batchfit.plan.candidates import candidates, model_facts
    from batchfit.plan.world import World

    llama, phi3 = model_facts(_workload("llama", tmp_path)), model_facts(_workload("phi3", tmp_path))
    assert llama.n_layers == 4 and not llama.pp_tp_split_backward and phi3.pp_tp_split_backward
    names = {c.name: c for c in candidates(World(8), llama)}
    assert names["pp2+fsdp"].skipped is None and names["pp2+fsdp+tp2"].skipped is None
    zbv = {c.name for c in candidates(World(8), llama, pp_schedule="zbv")}
    assert "pp2+fsdp-noreshard" in zbv and not any(n.startswith("pp") and "tp" in n for n in zbv)
    assert "pp2+fsdp-noreshard+tp2" in {c.name for c in candidates(World(8), phi3, pp_schedule="zbv")}


RUNS = (("1f1b", "none"), ("zbv", "full"))
"""The default schedule, and the V shape's split backward with each block recomputed (test_pipeline's hardest)."""


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    path = _config_path(MEASURED, tmp_path_factory.mktemp("hf-config"))
    return measure_pipeline(tmp_path_factory, RUNS, hf_config=path)


@pytest.mark.slow  # two processes building, running and profiling the HF stages: ~1-3 min on a loaded machine
@pytest.mark.parametrize("schedule, checkpointing", RUNS)
def test_each_stage_peak_matches_a_real_gloo_pipeline(measured, schedule, checkpointing, tmp_path):
    session = _session(_workload(MEASURED, tmp_path), schedule=schedule, checkpointing=checkpointing)
    key = schedule if checkpointing == "none" else f"{schedule} --checkpointing {checkpointing}"
    for stage in session.stage_points:
        real = measured[stage.rank]["peaks"][key]
        traced = stage.point.total_peak_bytes or stage.point.peak_bytes
        print(f"{MEASURED} {key} stage {stage.rank}: traced {traced} B, gloo {real} B, {(traced - real) / real:+.2%}")
        assert abs(traced - real) / real < 0.03, (stage.rank, traced, real)


@pytest.mark.slow  # a trace of each schedule (~15 s each)
def test_every_schedule_traces_an_hf_pipeline_under_fsdp(tmp_path):
    """pp2+fsdp on 4 GPUs under each schedule; GPipe keeps all 4 micro-batches in flight on the first rank
    where 1F1B keeps 2, so its first rank's peak is the larger."""
    workload = _workload("qwen3", tmp_path)
    peaks = {}
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b:2", "interleaved-zb:2", "zbv", "dualpipev"):
        name = "pp2+fsdp-noreshard" if schedule in ("interleaved-zb:2", "zbv", "dualpipev") else "pp2+fsdp"
        session = _session(workload, name, schedule=schedule, world=4)
        peaks[schedule] = [s.point.peak_bytes for s in session.stage_points]
        assert len(peaks[schedule]) == 2 and min(peaks[schedule]) > 0
    assert peaks["gpipe"][0] > peaks["1f1b"][0]


PROFILED = 4
"""Steps each rank of the 4-rank pp x tp run profiles."""


def _pp_tp_main(rank: int, port: int, out_dir: str, path: str, schedule_name: str) -> None:
    """Rank ``rank`` of a real pp2 x tp2 pipeline of the HF model at ``path`` (torch's PipelineStage and
    schedule on each pipeline rank's tp-parallelized stages, the loss under loss_parallel as torchtitan's
    train_context runs it): its profiled peak in peaks<rank>.json."""
    import dataclasses
    import os
    from pathlib import Path

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.tensor.parallel import loss_parallel

    from batchfit.distributed.pipeline import build_rank
    from batchfit.distributed.pipeline_hf import hf_stage_loss
    from batchfit.distributed.pipeline_run import stage_batch
    from batchfit.distributed.pp_schedules import parse_schedule, rank_stages
    from batchfit.distributed.tp_plans import tp_plan
    from batchfit.train.step import TrainingStep
    from batchfit.zoo.hf import hf_workload
    from cpu_truth import join_gloo, profiled_step_peak

    join_gloo(rank, 4, port, timeout_s=180)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp_rank = mesh["pp"].get_local_rank()
    schedule = parse_schedule(schedule_name, MICROBATCHES)
    n_stages = 2 * schedule.virtual
    indices = rank_stages(schedule, 2, pp_rank)
    base = hf_workload(path, seq_len=SEQ)

    def build():
        holder = build_rank(base.build_model, n_stages, indices)
        for i, stage in enumerate(holder.stages):
            holder.stages[i] = tp_plan(stage)(stage, mesh["tp"])
        return holder

    torch.manual_seed(0)
    step = TrainingStep(dataclasses.replace(base, build_model=build), StepOptions(), torch.device("cpu"))
    stages = [PipelineStage(module, s, n_stages, torch.device("cpu"), group=mesh["pp"].get_group())
              for module, s in zip(step.model.stages, step.model.stage_indices)]
    runtime = real_schedule(schedule_name, stages, MICROBATCHES,
                             loss_fn=lambda logits, y, _stage=step.model.stages[0]: hf_stage_loss(_stage, logits, y))
    x, y = stage_batch(base.make_batch(MICRO * MICROBATCHES, torch.device("cpu")))
    x = x if 0 in indices else None
    y = y if n_stages - 1 in indices else None

    def run(batch_size, hooks=None):
        with loss_parallel():
            runtime.step(*(() if x is None else (x,)), target=y, return_outputs=False)
        step.optimizer.step()
        step.optimizer.zero_grad(set_to_none=True)

    step.run = run
    run(MICRO)
    folder = Path(out_dir) / str(rank)
    folder.mkdir(exist_ok=True)  # spawn_profiled_gloo may run the ranks again
    # Each rank profiles PROFILED steps (so the collectives stay paired) and keeps the least peak of those
    # whose memory timeline passed its own data-flow check: on 4 ranks it fails now and then on one of them
    # ("version mismatch"), which agreed_profiled_peak would count against every rank's step.
    peaks = []
    for _ in range(PROFILED):
        try:
            peaks.append(profiled_step_peak(step, MICRO, folder, warmup=0))
        except AssertionError:
            pass
    with open(os.path.join(out_dir, f"peaks{rank}.json"), "w") as f:
        json.dump(min(peaks, default=None), f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


# four processes on the CPU: 84 s idle, extended (CI's 30 minutes); pp+tp's HF stages still run in CI
# (test_stages_in_a_row_under_tp_compute_the_whole_models_logits)
@pytest.mark.slow
@pytest.mark.extended
def test_pp_tp_stage_peaks_match_a_real_4_rank_gloo_pipeline(tmp_path):
    """pp2+tp2 on 4 gloo ranks (the sequence-parallel hand plan on Llama): tp rank 0 of each pipeline rank
    against the trace of that pipeline rank (the trace is the inner strategy's rank 0). Seen on 2026-11-28:
    the last pipeline rank 52 B apart, the first 8,492 B (-0.56%) under the gloo run's least of 4 steps
    (about one micro-batch's [2, 16, 64] fp32 hidden-state shard, 8 KiB; not explained: that rank's steps
    differ by up to 49 KB between themselves, the late gloo collectives of the tp group)."""
    from cpu_truth import spawn_profiled_gloo

    path = _config_path("llama", tmp_path)
    spawn_profiled_gloo(_pp_tp_main, lambda port: (port, str(tmp_path), path, "1f1b"), nprocs=4)
    session = _session(_workload("llama", tmp_path), "pp2+tp2", world=4)
    for stage in session.stage_points:
        real = json.loads((tmp_path / f"peaks{2 * stage.rank}.json").read_text())
        assert real is not None, f"rank {2 * stage.rank}: the memory timeline failed on all {PROFILED} steps"
        traced = stage.point.total_peak_bytes or stage.point.peak_bytes
        print(f"pp2+tp2 1f1b pipeline rank {stage.rank}: traced {traced} B, gloo {real} B, "
              f"{(traced - real) / real:+.2%}")
        assert abs(traced - real) / real < 0.03, (stage.rank, traced, real)
