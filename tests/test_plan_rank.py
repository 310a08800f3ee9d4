"""``plan --strategies auto``: the combinations of ``plan/candidates.py`` (each rule, the skipped ones
with their reason, the count bounded, a new component added) and the ranking of
``plan/ranking.py`` (order and figures by hand on the stand-in tracer of ``standin.py``).

By hand, on 4 GPUs of the stand-in's test GPU (100 GiB usable, 1000 TFLOP/s bf16, 100 GB/s in a
node), MFU 0.5, 1000 tokens per sample, global batch 64: every strategy's micro-batch is the
whole global batch split over its dp ranks (16 per rank at dp 4), one step, so compute =
6e9 x 1000 x 64 / 4 / (1000e12 x 0.5) = 0.192 s per rank for all of them, and only the exposed
communication and the bubble tell them apart:
    hsdp2     first all-gather over a shard group of 2: 2e9 x 1/2 / 100e9 = 0.010 s
    fsdp      first all-gather over 4: 2e9 x 3/4 / 100e9 = 0.015 s (fsdp-noreshard the same)
    ddp       the last bucket's all-reduce: 2e9 x 2 x 3/4 / 100e9 = 0.030 s
    zero1/2   ddp's 0.030 + the optimizer's broadcast 2e9 / 100e9 = 0.050 s (zero2 holds less: first)
    fsdp+tp2  0.015 x 2/3 (group 2, half the bytes) ... + TP all-reduces 2 x 32e8 x 1/100e9 = 0.069 s
    pp2+fsdp  0.010 exposed + bubble 0.192 x (1/3) / (2/3) = 0.096 s (1F1B, 2 micro-batches)
    tp4       TP all-reduces 2 x 64e8 x 3/2 / 100e9 = 0.192 s
    pp2+tp2   0.128 + 0.096
pp4 is skipped: 6 layers do not split into 4 stages.
"""

from __future__ import annotations

import json

import pytest

from batchfit.devices import GiB
from batchfit.plan.candidates import Candidate, Component, ModelFacts, bounds, candidates
from batchfit.plan.engine import plan
from batchfit.plan.time_model import TimeModel
from batchfit.plan.world import World
from batchfit.workload import StepOptions
from standin import gpu, parse_strategies, trace_sharded, workload
from tiny import TINY_LLAMA_FILE

LLAMA = ModelFacts(name="llama", n_layers=32, heads=32, kv_heads=8, tp_plan=True)
ORDER = ["hsdp2", "fsdp", "fsdp-noreshard", "ddp", "zero2", "zero1", "fsdp+tp2", "pp2+fsdp", "tp4", "pp2+tp2"]


def names(world: World, facts: ModelFacts = LLAMA, **kw) -> list[str]:
    return [c.name for c in candidates(world, facts, **kw) if c.skipped is None]


def skipped(world: World, facts: ModelFacts, **kw) -> dict[str, str]:
    return {c.name: c.skipped for c in candidates(world, facts, **kw) if c.skipped}


# --- the candidates ------------------------------------------------------------------------------------
def test_every_rule_on_one_node_of_eight():
    assert names(World(8)) == ["ddp", "fsdp", "fsdp-noreshard", "zero1", "zero2", "hsdp2", "hsdp4", "fsdp+tp2",
                               "fsdp+tp4", "tp8", "pp2+fsdp", "pp2+tp4", "pp4+fsdp", "pp4+tp2", "pp8"]
    by_name = {c.name: c for c in candidates(World(8), LLAMA)}
    assert (by_name["pp2+tp4"].pp, by_name["pp2+tp4"].dp, by_name["pp2+tp4"].tp) == (2, 1, 4)
    assert (by_name["hsdp4"].shard, by_name["hsdp4"].replicas, by_name["fsdp+tp2"].dp) == ("hsdp", 4, 4)


def test_several_nodes_keep_tp_in_a_node_and_hsdp_replicas_across_nodes():
    listed = names(World(64, 8))
    assert [n for n in listed if n.startswith("hsdp")] == ["hsdp2", "hsdp4", "hsdp8"]
    assert "fsdp+tp8" in listed and not any("tp16" in n for n in listed)
    assert "pp8+tp8" in listed and not any(n.startswith("pp16") for n in listed)


