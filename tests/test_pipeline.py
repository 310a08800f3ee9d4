"""Pipeline parallelism (pp<N>, --pp-schedule, --microbatches).

Truth without a GPU: two real processes on the CPU over gloo run torch's own pipelining
(``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` /
``ScheduleInterleavedZeroBubble`` / ``ScheduleZBVZeroBubble`` / ``ScheduleDualPipeV``) on the
stages of a 4-block Llama, cut as ``batchfit.distributed.pipeline.split_stage`` cuts it and placed
as ``pp_schedules.rank_stages`` places them; each rank's peak over a steady step (the profiler's
memory timeline) is compared with the trace of that pipeline rank on the fake process group (CPU
semantics). The action orders are checked against the list torch's runtime runs (the real
schedule objects' ``pipeline_order_with_comms``, on a fake process group here and on gloo), and
the bubble by hand.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from batchfit.devices import get_device
from batchfit.distributed.pp_schedules import bubble_fraction, in_flight, parse_schedule, rank_actions
from batchfit.errors import OptionError
from batchfit.options import Checkpointing
from batchfit.plan.pipeline import PipelineSession
from batchfit.plan.sharded import parse_strategy
from batchfit.train.step import TrainingStep
from batchfit.workload import StepOptions, Workload
from batchfit.zoo.transformer import TransformerConfig
from cpu_truth import join_gloo, spawn_profiled_gloo, tiny_llama_workload

CFG = TransformerConfig(vocab_size=256, seq_len=32, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=128,
                        llama=True, tied_embeddings=False)
MICRO = 2
MICROBATCHES = 4
WORLD = 2
SCHEDULES = ("gpipe", "1f1b", "interleaved-zb:2", "zbv")
"""One of each kind: a single stage per rank, split backward (I then W) on interleaved stages, the V
shape; benchmarks/pp_gloo.py runs every schedule (interleaved-1f1b, dualpipev too) on 2 and 4 ranks,
with and without checkpointing (results/pp-gloo-<date>.json), kept out of the suite for its time."""
CHECKPOINTED = ("zbv",)
"""Also run with full activation checkpointing: I recomputes each block, W again (a graph task each)."""
RUNS = tuple((name, "none") for name in SCHEDULES) + tuple((name, "full") for name in CHECKPOINTED)
FAST_RUNS = (("zbv", "full"),)
"""In the fast tier: the V shape's split backward with checkpointing (the hardest: two stages per
rank, I and W apart, each recomputing); the other runs are marked slow (``-m slow``), in a gloo
run of their own (1F1B's order is checked against torch's runtime without gloo, below)."""


def tiny_workload(n_layers: int = CFG.n_layers) -> Workload:
    import dataclasses

    return tiny_llama_workload(dataclasses.replace(CFG, n_layers=n_layers))


def _real_schedule(name: str, stages: list, microbatches: int, **kw):
    """torch's schedule object for ``--pp-schedule name`` over this rank's ``PipelineStage``s."""
    from torch.distributed.pipelining import schedules as S

    from batchfit.distributed.pp_schedules import KINDS, parse_schedule

    kind = KINDS[parse_schedule(name).kind]
    cls = getattr(S, kind.torch_class)
    return cls(stages[0] if kind.stages_per_rank == 1 else stages, microbatches, **kw)


def _compute_order(schedule, rank: int) -> list[tuple[str, int, int]]:
    """The compute actions torch's runtime runs on ``rank`` (its ``pipeline_order_with_comms``,
    OVERLAP_F_B's forward then backward), as ``rank_actions`` writes them."""
    from torch.distributed.pipelining import schedules as S

    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W",
             "REDUCE_GRAD": "R"}
    out = []
    for action in schedule.pipeline_order_with_comms[rank]:
        for a in action.sub_actions if action.computation_type == S.OVERLAP_F_B else (action,):
            kind = kinds.get(a.computation_type.name)
            if kind is not None:
                out.append((kind, a.stage_index, -1 if kind == "R" else a.microbatch_index))
    return out


def _key(name: str, checkpointing: str) -> str:
    return name if checkpointing == "none" else f"{name} --checkpointing {checkpointing}"


