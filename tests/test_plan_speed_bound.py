"""plan/speed_bound.py and plan/by_bound.py: auto bounds each candidate's tokens/s before tracing it,
traces the highest bounds first and sets aside what cannot be first; the floors the bounds rest on are
computed by hand and are never above what the tracer counts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from batchfit.plan import speed_bound
from batchfit.plan.bound import floor_bytes, model_bytes
from batchfit.plan.by_bound import rounds_run
from batchfit.plan.candidates import ModelFacts
from batchfit.plan.engine import plan
from batchfit.plan.sharded import parse_strategy
from batchfit.plan.speed_bound import Evidence, LinearFlops, linear_flops
from batchfit.plan.time_model import TimeModel
from batchfit.plan.world import World
from batchfit.workload import StepOptions
from standin import gpu, parse_strategies, trace_sharded, workload
from tiny import CFG, LOCAL_BATCH, OPTIONS, tiny_workload, traced_rank0

# the tiny Llama's nn.Linear weights (tests/tiny.py CFG, d 128, d_ff 256, head_dim 32): per block qkv 128 x 256,
# proj 128 x 128, gate+up 128 x 512, down 256 x 128; the untied head 128 x 512
BLOCK_LINEAR = 128 * 256 + 128 * 128 + 128 * 512 + 256 * 128
LINEAR = 2 * BLOCK_LINEAR + 128 * 512
assert (BLOCK_LINEAR, LINEAR) == (147_456, 360_448)


def test_the_floor_by_hand():
    floor = linear_flops(tiny_workload(), OPTIONS)
    assert floor == LinearFlops(linear_params=LINEAR, recomputed_params=0, tokens_per_sample=CFG.seq_len,
                                blocks=2, hidden=128)
    assert floor.flops_per_token == 6 * LINEAR == 2_162_688
    full = linear_flops(tiny_workload(), StepOptions(checkpointing="full"))
    assert full.recomputed_params == 2 * BLOCK_LINEAR and full.flops_per_token == 6 * LINEAR + 4 * BLOCK_LINEAR
    assert full.rank_flops(parse_strategy("fsdp+tp2", 4), 3) == full.flops_per_token * CFG.seq_len * 3 / 2
    # not certain: no floor
    assert linear_flops(tiny_workload(), StepOptions(frozen=("embed*",))) is None
    assert linear_flops(tiny_workload(), StepOptions(precision="fp8-rowwise")) is None
    assert linear_flops(tiny_workload(), OPTIONS, experts=8) is None


@pytest.mark.slow
def test_the_traced_step_holds_the_floors():
    """Rank 0's traced FLOPs are the linear floor and a little more (attention: 4 x 64 x 128 FLOPs a token and
    block forward, some 10% of the linears' here), under tp2's split and full checkpointing's recomputation;
    tp2's traced collectives send at least 2 blocks x 2 passes x 2 reductions x 128 x 2 bytes a token."""
    for name, options in (("fsdp+tp2", OPTIONS), ("fsdp", StepOptions(checkpointing="full"))):
        floor, strategy = linear_flops(tiny_workload(), options), parse_strategy(name, 2)
        traced = traced_rank0(name, 2, options, workload=tiny_workload())
        least = floor.rank_flops(strategy, LOCAL_BATCH)
        assert least <= traced.flops <= 1.2 * least
        if strategy.tp > 1:
            from batchfit.plan.time_model import wire_bytes

            sent = sum(wire_bytes(c) for c in traced.collectives if c.group == "tp")
            assert floor.tp_bytes_per_token(2) == 2 * 2 * 2 * 128 * 2
            assert floor.tp_bytes_per_token(2) * CFG.seq_len * LOCAL_BATCH <= sent


def _row(name: str, micro: int, flops: float, tp_bytes: float = 0.0):
    time = SimpleNamespace(flops=flops, bytes_sent={"tp": tp_bytes} if tp_bytes else {})
    return SimpleNamespace(strategy=name, micro_batch=micro, time=time)