@pytest.mark.parametrize("world", [World(1), World(2), World(4), World(8), World(16, 2), World(64, 8),
                                   World(1024, 128)])
def test_the_count_stays_bounded(world):
    count = len(candidates(world, LLAMA))
    assert count <= 17 and (count == 1) == (world.gpus == 1)


def test_what_cannot_apply_is_listed_with_its_reason():
    enoki = ModelFacts(name="enoki-28h", n_layers=21, heads=28, tp_plan=True)  # seed 004's smallest
    assert skipped(World(4), enoki) == {
        "pp2+fsdp": "pp2 with 1f1b: 21 layers do not split into 2 equal stages: use pp3, pp7 or pp21",
        "pp4": "pp4 with 1f1b: 21 layers do not split into 4 equal stages: use pp3, pp7 or pp21"}
    mlp = ModelFacts(name="mlp")  # no TP plan, no pipeline split
    reasons = skipped(World(4), mlp)
    assert set(reasons) == {"fsdp+tp2", "tp4", "pp2+fsdp", "pp4"}
    assert "mlp has no tensor-parallel plan" in reasons["tp4"] and "no embed / blocks" in reasons["pp4"]
    six_heads = ModelFacts(name="m", n_layers=4, heads=6, kv_heads=2, tp_plan=True)
    assert skipped(World(4), six_heads)["tp4"] == "6 query / 2 key-value heads do not divide by 4"
    assert "pp2+fsdp+tp2" in names(World(8), six_heads) and "pp2+tp4" not in names(World(8), six_heads)
    assert "micro-batches" in skipped(World(4), LLAMA, microbatches=2)["pp4"]  # 1F1B needs one per stage
    assert "--loss chunked" in skipped(World(2), ModelFacts(name="m", n_layers=4, loss="chunked"))["pp2"]
    assert "could not be built on the meta device" in skipped(World(2), ModelFacts(name="m", unread="x"))["pp2"]
    assert all("\n" not in reason for reason in reasons.values()) and len(bounds()) == 6


def test_a_new_component_is_added():
    """How the cp and ep branches add theirs: a Component with its degrees rule (StrategyName writes the name)."""
    def cp_degrees(world, facts, base: Candidate):
        return [(2, None)] if base.shard == "fsdp" else []

    def ep_degrees(world, facts, base: Candidate):
        return [(2, None if facts.experts else f"{facts.name} is dense: no experts to shard")] \
            if base.shard == "fsdp" and base.pp == 1 else []

    cp = Component(key="cp", takes_gpus=True, rule="cp<N>: ring attention", degrees=cp_degrees)
    ep = Component(key="ep", takes_gpus=False, rule="ep<N>: experts sharded", degrees=ep_degrees)
    listed = {c.name: c for c in candidates(World(8), LLAMA, components=(cp, ep))}
    assert (listed["fsdp+cp2"].dp, listed["fsdp+cp2"].degrees) == (4, {"cp": 2})
    assert (listed["fsdp+cp2+tp2"].dp, listed["pp2+fsdp+cp2"].dp) == (2, 2)
    assert listed["ep2+fsdp"].dp == 8 and listed["ep2+fsdp"].skipped == "llama is dense: no experts to shard"
    assert "ep2+fsdp+cp2" not in listed  # a component composes with the base combinations, one at a time


def test_cp_and_ep_join_auto_where_they_apply():
    """cp from MIN_AUTO_CP_SEQ tokens on FSDP2 bases (smallest and largest degree within a node); ep on a
    mixture of experts only, at the largest degree within a node dividing the experts; neither on a short
    dense model (none of their rows, not even skipped ones)."""
    from batchfit.distributed.auto import MIN_AUTO_CP_SEQ

    short = {c.name for c in candidates(World(8), LLAMA)}
    assert not any("cp" in n or "ep" in n for n in short)
    long = {c.name: c for c in candidates(World(8), ModelFacts(**{**LLAMA.__dict__, "seq_len": MIN_AUTO_CP_SEQ}))}
    assert {"fsdp+cp2", "fsdp+cp8", "fsdp+cp2+tp2", "fsdp+cp2+tp4"} <= set(long)
    assert (long["fsdp+cp8"].dp, long["fsdp+cp2+tp2"].dp) == (1, 2) and "fsdp+cp4" not in long
    moe = {c.name: c for c in candidates(World(64, nodes=8), ModelFacts(name="qwen3-moe", n_layers=48, heads=32,
                                                                      kv_heads=4, experts=128))}
    assert moe["ep8+fsdp"].dp == 64 and not any(n.startswith("ep") and n != "ep8+fsdp" for n in moe)


