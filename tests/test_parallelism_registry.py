"""Adding a parallelism takes one module (issue 31): tests/toy_parallelism.py registers ``xp<N>``,
and the strategy grammar, auto's candidates, the time model, the approximations and the torchtitan
and config.yaml emits read it from the registry (``distributed/parallelisms.py``), no other file edited."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from batchfit.devices import get_device
from batchfit.distributed import parallelisms
from batchfit.distributed.strategy_name import StrategyName, parse_name, parse_strategy
from batchfit.errors import OptionError
from batchfit.plan.candidates import ModelFacts, candidates
from batchfit.plan.world import World
from toy_parallelism import ELSEWHERE, SEEN, TOY

LLAMA = ModelFacts(name="llama", n_layers=32, heads=32, kv_heads=8, tp_plan=True)


@pytest.fixture
def toy():
    with parallelisms.added(TOY):
        yield TOY


def test_the_toy_is_parsed_and_laid_on_a_world(toy):
    parts = parse_name("xp2+fsdp+tp2")
    assert parts == StrategyName(shard="fsdp", tp=2, more=(("xp", 2),)) and parts.name == "fsdp+tp2+xp2"
    s = parse_strategy("fsdp+xp2", 8)  # xp takes its GPUs: dp = 8 / 2
    assert (s.name, s.dp, s.tp, s.shard, s.parts.degree("xp")) == ("fsdp+xp2", 4, 1, "fsdp", 2)
    assert parse_strategy("fsdp+xp2+tp2", 8).dp == 2
    with pytest.raises(OptionError, match="xp<N> needs 2 or more ranks"):
        parse_name("fsdp+xp1")
    with pytest.raises(OptionError, match="must equal the GPU count"):
        parse_strategy("fsdp+xp3", 8)


def test_auto_lists_the_toy_by_its_own_rule(toy):
    listed = {c.name: c for c in candidates(World(8), LLAMA)}
    assert (listed["fsdp+xp2"].dp, listed["fsdp+xp2"].degrees, listed["fsdp+xp2"].skipped) == (4, {"xp": 2}, None)
    assert listed["fsdp+xp2"].rule == TOY.auto_rule and "fsdp+tp2+xp2" not in listed  # its rule: no TP
    assert candidates(World(8), ModelFacts(name="m"))[-1].skipped == "m has no layers for the toy to split"


def test_the_toy_is_emitted_timed_and_approximated(toy):
    from batchfit.plan.emit_torchtitan import degrees
    from batchfit.plan.sharded import Collective
    from batchfit.plan.time_model import group_span

    s = parse_strategy("fsdp+xp2", 8)
    assert degrees(s) == {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": 4,
                          "tensor_parallel_degree": 1, "pipeline_parallel_degree": 1, "context_parallel_degree": 1,
                          "toy_parallel_degree": 2}
    assert "toy_parallel_degree" not in degrees(parse_strategy("fsdp", 8))  # torchtitan_at_1=False
    assert group_span(Collective("all_to_all", "xp", 2, 1, "forward"), s) == 4
    said = TOY.approximations([s, parse_strategy("fsdp", 8)], None, None)
    assert [a.what for a in said] == ["fsdp+xp2: the toy's ranks are not traced"]
    from batchfit.plan.emit import config_yaml
    from batchfit.workload import StepOptions

    row = SimpleNamespace(strategy=s.name, parts=s.parts, gpus=8, nodes=1, dp=4, tp=1, pp=1, cp=1, ep=1,
                          micro_batch=4, accumulation_steps=1, global_batch=16, peak_bytes_at_micro=2**30)
    result = SimpleNamespace(recommended=[row], device=get_device("h100-80gb"), target_util=0.9, workload="w",
                             options=StepOptions())
    assert "toy_parallel: 2" in config_yaml(result)
    from batchfit.plan.emit import accelerate_yaml

    with pytest.raises(OptionError, match="fsdp\\+xp2 is toy-parallel, which Accelerate's config cannot say"):
        accelerate_yaml(result)  # no `accelerate` hook: refused, not written without its degree


def test_a_parallelism_without_words_is_refused_by_its_key():
    """A new entry that leaves out ``words`` is named by its key in the emits' refusals ('xp-parallel'), not by
    nothing ('is , which ...')."""
    from dataclasses import replace

    from batchfit.plan.emit import accelerate_yaml

    plain = replace(TOY, words="")
    assert plain.words == "xp-parallel"
    with parallelisms.added(plain):
        s = parse_strategy("fsdp+xp2", 8)
        row = SimpleNamespace(strategy=s.name, parts=s.parts, gpus=8, nodes=1, dp=4, tp=1, pp=1, cp=1, ep=1)
        with pytest.raises(OptionError, match="^the recommended fsdp\\+xp2 is xp-parallel, which Accelerate"):
            accelerate_yaml(SimpleNamespace(recommended=[row]))


def test_the_toy_bounds_auto_and_shards_with_fsdp(toy):
    from batchfit.plan.candidates import bounds
    from batchfit.plan.shard_limit import shard_group

    assert bounds()[-1] == "xp only at degree 2"
    assert (shard_group(parse_strategy("fsdp+xp2", 8)), shard_group(parse_strategy("fsdp", 8))) == (8, 8)  # dp 4 x 2
    assert shard_group(parse_strategy("hsdp2+xp2", 8)) == 4  # (dp 4 x xp 2) / 2 replicas


def test_the_toys_code_runs_around_rank_0s_step_on_the_fake_mesh(toy):
    """plan/sharded.py runs the toy's FakeMesh as it runs cp's ring and ep's experts: its workload hook sees
    the workload rank 0 runs (as a CPU step here), its parameters elsewhere join the count (the tiny
    Llama's, counted by hand in tests/tiny.py, + ELSEWHERE), its label takes FSDP2's all-gathers (the rest
    keep the mesh's), and its check refuses ddp+xp2, whose step all-reduces and never all-gathers."""
    from batchfit.plan.sharded import trace_sharded
    from tiny import OPTIONS, TOTAL, tiny_workload

    SEEN.clear()
    device = get_device("h100-80gb")
    point = trace_sharded(tiny_workload(), OPTIONS, device, parse_strategy("fsdp+xp2", 4), 2, cuda_semantics=False)
    assert SEEN == [("fsdp+xp2", True)] and point.params == TOTAL + ELSEWHERE
    assert {(c.op, c.group, c.group_size) for c in point.collectives} == {("all_gather", "xp", 2),
                                                                          ("reduce_scatter", "dp", 4)}
    with pytest.raises(OptionError, match="ddp\\+xp2: the toy's ranks never all-gathered"):
        trace_sharded(tiny_workload(), OPTIONS, device, parse_strategy("ddp+xp2", 4), 1, cuda_semantics=False)


def test_the_toy_is_gone_after_its_block():
    with parallelisms.added(TOY), pytest.raises(ValueError, match="already registered"):
        with parallelisms.added(TOY):
            pass
    with pytest.raises(OptionError, match="unknown strategy"):
        parse_name("fsdp+xp2")
    assert "xp" not in {c for c in candidates(World(8), LLAMA) for c in c.degrees}


def test_a_built_models_facts_carry_its_sequence_so_auto_lists_cp_at_8192_tokens():
    """model_facts set the sequence only when the model could not be built, so auto never listed cp for a
    real model however long its sequence; a tiny Llama at 8,192 tokens on 8 GPUs lists fsdp+cp2 and
    fsdp+cp8 (the smallest and largest cp within the node dividing dp), with tp2 cp2 and cp4 (dp 4, room
    8 / 2), with tp4 cp2 (dp 2), and none at 4,096."""
    from batchfit.distributed.auto import model_facts
    from batchfit.zoo import language_model_workload
    from batchfit.zoo.transformer import Transformer, TransformerConfig

    def tiny(seq_len: int):
        cfg = TransformerConfig(vocab_size=64, seq_len=seq_len, d_model=32, n_layers=2, n_heads=4, d_ff=64, llama=True)
        return language_model_workload(name="tiny", build_model=lambda: Transformer(cfg), vocab_size=64,
                                       seq_len=seq_len, description="tiny")

    long, short = model_facts(tiny(8192)), model_facts(tiny(4096))
    assert long.seq_len == 8192
    listed = {c.name for c in candidates(World(8), long) if c.degrees.get("cp", 1) > 1 and not c.skipped}
    assert listed == {"fsdp+cp2", "fsdp+cp8", "fsdp+cp2+tp2", "fsdp+cp4+tp2", "fsdp+cp2+tp4"}
    assert not [c for c in candidates(World(8), short) if c.degrees.get("cp", 1) > 1]
