"""The plan engine on the stand-in tracer (``standin.py``), numbers by hand.

On the test GPU (100 GiB usable, no workspace, 1000 TFLOP/s bf16, 100 GB/s NVLink, 10 GB/s
between nodes) with MFU 0.5 (5e14 FLOP/s) and 1000 tokens per sample, 4 GPUs, global batch 512:

    ddp       peak = 16 + b GiB       max local 84; target 90 GiB: b <= 74; micro | 128 -> 64, x2
    fsdp      peak = 4 + b GiB        max local 96; micro 64 (128 > 96), x2
    fsdp+tp2  peak = 4 + b/2 GiB      max local 192 (dp 2: max global 384); micro | 256 -> 128, x2

Compute per micro-batch: 6 x 1e9 x 1000 x 64 = 3.84e14 FLOP -> 0.768 s (fsdp+tp2: 128 / 2, the same).
"""

from __future__ import annotations

import math

import pytest

from batchfit.errors import OptionError
from batchfit.plan.engine import plan
from batchfit.plan.time_model import TimeModel, bus_factor
from batchfit.plan.world import World, parse_tokens, parse_worlds
from batchfit.workload import StepOptions
from standin import GiB, gpu, trace_sharded, workload

BF16 = StepOptions(precision="bf16-mixed")
HALF = TimeModel(mfu=0.5, mfu_source="test")


@pytest.fixture
def four(standin):
    return plan(workload(), device=gpu(), worlds=[World(4)], options=BF16, strategies="ddp,fsdp,fsdp+tp2",
                global_batch=512, tokens="chinchilla", time_model=HALF, **standin.tracer)


def by_name(result, name, gpus=None):
    return next(p for p in result.plans if p.strategy == name and (gpus is None or p.gpus == gpus))


def test_max_local_and_global_batch_by_hand(four):
    rows = {p.strategy: (p.max_local_batch, p.max_global_batch, p.micro_batch, p.accumulation_steps)
            for p in four.plans}
    assert rows == {"ddp": (84, 336, 64, 2), "fsdp": (96, 384, 64, 2), "fsdp+tp2": (192, 384, 128, 2)}
    assert by_name(four, "ddp").peak_bytes_at_micro == 80 * GiB
    assert by_name(four, "fsdp+tp2").peak_bytes_at_micro == 68 * GiB


def test_every_answer_was_traced_and_the_next_size_failed(four):
    ddp = by_name(four, "ddp")
    assert [p.local_batch for p in ddp.points] == [1, 2, 64, 84, 85]  # fit points, the answer, +1, the micro
    assert ddp.point(85).peak_bytes > four.capacity_bytes >= ddp.point(84).peak_bytes
    assert ddp.curve.lines[0].bytes_per_sample == GiB and ddp.curve.lines[0].fixed_bytes == 16 * GiB


def test_step_time_is_compute_plus_what_cannot_overlap(four):
    ddp, fsdp, tp = (by_name(four, n).time for n in ("ddp", "fsdp", "fsdp+tp2"))
    assert ddp.compute_s == pytest.approx(0.768)
    # DDP: two 2e9-byte buckets, all-reduce over 4 ranks sends 1.5 x 2e9 each = 0.03 s; the last is exposed
    assert (ddp.overlapped_s, ddp.exposed_s) == (pytest.approx(0.03), pytest.approx(0.03))
    assert ddp.step_time_s == pytest.approx(2 * 0.798)
    # FSDP: the forward's all-gather (0.75 x 2e9 bytes = 0.015 s) is exposed, the backward's hide
    assert fsdp.step_time_s == pytest.approx(2 * (0.768 + 0.015))
    # FSDP+TP2: dp group of 2 (0.005 s exposed) and two TP all-reduces of 128 x 1e8 bytes (0.128 s each)
    assert tp.communication_s["tp"] == pytest.approx(0.256)
    assert tp.step_time_s == pytest.approx(2 * (0.768 + 0.005 + 0.256))