def test_the_bound_by_hand():
    """4 GPUs of 1000 TFLOP/s at MFU 0.5, 1000 tokens a sample, 6e9 FLOPs a token: 333,333 tokens/s at most
    on 4 GPUs, whatever the split; a third less for pp2's 1F1B over 2 micro-batches, (p - 1) / (m + p - 1) idle."""
    floor = LinearFlops(linear_params=10**9, recomputed_params=0, tokens_per_sample=1000, blocks=10, hidden=1000)
    evidence = Evidence(floor, 1000.0, 0.5, 100.0)
    fsdp, tp2, pp2 = (parse_strategy(n, 4) for n in ("fsdp", "fsdp+tp2", "pp2+fsdp"))
    assert evidence.bound(fsdp, World(4)).tokens_per_s == pytest.approx(4 * 1000e12 * 0.5 / 6e9)
    assert evidence.bound(tp2, World(4)).tokens_per_s == pytest.approx(4 * 1000e12 * 0.5 / 6e9)
    assert evidence.bound(pp2, World(4)).tokens_per_s == pytest.approx(4 * 1000e12 * 0.5 * (2 / 3) / 6e9)
    assert evidence.bound(pp2, World(4)).formula == (
        "2 x 1,000 tokens a sample / (1,000 x 6.0 GFLOP per token / 2 ranks / (1,000 TFLOP/s x MFU 0.50) / "
        "(1 - bubble 0.333)); 6.0 GFLOP per token = 6 x 1.00B linear weights")
    # fsdp traced at 8 samples with 7e9 FLOPs a token (attention): the floor for what has no cp from then on;
    # cp2 keeps the linear floor (its ring counts other attention blocks) until a cp2 row is traced
    cp2, cp2_tp2 = parse_strategy("fsdp+cp2", 4), parse_strategy("fsdp+cp2+tp2", 4)
    assert evidence.learn(fsdp, _row("fsdp", 8, 7e9 * 8000))
    assert evidence.bound(tp2, World(4)).tokens_per_s == pytest.approx(4 * 1000e12 * 0.5 / 7e9)
    # the formula names where its FLOPs per token came from, after it; one rank a sample is 'rank'
    assert evidence.bound(fsdp, World(4)).formula == (
        "4 x 1,000 tokens a sample / (1,000 x 7.0 GFLOP per token / 1 rank / (1,000 TFLOP/s x MFU 0.50)); "
        "7.0 GFLOP per token from fsdp's trace")
    assert evidence.bound(pp2, World(4)).formula.endswith(
        "/ 2 ranks / (1,000 TFLOP/s x MFU 0.50) / (1 - bubble 0.333)); 7.0 GFLOP per token from fsdp's trace")
    assert evidence.bound(cp2_tp2, World(4)).tokens_per_s == pytest.approx(4 * 1000e12 * 0.5 / 6e9)
    assert evidence.learn(cp2, _row("fsdp+cp2", 2, 6.5e9 * 2000 / 2))  # 2 samples, half of each sequence
    assert evidence.bound(cp2_tp2, World(4)).tokens_per_s == pytest.approx(4 * 1000e12 * 0.5 / 6.5e9)
    # TP: 10 blocks x 2 passes x 2 reductions x 1000 x 2 bytes, 2 x 1/2 of each sent: 80 kB a token, once held
    assert floor.tp_bytes_per_token(2) == 80_000 and floor.tp_bytes_per_token(4) == 120_000
    assert evidence.learn(tp2, _row("fsdp+tp2", 4, 7e9 * 4000 / 2, tp_bytes=80_000 * 4000)) and evidence.tp_held
    compute_s = 1000 * 7e9 / 2 / (1000e12 * 0.5)  # a sample on one rank of the pair
    assert evidence.bound(tp2, World(4)).tokens_per_s == pytest.approx(2 * 1000 / (compute_s + 80_000 * 1000 / 100e9))
    # a row below a floor something was set aside by: the bounds are broken
    evidence.set_aside(parse_strategy("fsdp+tp4", 4))
    assert not evidence.learn(fsdp, _row("ddp", 2, 6.5e9 * 2000)) and evidence.broken