def _gloo_main(rank: int, port: int, out_dir: str, world: int = WORLD, microbatches: int = MICROBATCHES,
               runs: tuple[tuple[str, str], ...] = RUNS, n_layers: int = CFG.n_layers,
               hf_config: str | None = None) -> None:
    """Rank ``rank`` of a real ``world``-rank pipeline: its peak per (schedule, checkpointing) in
    peaks<rank>.json, and the compute order torch's runtime ran (multi-stage schedules). With
    ``hf_config`` (a config.json path) the model is that HF causal LM (``tests/test_pipeline_hf.py``),
    its loss the causal LM's own."""
    import dataclasses

    from torch.distributed.pipelining import PipelineStage

    from batchfit.distributed.pipeline import build_rank
    from batchfit.distributed.pipeline_hf import hf_stage_loss
    from batchfit.distributed.pipeline_run import stage_batch
    from batchfit.distributed.pp_schedules import parse_schedule, rank_stages
    from batchfit.zoo.hf import hf_workload
    from cpu_truth import agreed_profiled_peak

    join_gloo(rank, world, port, timeout_s=120)
    peaks, orders = {}, {}
    for name, checkpointing in runs:
        schedule = parse_schedule(name, microbatches)
        n_stages = world * schedule.virtual
        indices = rank_stages(schedule, world, rank)
        base = tiny_workload(n_layers) if hf_config is None else hf_workload(hf_config, seq_len=CFG.seq_len)
        workload = dataclasses.replace(base, build_model=lambda: build_rank(base.build_model, n_stages, indices,
                                                                            Checkpointing.parse(checkpointing)))
        torch.manual_seed(0)
        step = TrainingStep(workload, StepOptions(), torch.device("cpu"))
        stages = [PipelineStage(module, s, n_stages, torch.device("cpu"))
                  for module, s in zip(step.model.stages, step.model.stage_indices)]

        def loss_fn(logits, y, _stage=step.model.stages[0]):
            if hf_config is not None:  # the causal LM's own loss (each stage module is the causal LM, cut)
                return hf_stage_loss(_stage, logits, y)
            return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

        runtime = _real_schedule(name, stages, microbatches, loss_fn=loss_fn)
        x, y = stage_batch(workload.make_batch(MICRO * microbatches, torch.device("cpu")))
        x = x if 0 in indices else None
        y = y if n_stages - 1 in indices else None

        def run(batch_size, hooks=None, _schedule=runtime, _step=step, _x=x, _y=y):
            _schedule.step(*(() if _x is None else (_x,)), target=_y, return_outputs=False)
            _step.optimizer.step()
            _step.optimizer.zero_grad(set_to_none=True)

        step.run = run
        run(MICRO)  # builds the stage's buffers and the optimizer state
        # two profiled steps: the V-shaped ranks' local buffers, made by one step and replaced in the next
        peaks[_key(name, checkpointing)] = agreed_profiled_peak(step, MICRO, Path(out_dir) / str(rank), warmup=0,
                                                                steps=2)
        if hasattr(runtime, "pipeline_order_with_comms"):
            orders[name] = _compute_order(runtime, rank)
        dist.barrier()
    with open(os.path.join(out_dir, f"peaks{rank}.json"), "w") as f:
        json.dump({"peaks": peaks, "orders": orders}, f)
    dist.barrier()
    dist.destroy_process_group()


def _measure(tmp_path_factory, runs: tuple[tuple[str, str], ...], *, n_layers: int = CFG.n_layers,
             hf_config: str | None = None) -> dict:
    path = tmp_path_factory.mktemp("pp-gloo")
    for rank in range(WORLD):
        (path / str(rank)).mkdir()
    spawn_profiled_gloo(_gloo_main, lambda port: (port, str(path), WORLD, MICROBATCHES, runs, n_layers, hf_config),
                        nprocs=WORLD)
    return {rank: json.loads((path / f"peaks{rank}.json").read_text()) for rank in range(WORLD)}


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    return _measure(tmp_path_factory, FAST_RUNS)


@pytest.fixture(scope="module")
def measured_slow(tmp_path_factory) -> dict:
    return _measure(tmp_path_factory, tuple(run for run in RUNS if run not in FAST_RUNS))


@pytest.mark.parametrize("name, checkpointing", [
    pytest.param(*run, marks=() if run in FAST_RUNS else pytest.mark.slow) for run in RUNS])
