"""The pp<N>[+X] strategy names of ``batchfit plan``: a pipeline of N stages, each running X on
world_size / N GPUs (``plan/pipeline.py`` traces it). Pure parsing, no torch; ``plan/sharded.py``'s
parser hands pp names here, and the pipeline session asks what each stage runs."""

from __future__ import annotations

import dataclasses
import re

from batchfit.distributed.pp_schedules import check_inner, check_pipeline, parse_schedule
from batchfit.distributed.strategy import Strategy
from batchfit.errors import OptionError
from batchfit.plan.world import check_degree

_PP = re.compile(r"^pp(\d+)(?:\+(.+))?$")


def split_pp(name: str) -> tuple[int, str] | None:
    """('pp4+fsdp') -> (4, 'fsdp'); ('pp2') -> (2, ''); None when the name has no pp."""
    match = _PP.match(name.strip().lower().replace(" ", ""))
    if match is None:
        return None
    return int(match.group(1)), match.group(2) or ""


def parse_pp_strategy(text: str, world_size: int, parse_rest, *, pp_schedule: str = "1f1b",
                      microbatches: int = 0) -> Strategy:
    """A pp<N>[+X] strategy on ``world_size`` GPUs; ``parse_rest(X, world_size // N)`` parses X."""
    pp, rest = split_pp(text)
    name = text.strip().lower().replace(" ", "")
    check_degree(name, "pp", pp, world_size, product=f"pp{pp} x the other degrees", example="pp2+fsdp")
    schedule = parse_schedule(pp_schedule, microbatches)
    check_pipeline(schedule, pp, None)
    inner_world = world_size // pp
    if rest:
        if split_pp(rest) is not None:
            raise OptionError(f"{name}: pp<N> comes once, first: e.g. pp2+fsdp+tp2")
        inner = parse_rest(rest, inner_world)
    elif inner_world == 1:
        inner = Strategy("none", 1, 1, 1, "none")
    else:
        raise OptionError(f"{name} on {world_size} GPUs: pp{pp} x the other degrees must equal the GPU count; "
                          f"use pp{world_size}, or pp{pp}+fsdp (data parallel over the other {inner_world})")
    check_inner(schedule, name, inner.shard)
    return dataclasses.replace(inner, name=name, world_size=world_size, pp=pp, pp_schedule=schedule.name,
                               microbatches=schedule.microbatches or pp)


def inner_strategy(strategy: Strategy) -> Strategy:
    """What each pipeline rank runs on its world_size / pp GPUs."""
    return dataclasses.replace(strategy, name=split_pp(strategy.name)[1] or "none",
                               world_size=strategy.world_size // strategy.pp, pp=1, pp_schedule="", microbatches=0)
