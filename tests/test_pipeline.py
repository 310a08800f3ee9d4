"""Pipeline parallelism (pp<N>, --pp-schedule, --microbatches).

Truth without a GPU: two real processes on the CPU over gloo run torch's own pipelining
(``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B``) on the two stages of a 4-block
Llama, cut as ``batchfit.distributed.pipeline.split_stage`` cuts it; each rank's peak over a
steady step (the profiler's memory timeline) is compared with the trace of that pipeline rank
on the fake process group (CPU semantics). The schedule orders are checked against torch's
own IR where torch's IR is what runs (interleaved 1F1B), and the bubble by hand.
"""

from __future__ import annotations

import json
import os
import socket
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpu_truth import join_gloo, spawn_profiled_gloo, tiny_llama_workload
from batchfit.devices import get_device
from batchfit.distributed.pipeline import bubble_fraction, in_flight, parse_schedule, rank_actions, split_stage
from batchfit.errors import OptionError
from batchfit.plan.pipeline import PipelineSession
from batchfit.plan.pp_strategy import parse_pp_strategy
from batchfit.plan.sharded import parse_strategy
from batchfit.train.step import TrainingStep
from batchfit.workload import StepOptions, Workload
from batchfit.zoo.transformer import TransformerConfig

CFG = TransformerConfig(vocab_size=256, seq_len=32, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=128,
                        llama=True, tied_embeddings=False)
MICRO = 2
MICROBATCHES = 4
WORLD = 2
SCHEDULES = ("gpipe", "1f1b")


def tiny_workload() -> Workload:
    return tiny_llama_workload(CFG)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_main(rank: int, port: int, out_dir: str, world: int = WORLD, microbatches: int = MICROBATCHES) -> None:
    """Rank ``rank`` of a real ``world``-stage pipeline: its peak per schedule in peaks<rank>.json."""
    from cpu_truth import agreed_profiled_peak
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    join_gloo(rank, world, port, timeout_s=120)
    peaks = {}
    for name in SCHEDULES:
        workload = tiny_workload()
        torch.manual_seed(0)
        step = TrainingStep(workload, StepOptions(), torch.device("cpu"),
                            wrap=lambda m: split_stage(m, rank, world))
        stage = PipelineStage(step.model, rank, world, torch.device("cpu"))

        def loss_fn(logits, y):
            return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

        cls = ScheduleGPipe if name == "gpipe" else Schedule1F1B
        schedule = cls(stage, microbatches, loss_fn=loss_fn)
        x, y = workload.make_batch(MICRO * microbatches, torch.device("cpu"))
        x = x if rank == 0 else None
        y = y if rank == world - 1 else None

        def run(batch_size, hooks=None, _schedule=schedule, _step=step, _x=x, _y=y):
            if _x is not None:
                _schedule.step(_x, return_outputs=False)
            elif _y is not None:
                _schedule.step(target=_y, return_outputs=False)
            else:
                _schedule.step(return_outputs=False)
            _step.optimizer.step()
            _step.optimizer.zero_grad(set_to_none=True)

        step.run = run
        run(MICRO)  # builds the stage's buffers and the optimizer state
        peaks[name] = agreed_profiled_peak(step, MICRO, Path(out_dir) / str(rank), warmup=0)
        dist.barrier()
    with open(os.path.join(out_dir, f"peaks{rank}.json"), "w") as f:
        json.dump(peaks, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("pp-gloo")
    for rank in range(WORLD):
        (path / str(rank)).mkdir()
    spawn_profiled_gloo(_gloo_main, lambda port: (port, str(path)), nprocs=WORLD)
    return {rank: json.loads((path / f"peaks{rank}.json").read_text()) for rank in range(WORLD)}


@pytest.mark.parametrize("name", SCHEDULES)
def test_each_stage_peak_matches_a_real_gloo_pipeline(measured, name):
    strategy = parse_pp_strategy("pp2", WORLD, parse_strategy, pp_schedule=name, microbatches=MICROBATCHES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        session = PipelineSession(tiny_workload(), StepOptions(), get_device("h100-80gb"), strategy,
                                  cuda_semantics=False)
        session.trace(MICRO * MICROBATCHES)
    for stage in session.stage_points:
        real = measured[stage.rank][name]
        traced = stage.point.total_peak_bytes or stage.point.peak_bytes
        print(f"{name} stage {stage.rank}: traced {traced} B, gloo {real} B, {(traced - real) / real:+.2%}")
        assert abs(traced - real) / real < 0.03, (name, stage.rank, traced, real)


def test_schedule_orders_and_in_flight_micro_batches():
    one_f_one_b = parse_schedule("1f1b", 8)
    assert [in_flight(rank_actions(one_f_one_b, 4, r)) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight(rank_actions(parse_schedule("gpipe", 8), 4, r)) for r in range(4)] == [8] * 4
    # interleaved: torch's own action list (the runtime executes it as it is)
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules as S

    me = SimpleNamespace(n_local_stages=2, pp_group_size=4, _n_microbatches=8, number_of_rounds=2,
                         microbatches_per_round=4)
    torch_ops = [a for a in S.ScheduleInterleaved1F1B._calculate_single_rank_operations(me, 0) if a is not None]
    ours = rank_actions(parse_schedule("interleaved-1f1b:2", 8), 4, 0)
    assert [(k, s, m) for k, s, m in ours] == [(a.computation_type.value, a.stage_index, a.microbatch_index)
                                                for a in torch_ops if a.computation_type.value in "FB"]


def test_bubble_by_hand():
    assert bubble_fraction(parse_schedule("1f1b", 8), 4) == pytest.approx(3 / 11)
    assert bubble_fraction(parse_schedule("gpipe", 8), 4) == pytest.approx(3 / 11)
    assert bubble_fraction(parse_schedule("interleaved-1f1b:3", 8), 4) == pytest.approx(1 / 9)


@pytest.mark.parametrize("text, world, schedule, micro, says", [
    ("pp3", 4, "1f1b", 0, "must equal the GPU count"),
    ("pp2", 4, "1f1b", 0, r"pp2\+fsdp"),
    ("pp4", 4, "1f1b", 2, "at least 4 micro-batches"),
    ("pp2", 2, "zb", 0, "unknown pipeline schedule"),
    ("pp2", 2, "1f1b:2", 0, "only interleaved-1f1b"),
])
def test_bad_pipeline_input_is_one_line(text, world, schedule, micro, says):
    with pytest.raises(OptionError, match=says) as error:
        parse_pp_strategy(text, world, parse_strategy, pp_schedule=schedule, microbatches=micro)
    assert "\n" not in str(error.value)


def test_layers_not_divisible_by_stages_is_one_line():
    strategy = parse_pp_strategy("pp3", 3, parse_strategy, pp_schedule="1f1b", microbatches=3)
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