def test_hsdp_and_noreshard_memory_floors_by_hand():
    model = model_bytes(tiny_workload(), OPTIONS)  # fp32, AdamW: 16 bytes a parameter in all
    p = model.param_bytes // 4
    assert floor_bytes(parse_strategy("hsdp2", 8), model) == 16 * p // 4  # two copies, each over 4 ranks
    assert floor_bytes(parse_strategy("fsdp", 8), model) == 16 * p // 8
    # fsdp-noreshard at the end of the forward: 12 bytes a parameter sharded over 8, every one gathered (2 bytes
    # at least: half the fp32 weight), no gradient yet
    assert floor_bytes(parse_strategy("fsdp-noreshard", 8), model) == 12 * p // 8 + 2 * p
    assert floor_bytes(parse_strategy("fsdp-noreshard", 2), model) <= traced_rank0("fsdp-noreshard", 2).peak_bytes


def _rounds(bounds, speeds, holds=True, processes=2):
    jobs = [(World(4), name, []) for name in "abcdef"[:len(bounds)]]
    calls = []

    def run(some):
        calls.append([job[1] for job in some])
        return [[(job[0].gpus, speeds[job[1]], job[1])] for job in some]

    _, aside = rounds_run(run, jobs, lambda job: bounds["abcdef".index(job[1])], lambda job: job[0].gpus,
                          lambda result: result, lambda job, result: holds, processes=processes,
                          say=lambda message: None)
    return calls, {i: (best, name) for i, (best, name, _) in aside.items()}


def test_rounds_trace_the_highest_bounds_first_and_stop():
    speeds = {"a": 5.0, "b": 9.0, "c": 8.0, "d": 1.0, "e": 7.0}
    # e has no bound (first), then a (ties in their order); d is below e's 7, b and c (10, 8.5) are not
    calls, aside = _rounds([10.0, 10.0, 8.5, 3.0, None], speeds, processes=2)
    assert calls == [["e", "a"], ["b", "c"]] and aside == {3: (7.0, "e")}
    # one process: e alone (d is below its 7), a, b, then c is below b's 9
    calls, aside = _rounds([10.0, 10.0, 8.5, 3.0, None], speeds, processes=1)
    assert calls == [["e"], ["a"], ["b"]] and aside == {3: (7.0, "e"), 2: (9.0, "b")}
    # a traced row under a floor: nothing set aside from then on, the rest traced at once
    calls, aside = _rounds([10.0, 10.0, 8.5, 3.0, None], speeds, holds=False)
    assert calls == [["e", "a"], ["b", "c", "d"]] and aside == {}


def test_auto_sets_aside_the_pipelines_that_cannot_be_first(monkeypatch):
    """The stand-in's FLOPs are 6 x 1e9 a token (standin.py), so with that floor the bounds on 4 GPUs are
    4 x 1000e12 x 0.5 / 6e9 = 333,333 tokens/s (x 2/3 for pp2: 222,222). The first round (two processes, the
    candidates' order) traces ddp and fsdp: ddp reaches 64,000 / (0.192 + 0.030) = 288,288 (its last bucket's
    all-reduce exposed, tests/test_plan_rank.py), over the pipelines' bound, so neither is traced."""
    monkeypatch.setattr(speed_bound, "linear_flops", lambda w, o, e: LinearFlops(10**9, 0, 1000, 6, 10))
    result = plan(workload(), device=gpu(), worlds=[World(4)], options=StepOptions(precision="bf16"),
                  strategies="auto", time_model=TimeModel(mfu=0.5), limit="allocated", global_batch=64,
                  facts=ModelFacts(name="standin", n_layers=6, heads=8, tp_plan=True), trace=trace_sharded,
                  parse=parse_strategies)
    rows = {r.strategy: r for r in result.ranking}
    assert [r.strategy for r in result.ranking if r.rank] == ["hsdp2", "fsdp", "fsdp-noreshard", "ddp", "zero2",
                                                             "zero1", "fsdp+tp2", "tp4"]
    assert rows["hsdp2"].tokens_per_s == pytest.approx(64_000 / 0.202)
    for name in ("pp2+fsdp", "pp2+tp2"):
        assert rows[name].status == "not traced" and rows[name].bound_tokens_per_s == pytest.approx(4e15 * 0.5 / 9e9)
        assert rows[name].why.startswith("at most 222,222 tokens/s, below ddp's traced 288,288 (bound: ")
    data = result.to_json()
    assert {p["strategy"]: p["bound_tokens_per_s"] for p in data["strategies"] if p["bound_tokens_per_s"]} == \
        {"pp2+fsdp": pytest.approx(222_222.2, abs=0.1), "pp2+tp2": pytest.approx(222_222.2, abs=0.1)}