def test_each_stage_peak_matches_a_real_gloo_pipeline(request, name, checkpointing):
    fixture = "measured" if (name, checkpointing) in FAST_RUNS else "measured_slow"
    measured = request.getfixturevalue(fixture)
    strategy = parse_strategy("pp2", WORLD, pp_schedule=name, microbatches=MICROBATCHES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        session = PipelineSession(tiny_workload(), StepOptions(checkpointing=checkpointing), get_device("h100-80gb"),
                                  strategy, cuda_semantics=False)
        session.trace(MICRO * MICROBATCHES)
    for stage in session.stage_points:
        real = measured[stage.rank]["peaks"][_key(name, checkpointing)]
        traced = stage.point.total_peak_bytes or stage.point.peak_bytes
        print(f"{_key(name, checkpointing)} stage {stage.rank}: traced {traced} B, gloo {real} B, "
              f"{(traced - real) / real:+.2%}")
        assert abs(traced - real) / real < 0.03, (name, stage.rank, traced, real)


def test_the_gloo_runtime_ran_our_order(measured):
    for rank in range(WORLD):
        for name, order in measured[rank]["orders"].items():
            assert [tuple(a) for a in order] == rank_actions(parse_schedule(name, MICROBATCHES), WORLD, rank), name


@pytest.mark.parametrize("name, pp, m", [
    ("interleaved-1f1b:2", 4, 8), ("interleaved-1f1b:3", 2, 6), ("interleaved-zb:2", 4, 8),
    ("interleaved-zb:2", 4, 3), ("interleaved-zb:3", 2, 6), ("zbv", 2, 4), ("zbv", 4, 5), ("zbv", 4, 8),
    ("dualpipev", 2, 4), ("dualpipev", 4, 10),
])
def test_orders_and_stages_are_what_torchs_runtime_runs(name, pp, m):
    """torch's schedule object, built over real PipelineStages on a fake process group as each rank:
    the compute list its runtime iterates (REDUCE_GRAD where its lowering put it, OVERLAP_F_B
    unfolded) and its stage-to-rank mapping equal ``rank_actions`` / ``rank_stages``."""
    from torch.distributed.pipelining import PipelineStage
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from batchfit.distributed.pp_schedules import rank_stages

    schedule = parse_schedule(name, m)
    n = pp * schedule.virtual
    for rank in range(pp):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=pp)
        try:
            stages = [PipelineStage(torch.nn.Linear(4, 4), s, n, torch.device("cpu"))
                      for s in rank_stages(schedule, pp, rank)]
            runtime = _real_schedule(name, stages, m, loss_fn=lambda out, y: out.sum())
            assert _compute_order(runtime, rank) == rank_actions(schedule, pp, rank)
            assert sorted(s for s, r in runtime.stage_index_to_group_rank.items() if r == rank) == \
                rank_stages(schedule, pp, rank)
        finally:
            dist.destroy_process_group()


