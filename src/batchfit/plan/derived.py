"""Rows a plan derives from another row's trace instead of tracing them again: DDP on several GPU counts.

Under plain DDP (no TP, cp, ep, pp) rank 0's memory is the same on every world size above 1:
each rank keeps the whole model, its gradients and optimizer state; the reducer's gradient
buckets are cut by byte caps (``distributed/strategy.py``: ``_ddp_bucket_caps_mb``, 1 MiB then
25 MiB), not by rank count; its all-reduce hook divides and reduces each bucket in place
(``_fake_allreduce_hook``; NCCL's own buffers are not the caching allocator's). What changes
with the world size is only the all-reduce's group (its ring time), which the time model reads
from each collective's ``group_size``. So a plan for ``--gpus 1,2,3,4 --strategies ddp`` traces
DDP once, at its smallest world above 1, and writes the 3- and 4-GPU rows from those points in
the same session (a size the larger world asks for and the first did not is traced there,
once); each derived row says so (``StrategyPlan.derived_from_gpus``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from batchfit.distributed import parallelisms


def world_independent(strategy) -> bool:
    """Whether rank 0's traced bytes of ``strategy`` are the same on any world size above 1: plain DDP, no
    parallelism with a degree (each registered one, ``distributed/parallelisms.py``) above 1."""
    return strategy.shard == "ddp" and not any(p.used_by(strategy) for p in parallelisms.registered() if p.degree)


def jobs(by_world: list) -> list[tuple]:
    """``[(world, strategy, [(world, strategy) derived from its trace]), ...]`` for ``by_world``
    (``[(world, [strategy, ...])]``): each world-independent strategy traced once, at its smallest world."""
    out, first = [], {}
    for world, chosen in sorted(by_world, key=lambda pair: pair[0].gpus):
        for strategy in chosen:
            key = strategy.name if world_independent(strategy) else None
            if key is not None and key in first:
                first[key][2].append((world, strategy))
                continue
            job = (world, strategy, [])
            out.append(job)
            if key is not None:
                first[key] = job
    return out


def at_world(point, strategy):
    """A traced point of a world-independent strategy as ``strategy`` (another world size) has it:
    the same bytes and FLOPs, its data-parallel collectives over ``strategy.dp`` ranks."""
    collectives = tuple(dataclasses.replace(c, group_size=strategy.dp) if c.group == "dp" else c
                        for c in point.collectives)
    return dataclasses.replace(point, strategy=strategy, collectives=collectives)


class SharedTraces:
    """One session's traces and replays by local batch, each size once, for every row it feeds."""

    def __init__(self, session, source) -> None:
        self._session, self._source = session, source
        self.points: dict[int, object] = {}
        self._replays: dict[int, object] = {}
        self.can_replay = getattr(session, "reserved", None) is not None

    def trace_for(self, strategy) -> Callable[[int], object]:
        def trace(local_batch: int):
            if local_batch not in self.points:
                self.points[local_batch] = self._session.trace(local_batch)
            point = self.points[local_batch]
            return point if strategy == self._source else at_world(point, strategy)
        return trace

    def has(self, local_batch: int, reserved: bool = False) -> bool:
        """Whether the size is traced (or replayed) already: a row reading it does no new work."""
        return local_batch in (self._replays if reserved else self.points)

    def reserved(self, local_batch: int):
        if local_batch not in self._replays:
            self._replays[local_batch] = self._session.reserved(local_batch)
        return self._replays[local_batch]