# --- the ranking ---------------------------------------------------------------------------------------
def ranked(usable_gib: int = 100, **kw):
    facts = ModelFacts(name="standin", n_layers=6, heads=8, tp_plan=True)
    return plan(workload(), device=gpu(usable_gib), worlds=[World(4)], options=StepOptions(precision="bf16"),
                strategies="auto", time_model=TimeModel(mfu=0.5), limit="allocated", facts=facts, trace=trace_sharded,
                parse=parse_strategies, **kw)


def test_the_ranking_is_by_tokens_per_s_with_figures_by_hand():
    result = ranked(global_batch=64)
    rows = result.ranking
    assert [r.strategy for r in rows] == ORDER + ["pp4"]
    assert [r.rank for r in rows] == list(range(1, 11)) + [None]
    by = {r.strategy: r for r in rows}
    assert by["fsdp"].compute_s == pytest.approx(0.192) and by["fsdp"].exposed_comm_s == pytest.approx(0.015)
    assert by["fsdp"].tokens_per_s == pytest.approx(64_000 / 0.207)
    assert by["pp2+fsdp"].bubble_s == pytest.approx(0.096) and by["pp2+fsdp"].exposed_comm_s == pytest.approx(0.010)
    assert (by["pp2+fsdp"].micro_batch, by["pp2+fsdp"].accumulation_steps, by["pp2+fsdp"].dp) == (32, 1, 2)
    assert by["tp4"].exposed_comm_s == pytest.approx(0.192) and by["zero1"].exposed_comm_s == pytest.approx(0.050)
    # memory at the micro-batch, by hand: fsdp 16/4 + 16 GiB; ddp 16 + 16; zero1 4 + 4 + 8/4 + 16
    assert (by["fsdp"].allocated_bytes, by["ddp"].allocated_bytes, by["zero1"].allocated_bytes) == \
        (20 * GiB, 32 * GiB, 26 * GiB)
    assert by["hsdp2"].vs_best == 1 and by["tp4"].vs_best == pytest.approx((64_000 / 0.384) / (64_000 / 0.202))
    assert by["pp4"].status == "skipped" and "6 layers do not split into 4" in by["pp4"].why
    data = json.loads(json.dumps(result.to_json()))
    assert [r["strategy"] for r in data["ranking"]] == ORDER + ["pp4"] and data["ranking"][0]["mfu"] == 0.5
    assert data["auto_left_out"] == list(bounds()) and data["recommended"][0]["strategy"] == "hsdp2"


def test_auto_lists_what_the_global_batch_rules_out():
    rows = ranked(global_batch=6).ranking  # 6 samples: not over 4 dp ranks, not over pp2's 2 x 2 micro-batches
    why = {r.strategy: r.why for r in rows if r.status == "skipped"}
    assert why["fsdp"] == "--global-batch 6 is not a multiple of its 4 data-parallel ranks x 1 samples"
    assert why["pp2+fsdp"] == "--global-batch 6 is not a multiple of its 2 data-parallel ranks x 2 samples"
    assert {r.strategy for r in rows if r.rank} == {"fsdp+tp2", "tp4", "pp2+tp2"}  # dp 2 x 3; dp 1 x 6; 1 x 2 x 3


def test_what_does_not_fit_comes_last_with_why():
    rows = ranked(usable_gib=16, global_batch=64).ranking  # 16 GiB of state unsharded: ddp cannot fit
    statuses = [(r.strategy, r.status) for r in rows if r.rank is None]
    assert statuses == [("ddp", "does not fit"), ("pp4", "skipped")]
    assert "needs 17.00 GiB per GPU" in rows[-2].why
    assert all(r.rank is not None for r in rows[:-2])