def test_tokens_days_and_the_recommendation(four):
    fsdp = by_name(four, "fsdp")
    assert fsdp.tokens_per_s == pytest.approx(512 * 1000 / 1.566)
    assert four.tokens == 20 * 10**9  # chinchilla: 20 x parameters
    assert fsdp.days == pytest.approx(2e10 / (512 * 1000 / 1.566) / 86400)
    assert [p.strategy for p in four.recommended] == ["fsdp"]


def test_across_nodes_the_data_parallel_group_takes_the_network(standin):
    result = plan(workload(), device=gpu(), worlds=parse_worlds(None, 2, 4), options=BF16,
                  strategies="fsdp,hsdp2", global_batch=512, time_model=HALF, **standin.tracer)
    fsdp, hsdp = by_name(result, "fsdp").time, by_name(result, "hsdp2").time
    # fsdp over 8 ranks on 2 nodes of 4: 7/8 x 2e9 bytes at 10 GB/s = 0.175 s exposed
    assert fsdp.links["dp"] == "inter-node" and fsdp.exposed_s == pytest.approx(0.175)
    assert fsdp.step_time_s == pytest.approx(0.768 + 0.175)
    # hsdp2: the shard group (4 ranks) stays in a node, the replicas' all-reduce crosses
    assert hsdp.links["dp"] == "intra- and inter-node" and hsdp.exposed_s == pytest.approx(0.015)
    assert hsdp.overlapped_s == pytest.approx(0.015 + 0.03 + 5e8 / 1e10)


def test_a_strategy_that_does_not_fit_says_what_would(standin):
    result = plan(workload(), device=gpu(10), worlds=[World(2)], options=BF16, strategies="ddp,fsdp",
                  time_model=HALF, **standin.tracer)
    ddp, fsdp = by_name(result, "ddp"), by_name(result, "fsdp")
    assert ddp.max_local_batch == 0 and ddp.micro_batch == 0 and ddp.time is None
    assert "fsdp shards parameters, gradients and optimizer state (16.00 GiB here)" in ddp.fix[1]
    assert "8.00 GiB less" in ddp.fix[1]
    assert fsdp.max_local_batch == 2  # 8 + b <= 10
    assert [p.strategy for p in result.recommended] == ["fsdp"]


def test_without_a_global_batch_the_micro_batch_is_the_largest_under_the_target(standin):
    result = plan(workload(), device=gpu(), worlds=[World(1), World(3)], options=BF16, strategies="ddp",
                  target_util=0.8, time_model=HALF, **standin.tracer)
    one, three = by_name(result, "ddp", 1), by_name(result, "ddp", 3)
    assert (one.shard, one.micro_batch, one.accumulation_steps, one.global_batch) == ("none", 64, 1, 64)  # 16+b <= 80
    assert (three.micro_batch, three.global_batch) == (64, 192)  # seed 001's 3 x H100 row


def test_the_cublas_workspace_is_added_when_the_tracer_leaves_it_out(standin):
    device = gpu()
    device = type(device)(**{**device.__dict__, "workspace_bytes": 64 * 2**20})
    result = plan(workload(), device=device, worlds=[World(4)], options=BF16, strategies="fsdp", time_model=HALF,
                  **standin.tracer)
    point = by_name(result, "fsdp").points[0]
    assert point.peak_bytes == 4 * GiB + 1 * GiB + 64 * 2**20 and point.breakdown["workspace"] == 64 * 2**20


