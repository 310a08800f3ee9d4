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

Checked against torch's own PipelineStage and schedule classes running for real over gloo, on stages batchfit's own
split_stage cuts (the cut's counting is checked, its fidelity to torchtitan's cut is not).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from batchfit.devices import get_device
from batchfit.distributed.pp_schedules import bubble_fraction, in_flight, parse_schedule, rank_actions
from batchfit.errors import OptionError
from batchfit.plan.pipeline import PipelineSession
from batchfit.plan.sharded import parse_strategy
from batchfit.workload import StepOptions
from pipeline_truth import (
    MICRO,
    MICROBATCHES,
    WORLD,
    compute_order,
    measure_pipeline,
    pipeline_workload,
    real_schedule,
    run_key,
)

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


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    return measure_pipeline(tmp_path_factory, FAST_RUNS)


@pytest.fixture(scope="module")
def measured_slow(tmp_path_factory) -> dict:
    return measure_pipeline(tmp_path_factory, tuple(run for run in RUNS if run not in FAST_RUNS))


@pytest.mark.parametrize("name, checkpointing", [
    pytest.param(*run, marks=() if run in FAST_RUNS else pytest.mark.slow) for run in RUNS])
def test_each_stage_peak_matches_a_real_gloo_pipeline(request, name, checkpointing):
    fixture = "measured" if (name, checkpointing) in FAST_RUNS else "measured_slow"
    measured = request.getfixturevalue(fixture)
    strategy = parse_strategy("pp2", WORLD, pp_schedule=name, microbatches=MICROBATCHES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        session = PipelineSession(pipeline_workload(), StepOptions(checkpointing=checkpointing),
                                  get_device("h100-80gb"), strategy, cuda_semantics=False)
        session.trace(MICRO * MICROBATCHES)
    for stage in session.stage_points:
        real = measured[stage.rank]["peaks"][run_key(name, checkpointing)]
        traced = stage.point.total_peak_bytes or stage.point.peak_bytes
        print(f"{run_key(name, checkpointing)} stage {stage.rank}: traced {traced} B, gloo {real} B, "
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
            runtime = real_schedule(name, stages, m, loss_fn=lambda out, y: out.sum())
            assert compute_order(runtime, rank) == rank_actions(schedule, pp, rank)
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
        PipelineSession(pipeline_workload(), StepOptions(), get_device("h100-80gb"), strategy)
    assert "\n" not in str(error.value)


def test_plan_reports_every_stage_and_the_bubble():
    from batchfit.plan import plan
    from batchfit.plan.world import World

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = plan(pipeline_workload(), device=get_device("h100-80gb"), worlds=[World(gpus=2, nodes=1)],
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
