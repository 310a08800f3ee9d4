"""The ep<N> component of ``batchfit plan``'s strategy names: ``ep8+fsdp``, ``ep2+fsdp+tp2``
(``distributed/expert_parallel.py`` applies it). Pure parsing, no torch; ``plan/sharded.py``'s
parser hands any name with an ep<N> component here.

As in torchtitan, expert parallelism borrows its ranks from the data-parallel ones: the GPU count
is unchanged (world = dp x tp, ep divides dp), each group of ep data-parallel ranks splits every
MoE layer's experts, and the experts are FSDP-sharded over the dp / ep ranks holding the same ones.
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
    be FSDP (fsdp, fsdp-noreshard, fsdp+tp<M>) over a data-parallel degree that ep<N> divides."""
    ep, rest = split_ep(text)
    name = text.strip().lower().replace(" ", "")
    if ep < 2:
        raise OptionError(f"{name}: expert parallelism needs 2 or more ranks, e.g. ep8+fsdp (or drop ep{ep})")
    if not rest:
        raise OptionError(f"{name}: ep<N> shards the experts beside FSDP2, which shards the rest (torchtitan's "
                          f"layout): use ep{ep}+fsdp")
    inner = parse_rest(rest, world_size)
    if inner.dp % ep:
        good = [d for d in range(2, inner.dp + 1) if inner.dp % d == 0]
        raise OptionError(f"{name} on {world_size} GPUs: ep{ep} borrows its ranks from the {inner.dp} data-parallel "
                          f"ones and must divide them: use ep<N> with N in {', '.join(map(str, good)) or '(none)'}")
    if inner.shard not in ("fsdp", "fsdp-noreshard") or inner.pp > 1:
        raise OptionError(f"{name}: ep<N> composes with fsdp, fsdp-noreshard and fsdp+tp<M> (torchtitan's "
                          f"layout), not {rest}: use ep{ep}+fsdp")
    return dataclasses.replace(inner, name=name, ep=ep)