def test_stage_placement_and_in_flight_micro_batches():
    from batchfit.distributed.pp_schedules import rank_stages

    one_f_one_b = parse_schedule("1f1b", 8)
    assert [in_flight(rank_actions(one_f_one_b, 4, r)) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight(rank_actions(parse_schedule("gpipe", 8), 4, r)) for r in range(4)] == [8] * 4
    # V shape: rank r holds stages r and 2p-1-r, so rank 0 holds the embeddings and the head
    zbv = parse_schedule("zbv", 16)
    assert [rank_stages(zbv, 4, r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert rank_stages(parse_schedule("interleaved-zb:2", 16), 4, 1) == [1, 5]
    # ZB-V keeps 2p half-depth stage-micro-batches on every rank (W frees them, not I): p micro-batches
    # of its layers, 1F1B's first rank (Qi et al. 2023, sec. 6), on every rank
    assert [in_flight(rank_actions(zbv, 4, r)) for r in range(4)] == [8] * 4


def test_bubble_by_hand():
    # (p-1)/(m+p-1): 1F1B and GPipe; ((p-1)/V) / (m + (p-1)/V): interleaved (Narayanan et al. 2021)
    assert bubble_fraction(parse_schedule("1f1b", 8), 4) == pytest.approx(3 / 11)
    assert bubble_fraction(parse_schedule("gpipe", 8), 4) == pytest.approx(3 / 11)
    assert bubble_fraction(parse_schedule("interleaved-1f1b:3", 8), 4) == pytest.approx(1 / 9)
    # zero bubble at T_F = T_I = T_W: only the ranks' staggered start, (p-1)/V of a rank's forward,
    # against 3m of work: ZB-H1's (p-1)(T_F + T_B - T_W) (Qi et al. 2023, sec. 2.1) over V stages
    for name, pp, m, v in (("interleaved-zb:2", 4, 8, 2), ("interleaved-zb:4", 8, 16, 4), ("zbv", 4, 8, 2),
                           ("zbv", 8, 16, 2), ("dualpipev", 4, 8, 2)):
        stagger = (pp - 1) / v
        assert bubble_fraction(parse_schedule(name, m), pp) == pytest.approx(stagger / (3 * m + stagger)), name
    # torch's ZBV with fewer than 3p/2 micro-batches leaves more than that: on pp8 with 8, 7/31
    assert bubble_fraction(parse_schedule("zbv", 8), 8) == pytest.approx(7 / 31)


@pytest.mark.parametrize("text, world, schedule, micro, says", [
    ("pp3", 4, "1f1b", 0, "must equal the GPU count"),
    ("pp2", 4, "1f1b", 0, r"pp2\+fsdp"),
    ("pp4", 4, "1f1b", 2, "at least 4 micro-batches"),
    ("pp2", 2, "zb", 0, "unknown pipeline schedule"),
    ("pp2", 2, "1f1b:2", 0, "only interleaved-1f1b and interleaved-zb take :V"),
    ("pp2", 2, "zbv:3", 0, "exactly 2 stages per rank"),
    ("pp2", 2, "interleaved-zb:1", 0, "2 or more stages per rank"),
    ("pp4", 4, "interleaved-zb", 9, "9 micro-batches must be a multiple of 2"),
    ("pp2", 2, "dualpipev", 2, "at least 4 micro-batches"),
    ("pp2+fsdp", 4, "zbv", 0, r"pp2\+fsdp-noreshard"),
    ("pp2+fsdp+tp2", 8, "InterleavedZeroBubble", 0, r"pp2\+fsdp-noreshard\+tp2"),
    ("pp2+ddp", 4, "dualpipev", 4, "does not reduce the gradients"),
])
def test_bad_pipeline_input_is_one_line(text, world, schedule, micro, says):
    with pytest.raises(OptionError, match=says) as error:
        parse_strategy(text, world, pp_schedule=schedule, microbatches=micro)
    assert "\n" not in str(error.value)


def test_layers_not_divisible_by_stages_is_one_line():
    strategy = parse_strategy("pp3", 3, pp_schedule="1f1b", microbatches=3)
    with pytest.raises(OptionError, match="4 layers do not split into 3") as error:
        PipelineSession(tiny_workload(), StepOptions(), get_device("h100-80gb"), strategy)
    assert "\n" not in str(error.value)


def test_plan_reports_every_stage_and_the_bubble():
    from batchfit.plan import plan
    from batchfit.plan.world import World

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = plan(tiny_workload(), device=get_device("h100-80gb"), worlds=[World(gpus=2, nodes=1)],
                      strategies="pp2", pp_schedule="1f1b", microbatches=2, max_batch=8, processes=1,
                      limit="allocated")
    row = result.plans[0]
    assert row.max_local_batch == 8 and row.max_local_batch % 2 == 0
    for point in row.points:
        assert len(point.stage_peak_bytes) == 2 and point.peak_bytes == max(point.stage_peak_bytes)
        assert point.to_json()["stage_peak_bytes"] == list(point.stage_peak_bytes)
    # 1F1B on 2 stages, 2 micro-batches: idle 1/3 of the step, so the bubble is half the compute
    assert row.time.pipeline_bubble_s == pytest.approx(row.time.compute_s / 2)
    assert any("pipeline rank" in a.what for a in result.approximations)


def test_auto_wraps_zero_bubble_pipelines_in_fsdp_kept_gathered():
    from batchfit.plan.candidates import ModelFacts, candidates
    from batchfit.plan.world import World

    facts = ModelFacts(name="m", n_layers=8, heads=4, kv_heads=2, tp_plan=True)
    names = {c.name: c for c in candidates(World(8), facts, pp_schedule="zbv")}
    assert {"pp2+fsdp-noreshard", "pp2+fsdp-noreshard+tp2", "pp4+fsdp-noreshard", "pp4+tp2"} <= set(names)
    assert "8 layers do not split into 16 equal stages (2 per rank)" in names["pp8"].skipped
    assert names["pp2+fsdp-noreshard"].skipped is None and names["pp2+fsdp-noreshard"].shard == "fsdp-noreshard"
    for name in names:  # each parses, so the zero-bubble check (no resharded FSDP2, no DDP) passes
        if name.startswith("pp"):
            parse_strategy(name, 8, pp_schedule="zbv")
    assert "pp2+fsdp" in {c.name for c in candidates(World(8), facts, pp_schedule="1f1b")}
