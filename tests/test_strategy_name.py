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