def test_auto_skips_tensor_parallel_on_a_model_without_a_plan(standin):
    def no_tp(workload, options, device, strategy, local_batch):
        if strategy.tp > 1:
            raise OptionError("standin has no tensor-parallel plan: give the Workload a parallelize()")
        return trace_sharded(workload, options, device, strategy, local_batch)

    result = plan(workload(), device=gpu(), worlds=[World(2)], options=BF16, strategies="auto", trace=no_tp,
                  parse=standin.parse_strategies, time_model=HALF, limit="allocated")  # a tracer of points only
    assert {p.strategy: bool(p.skipped) for p in result.plans} == {  # tp2, pp2: listed, never traced
        "ddp": False, "fsdp": False, "fsdp-noreshard": False, "zero1": False, "zero2": False, "tp2": True, "pp2": True}
    from batchfit.plan.candidates import ModelFacts

    result = plan(workload(), device=gpu(), worlds=[World(2)], options=BF16, strategies="auto", trace=no_tp,
                  parse=standin.parse_strategies, time_model=HALF, limit="allocated",
                  facts=ModelFacts(name="standin", tp_plan=True))  # a plan the tracer refuses: skipped at the trace
    assert "give the Workload a parallelize()" in next(p.skipped for p in result.plans if p.strategy == "tp2")
    with pytest.raises(OptionError, match="no tensor-parallel plan"):
        plan(workload(), device=gpu(), worlds=[World(2)], strategies="tp2", trace=no_tp,
             parse=standin.parse_strategies)


@pytest.mark.parametrize("kwargs,message", [
    (dict(worlds=[World(8)], strategies="ddp", global_batch=100), "use a multiple of 8, e.g. `global_batch` 96"),
    (dict(worlds=[World(4)], strategies="ddp,fsdp+tp4", global_batch=6), "ddp's 4 data-parallel ranks"),
    (dict(worlds=[World(4)], strategies="ddp", tokens="lots"), "chinchilla"),
    (dict(worlds=[World(4)], strategies="ddp", target_util=90), "0.9"),
    # the step refuses it once the TP plan built the model: named first, it lost the rows traced before it
    (dict(worlds=[World(4)], strategies="fsdp,fsdp+tp2", options=StepOptions(loss="chunked:4")),
     "fsdp+tp2: `loss` chunked:4 does not run under tensor parallelism"),
])
def test_bad_plans_are_refused_before_any_trace(standin, kwargs, message):
    traced = []

    def counting(*args):
        traced.append(args)
        return trace_sharded(*args)

    with pytest.raises(OptionError, match=message.replace("+", r"\+")):
        plan(workload(), device=gpu(), trace=counting, parse=standin.parse_strategies, **kwargs)
    assert traced == []


def test_auto_sets_aside_tensor_parallel_candidates_under_a_loss_they_refuse(standin):
    from batchfit.plan.candidates import ModelFacts

    traced = set()

    def counting(workload, options, device, strategy, local_batch):
        traced.add(strategy.name)
        return trace_sharded(workload, options, device, strategy, local_batch)

    result = plan(workload(), device=gpu(), worlds=[World(2)], options=StepOptions(loss="chunked:4"),
                  strategies="auto", trace=counting, parse=standin.parse_strategies, time_model=HALF,
                  limit="allocated", facts=ModelFacts(name="standin", tp_plan=True))
    reason = next(p.skipped for p in result.plans if p.strategy == "tp2")  # the row names its strategy
    assert reason.startswith("`loss` chunked:4 does not run under tensor parallelism")
    assert "tp2" not in traced and "ddp" in traced


def test_worlds_tokens_and_ring_bytes():
    assert parse_worlds("1,2,3,4") == [World(1), World(2), World(3), World(4)]
    assert parse_worlds("16") == [World(16, 2)]
    assert parse_worlds(None, 2, 8) == [World(16, 2)]
    for bad, message in (("0", "1 or more"), ("4,x", "cannot read `gpus`"), ("12", "`nodes` 2 `gpus_per_node` 6")):
        with pytest.raises(OptionError, match=message):
            parse_worlds(bad)
    with pytest.raises(OptionError, match="needs `gpus_per_node`"):
        parse_worlds(None, 2)
    assert parse_tokens("2e11") == 2e11 and parse_tokens("chinchilla") == "chinchilla"
    assert bus_factor("all_reduce", 4) == 1.5 and bus_factor("all_gather", 8) == 7 / 8
    assert bus_factor("reduce_scatter", 1) == 0 and math.isclose(bus_factor("broadcast", 2), 1)