def test_the_report_shows_the_ranking(tmp_path):
    from batchfit.report.plan_markdown import plan_markdown, write_plan_report

    result = ranked(global_batch=64)
    text = plan_markdown(result)
    section = text[text.index("## Ranking"):text.index("## Configuration")]
    lines = [line for line in section.splitlines() if line.startswith("| 1 ") or line.startswith("| 10 ")]
    assert lines[0].startswith("| 1 | 4 | hsdp2 | 1 | 4 | 1 |") and "| 1.00x |" in lines[0]
    assert "| 4 | pp4 | 4 | 1 | 1 | skipped | pp4 with 1f1b: 6 layers" in section and bounds()[0] in section
    paths = write_plan_report(result, tmp_path)
    assert paths["ranking_png"].read_bytes()[:4] == b"\x89PNG"


def test_the_report_has_a_column_for_each_degree_a_row_has():
    """report.md's tables: dp and tp always, pp, cp and ep where a row has them (fsdp+cp8 on 64 GPUs read
    '| 1 | 8 | 1 |' under pp, dp and tp: its cp nowhere)."""
    import dataclasses

    from batchfit.report.plan_markdown import plan_markdown

    result = plan(workload(), device=gpu(), worlds=[World(4)], options=StepOptions(precision="bf16"),
                  strategies="fsdp,fsdp+tp2", time_model=TimeModel(mfu=0.5), limit="allocated", global_batch=64,
                  trace=trace_sharded, parse=parse_strategies)
    text = plan_markdown(result)
    assert "| rank | GPUs | strategy | dp | tp | max local |" in text  # no pp, cp or ep: no column
    assert "| GPUs | strategy | dp | tp | max local |" in text and "| 4 | fsdp | 4 | 1 | 96 |" in text
    # the fsdp row as fsdp+cp2 would be (2 data-parallel ranks, each sample's sequence over 2): a cp column
    result.plans[0] = dataclasses.replace(result.plans[0], strategy="fsdp+cp2", dp=2, cp=2)
    text = plan_markdown(result)
    assert "| rank | GPUs | strategy | dp | cp | tp | max local |" in text and "cp = context-parallel ranks" in text
    assert "| 1 | 4 | fsdp+cp2 | 2 | 2 | 1 | 96 |" in text and "\n| 4 | fsdp+cp2 | 2 | 2 | 1 | 96 |" in text
    assert "| 2 | 4 | fsdp+tp2 | 2 | 1 | 2 | 192 |" in text and "| GPUs | strategy | dp | cp | tp | max local |" in text


def test_auto_end_to_end_on_the_real_tracer(tmp_path):
    """The real tracer, a 1-layer Llama (d 64) on 2 GPUs: its facts read from the model (4 query / 2 kv
    heads: tp2 applies; 1 layer: pp2 cannot), every other combination traced and ranked."""
    from typer.testing import CliRunner

    from batchfit.cli.app import app

    (tmp_path / "tiny.py").write_text(TINY_LLAMA_FILE)
    out = tmp_path / "report"
    result = CliRunner().invoke(app, ["plan", f"{tmp_path / 'tiny.py'}:workload", "--gpu", "h100-80gb", "--gpus", "2",
                                      "--strategies", "auto", "--precision", "bf16-mixed", "--global-batch", "4",
                                      "--batch-sizes", "1,2", "--max-batch", "2", "--limit", "allocated",
                                      "--processes", "1", "--out", str(out), "--json", str(tmp_path / "plan.json")])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "plan.json").read_text())
    ranking = data["ranking"]
    assert [r["rank"] for r in ranking] == [1, 2, 3, 4, 5, 6, None]
    assert {r["strategy"] for r in ranking} == {"ddp", "fsdp", "fsdp-noreshard", "zero1", "zero2", "tp2", "pp2"}
    assert ranking[-1]["strategy"] == "pp2"
    assert "1 layer does not split into 2 equal stages: one layer cannot be split into stages: drop pp" in \
        ranking[-1]["why"]
    assert ranking[0]["strategy"] == data["recommended"][0]["strategy"]
    speeds = [r["tokens_per_s"] for r in ranking[:-1]]
    assert speeds == sorted(speeds, reverse=True) and all(r["allocated_bytes"] for r in ranking[:-1])
    names = [r["strategy"] for r in ranking]  # the terminal's rows in rank order, the strategy first
    rows = [line.split()[0] for line in result.output.splitlines() if line.split() and line.split()[0] in names]
    assert rows[:len(names)] == names
    assert "pp2: skipped: pp2 with 1f1b: 1 layer does not split" in result.output
    assert {p.name for p in out.iterdir()} == {"report.md", "plan.png", "plan-ranking.png", "plan.json"}
