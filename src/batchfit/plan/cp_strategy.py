"""The cp<N> component of ``batchfit plan``'s strategy names: context parallelism, each rank holding
sequence/N of every sample, attention by torch's ring (``distributed/context_parallel.py``).

``fsdp+cp2``, ``fsdp+cp4+tp2``, ``ddp+cp2``, ``pp2+fsdp+cp2``: on W GPUs, cp<N> takes N of them
for each data-parallel rank (world_size = pp x dp x cp x tp), and FSDP2 / DDP run over dp x cp (as
torchtitan's dp_shard_cp mesh does). Pure parsing, no torch; ``plan/sharded.py``'s parser hands
names with a cp component here."""

from __future__ import annotations

import dataclasses
import re

from batchfit.distributed.strategy import Strategy
from batchfit.errors import OptionError
from batchfit.plan.world import check_degree

_CP = re.compile(r"(?:^|\+)cp(\d+)(?=\+|$)")
_WRAPS = ("fsdp-noreshard", "fsdp", "ddp")
"""What cp<N> composes with: the data-parallel wrap that runs over dp x cp."""


def split_cp(name: str) -> tuple[int, str] | None:
    """('fsdp+cp4+tp2') -> (4, 'fsdp+tp2'); ('fsdp') -> None."""
    name = name.strip().lower().replace(" ", "")
    found = _CP.findall(name)
    if not found:
        return None
    if len(found) > 1:
        raise OptionError(f"{name}: cp<N> comes once, e.g. fsdp+cp2+tp2")
    rest = _CP.sub("", name, count=1).strip("+")
    return int(found[0]), rest


def parse_cp_strategy(text: str, world_size: int, parse_rest) -> Strategy:
    """A strategy with a cp<N> component on ``world_size`` GPUs; ``parse_rest(X, world_size // N)``
    parses the rest (fsdp, fsdp+tp<T>, ddp, ...)."""
    name = text.strip().lower().replace(" ", "")
    cp, rest = split_cp(name)
    check_degree(name, "cp", cp, world_size, product=f"dp x cp{cp} x tp", example="fsdp+cp2")
    first = rest.split("+")[0]
    if first not in _WRAPS:
        raise OptionError(f"{name}: cp<N> runs under a data-parallel wrap over dp x cp (torchtitan's): "
                          f"use fsdp+cp{cp}, fsdp+cp{cp}+tp<T> or ddp+cp{cp}")
    if first == "ddp" and "+" in rest:
        raise OptionError(f"{name}: ddp composes with cp<N> alone: use ddp+cp{cp}, or fsdp+cp{cp}+tp<T>")
    inner = parse_rest(rest, world_size // cp)
    # On world_size // cp == 1 (or == tp) GPUs the rest parses as one GPU's step; the wrap still
    # runs over the cp ranks.
    return dataclasses.replace(inner, name=name, world_size=world_size, shard=first, cp=cp)
