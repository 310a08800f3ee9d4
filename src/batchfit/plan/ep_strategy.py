"""The ep<N> component of ``batchfit plan``'s strategy names: ``ep8+fsdp``, ``ep8+fsdp+tp2``,
``ep2+tp2`` (``distributed/expert_parallel.py`` applies it). Pure parsing, no torch; ``plan/sharded.py``'s
parser hands any name with an ep<N> component here.

As in torchtitan (``distributed/parallel_dims.py: ParallelDims``, its default
``expert_tensor_parallel_degree = 1``), expert parallelism borrows its ranks: the GPU count is
unchanged (world = dp x tp), and the ep ranks come out of dp x tp (torchtitan's sparse mesh
``(efsdp, ep, etp=1)``: efsdp = dp x tp / ep). Without TP that is part of the data-parallel ranks;
with TP every tensor-parallel rank of a group is an ep rank too, each dispatching its 1/tp of the
tokens (torchtitan's ``ReordererSequenceParallel``). The experts are FSDP-sharded over the
dp x tp / ep ranks holding the same ones.

``ep<N>+tp<M>`` with tp<M> spanning every GPU (no data-parallel ranks) is traced with FSDP2 over a
one-rank mesh (batchfit's ``fsdp+tp<M>`` on M GPUs does the same): torchtitan's MoE parallelize
(``llama4/infra/parallelize.py``) applies FSDP whenever ep > 1, for the MoE layers' mixed precision.
"""

from __future__ import annotations

import dataclasses
import re

from batchfit.distributed.strategy import Strategy
from batchfit.errors import OptionError

_EP = re.compile(r"^ep(\d+)$")


def split_ep(name: str) -> tuple[int, str] | None:
    """('ep8+fsdp') -> (8, 'fsdp'); ('fsdp+ep2+tp2') -> (2, 'fsdp+tp2'); None when no component is ep<N>."""
    parts = name.strip().lower().replace(" ", "").split("+")
    found = [int(m.group(1)) for m in map(_EP.match, parts) if m]
    if not found:
        return None
    name = "+".join(parts)
    if len(found) > 1:
        raise OptionError(f"{name}: ep<N> comes once, e.g. ep8+fsdp")
    return found[0], "+".join(p for p in parts if not _EP.match(p))


def parse_ep_strategy(text: str, world_size: int, parse_rest) -> Strategy:
    """An ep<N>+X strategy on ``world_size`` GPUs; ``parse_rest(X, world_size)`` parses X, which must
    be FSDP (fsdp, fsdp-noreshard, fsdp+tp<M>) or tp<M> over every GPU, with N dividing the dp x tp
    ranks it borrows from."""
    ep, rest = split_ep(text)
    name = text.strip().lower().replace(" ", "")
    if ep < 2:
        raise OptionError(f"{name}: expert parallelism needs 2 or more ranks, e.g. ep8+fsdp (or drop ep{ep})")
    if not rest:
        raise OptionError(f"{name}: ep<N> shards the experts beside FSDP2, which shards the rest (torchtitan's "
                          f"layout): use ep{ep}+fsdp")
    inner = parse_rest(rest, world_size)
    if inner.shard == "none" and inner.tp > 1 and inner.pp == 1:
        inner = dataclasses.replace(inner, shard="fsdp")  # tp<M> over every GPU: FSDP2 over one rank (docstring)
    if inner.shard not in ("fsdp", "fsdp-noreshard") or inner.pp > 1:
        raise OptionError(f"{name}: ep<N> composes with fsdp, fsdp-noreshard, fsdp+tp<M> and tp<M> (torchtitan's "
                          f"layout), not {rest}: use ep{ep}+fsdp")
    room = inner.dp * inner.tp  # torchtitan's etp=1: ep borrows from dp_shard x tp
    if room % ep:
        good = [d for d in range(2, room + 1) if room % d == 0]
        source = (f"the {inner.dp} data-parallel x {inner.tp} tensor-parallel ranks (etp=1, torchtitan's default)"
                  if inner.tp > 1 else f"the {inner.dp} data-parallel ones")
        what = "is larger than" if ep > room else "must divide"
        raise OptionError(f"{name} on {world_size} GPUs: ep{ep} borrows its ranks from {source} and {what} their "
                          f"{room}: use ep<N> with N in {', '.join(map(str, good)) or '(none)'}")
    return dataclasses.replace(inner, name=name, ep=ep)
