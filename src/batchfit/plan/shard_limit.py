"""How many ranks a strategy's FSDP2 can shard over, checked before any trace.

FSDP2 splits each parameter's first dimension over its shard group (``fully_shard``'s default
``Shard(0)``), padding it to a multiple of the group's size. A group larger than the model's
largest first dimension gives every rank past it padding only: those GPUs add nothing to the
sharding. The trace would still run, but FSDP2 builds one chunk per rank of every parameter
when it wraps the model (torch's ``_chunk_with_empty``), so its cost grows with the group:
gpt-tinystories-22m's fsdp took 40 s on 100,000 fake ranks and ran past 5 minutes on
1,000,000 (issue 35). DDP, ZeRO, TP, cp, ep and pp do no per-rank work of that kind (ddp's
trace of a tiny Llama took 4 s on 1,000,000 ranks, as on 2), so only FSDP2's groups are
bounded here; the other degrees are checked against the model where they are parsed (heads,
layers, experts, the sequence).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from batchfit.distributed import parallelisms
from batchfit.distributed.strategy_name import FSDP_SHARDS

SMALL_GROUP = 256
"""A shard group of at most this many ranks is not checked (the model is not built for it): every
model batchfit plans has a parameter with more rows (a vocabulary, a hidden size)."""


def shard_group(strategy) -> int:
    """The ranks FSDP2 splits one parameter over under ``strategy``: dp x the degree of each parallelism it
    shards over too (cp: torchtitan's dp_shard_cp; ``Parallelism.fsdp_shards_over``), or an HSDP shard
    group; 1 without FSDP2."""
    if strategy.shard not in FSDP_SHARDS:
        return 1
    ranks = strategy.dp * math.prod(parallelisms.degree_of(strategy, p.key) for p in parallelisms.registered()
                                    if p.fsdp_shards_over)
    return ranks // strategy.replicas if strategy.shard == "hsdp" else ranks


def largest_rows(workload) -> int | None:
    """The largest first dimension of ``workload``'s parameters, from its model built on the meta
    device (no memory); None when it cannot be built there (then nothing is refused)."""
    import torch

    try:
        with torch.device("meta"):
            model = workload.build_model()
    except Exception:  # noqa: BLE001 - a model that needs real memory to build: the tracer decides
        return None
    return max((p.shape[0] if p.dim() else 1 for p in model.parameters()), default=None)


def too_wide(workload, strategies: list) -> Callable[[object], str | None]:
    """Why a strategy's FSDP2 shard group is wider than ``workload``'s largest parameter (or None);
    the model is built only when some group of ``strategies`` is past :data:`SMALL_GROUP`."""
    rows = largest_rows(workload) if any(shard_group(s) > SMALL_GROUP for s in strategies) else None

    def why(strategy) -> str | None:
        group = shard_group(strategy)
        if rows is None or group <= rows:
            return None
        fit = -(-strategy.world_size // rows)  # HSDP replicas that bring each shard group to `rows` or fewer
        return (f"{strategy.name} on {strategy.world_size:,} GPUs shards each parameter's first dimension over "
                f"{group:,} ranks, and {workload.name}'s largest has {rows:,} rows: FSDP2 can use at most {rows:,} "
                f"ranks per shard group (the others would hold padding only); use ddp, or hsdp<R> with R of "
                f"{fit:,} or more dividing the GPUs")
    return why
