"""Strategy names parsed once into typed degrees (distributed/strategy_name.py): the name written back
round-trips, the degrees are what the name says, and a Strategy keeps the parts it was read from."""

from __future__ import annotations

import pytest

from batchfit.distributed.strategy_name import StrategyName, parse_name, parse_strategy, stage_strategy
from batchfit.errors import OptionError

CANONICAL = ["ddp", "fsdp", "fsdp-noreshard", "zero1", "zero2", "hsdp2", "tp4", "fsdp+tp2", "fsdp-noreshard+tp2",
             "fsdp+cp2", "fsdp+cp4+tp2", "ddp+cp2", "pp2", "pp4+fsdp", "pp2+fsdp+tp2", "pp2+fsdp+cp2", "ep8+fsdp",
             "ep8+fsdp+tp2", "ep2+tp2", "pp2+ep4+fsdp+tp2"]


@pytest.mark.parametrize("name", CANONICAL)
def test_the_name_written_back_is_the_name_read(name):
    assert parse_name(name).name == name
    assert parse_name(parse_name(name).name) == parse_name(name)


def test_the_degrees_are_typed():
    assert parse_name("pp2+ep4+fsdp+tp2") == StrategyName(shard="fsdp", pp=2, ep=4, tp=2)
    assert parse_name("hsdp4") == StrategyName(shard="hsdp", replicas=4)
    assert not parse_name("fsdp-noreshard+tp2").reshard and parse_name("fsdp").reshard
    assert parse_name(" FSDP + TP2 ").name == "fsdp+tp2"  # case and spaces ignored
    assert (parse_name("cp2+fsdp").name, parse_name("fsdp+ep2").name) == ("fsdp+cp2", "ep2+fsdp")  # one order


def test_a_strategy_keeps_its_parts_and_its_stage():
    s = parse_strategy("pp2+fsdp+tp2", 8, pp_schedule="gpipe")
    assert (s.name, s.pp, s.dp, s.tp, s.shard, s.pp_schedule) == ("pp2+fsdp+tp2", 2, 2, 2, "fsdp", "gpipe")
    assert s.parts == StrategyName(shard="fsdp", tp=2, pp=2) and s.fsdp
    stage = stage_strategy(s)
    assert (stage.name, stage.world_size, stage.pp, stage.parts.pp) == ("fsdp+tp2", 4, 1, 1)


@pytest.mark.parametrize("text,says", [
    ("fsdp+pp2", "pp<N> comes once, first"), ("tp1", "unknown strategy"), ("ddp+fsdp", "unknown strategy"),
    ("ep1+fsdp", "ep<N> needs 2 or more ranks"), ("fsdp+tp2+tp2", "unknown strategy"), ("fsdp+x2", "unknown strategy"),
])
def test_what_is_not_a_name_is_one_line(text, says):
    with pytest.raises(OptionError, match=says.replace("+", r"\+")) as error:
        parse_name(text)
    assert "\n" not in str(error.value)


def test_every_degree_of_a_name_has_its_parallelism():
    """The registry (distributed/parallelisms.py) holds one entry per degree a name can carry, each a
    field of StrategyName and of Strategy: a new degree without its entry fails here."""
    import dataclasses

    from batchfit.distributed.parallelisms import degree_keys, registered
    from batchfit.distributed.strategy_name import FIELDS, Strategy

    named = {f.name for f in dataclasses.fields(StrategyName)} - {"shard", "replicas", "more"}
    assert set(degree_keys()) == named == set(FIELDS) and named <= {f.name for f in dataclasses.fields(Strategy)}
    assert len({p.key for p in registered()}) == len(registered())
    from batchfit.plan.emit_torchtitan import degrees

    assert degrees(parse_strategy("pp2+ep4+fsdp+tp2", 16)) == {
        "data_parallel_replicate_degree": 1, "data_parallel_shard_degree": 4, "tensor_parallel_degree": 2,
        "pipeline_parallel_degree": 2, "context_parallel_degree": 1, "expert_parallel_degree": 4,
        "fsdp_reshard_after_forward": "always"}


def test_the_time_model_and_config_yaml_read_each_parallelism_from_the_registry():
    """A collective's span (NVLink or the network) and whether it hides behind compute come from its
    parallelism's entry; a toy parallelism's collectives get its own rule from one entry."""
    from batchfit.distributed import parallelisms
    from batchfit.plan.sharded import Collective
    from batchfit.plan.time_model import group_span

    s = parse_strategy("fsdp+cp2+tp2", 8)
    assert group_span(Collective("all_gather", "cp", 2, 1, "forward"), s) == 4  # the ring: cp x tp ranks
    assert group_span(Collective("all_reduce", "tp", 2, 1, "forward"), s) == 2
    toy = parallelisms.Parallelism(key="xp", token="xp<N>", module="a toy", group="xp", span=lambda c, s: 64)
    with parallelisms.added(toy):
        assert group_span(Collective("all_to_all", "xp", 2, 1, "forward"), s) == 64
    from types import SimpleNamespace

    from batchfit.devices import get_device
    from batchfit.plan.emit import config_yaml
    from batchfit.workload import StepOptions

    row = SimpleNamespace(strategy="pp2+fsdp", gpus=8, nodes=1, dp=4, tp=1, pp=2, cp=1, ep=1, micro_batch=4,
                          accumulation_steps=1, global_batch=16, peak_bytes_at_micro=2**30)
    text = config_yaml(SimpleNamespace(recommended=[row], device=get_device("h100-80gb"), target_util=0.9,
                                       workload="w", options=StepOptions()))
    assert "pipeline_parallel: 2" in text and "tensor_parallel: 1" in text and "context_parallel" not in text