def test_only_the_traced_rows_are_said_to_be_approximated(monkeypatch, tmp_path):
    """The approximations are those of the rows traced: the pipelines set aside by their bound (above) have no
    figure of their own, so no output says how a pipeline rank is traced; zero1 and zero2's line stays."""
    from batchfit.report.plan_markdown import write_plan_report

    monkeypatch.setattr(speed_bound, "linear_flops", lambda w, o, e: LinearFlops(10**9, 0, 1000, 6, 10))
    asked = dict(device=gpu(), worlds=[World(4)], options=StepOptions(precision="bf16"), time_model=TimeModel(mfu=0.5),
                 limit="allocated", global_batch=64, trace=trace_sharded, parse=parse_strategies)
    facts = ModelFacts(name="standin", n_layers=6, heads=8, tp_plan=True)
    result = plan(workload(), strategies="auto", facts=facts, **asked)
    assert {r.strategy for r in result.ranking if r.status == "not traced"} == {"pp2+fsdp", "pp2+tp2"}
    lines = [a.line() for a in result.approximations]
    assert any(line.startswith("zero1 and zero2 traced as torch's ZeroRedundancyOptimizer") for line in lines)
    paths = write_plan_report(result, tmp_path)
    for text in (*lines, paths["md"].read_text(), paths["json"].read_text()):
        assert "pipeline rank" not in text
    # named, the pipelines are traced, and said to be approximated
    named = plan(workload(), strategies="fsdp,pp2+fsdp,pp2+tp2", **asked)
    assert [a.what for a in named.approximations if a.what.startswith("pp2+fsdp (1f1b), pp2+tp2 (1f1b): each "
                                                                      "pipeline rank's step traced")]


def test_a_row_below_a_floor_traces_what_was_set_aside():
    """One process: a (5) sets c (3) aside; b's row then breaks a floor, so c is traced after all."""
    jobs = [(World(4), name, []) for name in "abc"]
    calls = []

    def run(some):
        calls.append([job[1] for job in some])
        return [[(4, {"a": 5.0, "b": 4.0, "c": 2.0}[job[1]], job[1])] for job in some]

    said = []
    _, aside = rounds_run(run, jobs, lambda job: {"a": 10.0, "b": 9.0, "c": 3.0}[job[1]], lambda job: 4,
                          lambda result: result, lambda job, result: job[1] != "b", processes=1, say=said.append)
    assert calls == [["a"], ["b"], ["c"]] and aside == {}
    assert said == ["b: a traced row fell below the floor the bounds rest on; every candidate is traced, "
                    "1 set aside so far included"]


def test_a_new_fake_world_forgets_dtensors_decisions():
    """DTensor caches its sharding decisions by device mesh, and meshes of two worlds compare equal: a second
    world must start without the first one's (whose groups are gone), or its collectives name dead groups."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, _redistribute, distribute_tensor

    from batchfit.plan.fake_world import fake_world

    cached = _redistribute._gen_transform_infos.cache_info  # how to move a placement to another, by mesh
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]).redistribute(mesh, [Replicate()])
        assert cached().currsize > 0
    with fake_world(2):
        assert cached().currsize == 0
