"""A stand-in for ``batchfit.plan.sharded`` whose numbers are known, so that the plan engine,
CLI and report are tested by hand (plan's ``trace=``, ``replay=`` and ``parse=``; the ``standin``
fixture of conftest.py gives them), in the real tracer's own types (Strategy, Collective, ShardedPoint);
tests/test_plan_standin.py checks it keeps to the real functions' signatures.

Rank 0 of the stand-in holds, for a model of ``PARAMS`` parameters:
    state (parameters, gradients, optimizer) = 16 GiB, sharded by dp under FSDP/HSDP and by tp
    activations = 1 GiB per sample, split by tp
so peak(b) = 16 GiB / (dp if sharded) / tp + b GiB / tp, exactly. FLOPs per rank =
6 x PARAMS x tokens x b / tp. Collectives: FSDP all-gathers PARAM_BYTES/tp in forward and in
backward and reduce-scatters GRAD_BYTES/tp in backward; DDP all-reduces GRAD_BYTES in two
buckets; TP all-reduces b x 1e8 bytes in forward and in backward.
zero1 / zero2 are DDP with the optimizer state (zero1: 8 GiB) or the optimizer state and the
gradients (zero2: 12 GiB) sharded by dp, and a PARAM_BYTES broadcast in the optimizer step.
pp<N>[+X] (N micro-batches, 1F1B) divides state, activations and FLOPs by N on top of X's.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from batchfit.devices import Device, GiB
from batchfit.distributed.strategy_name import Strategy
from batchfit.errors import OptionError
from batchfit.plan.sharded import Collective, ShardedPoint
from batchfit.workload import Workload

PARAMS = 10**9
STATE_BYTES = 16 * GiB
ACT_BYTES_PER_SAMPLE = 1 * GiB
PARAM_BYTES = 2 * 10**9
GRAD_BYTES = 4 * 10**9
TP_BYTES_PER_SAMPLE = 10**8


def parse_strategies(text: str, world_size: int) -> list[Strategy]:
    if text.strip() == "auto":
        names = ["ddp", "fsdp", "fsdp-noreshard"] + [f"{k}{n}" for k in ("hsdp", "tp", "fsdp+tp")
                                                     for n in (2, 4, 8) if n <= world_size and world_size % n == 0]
        return [s for s in (_one(n, world_size, quiet=True) for n in names) if s]
    return [_one(n.strip(), world_size) for n in text.split(",")]


def _one(name: str, world: int, quiet: bool = False) -> Strategy | None:
    pipeline = re.fullmatch(r"pp(\d+)(?:\+(.+))?", name)
    if pipeline:
        pp = int(pipeline.group(1))
        inner = _one(pipeline.group(2), world // pp) if pipeline.group(2) else Strategy("none", 1, 1, 1, "none")
        return dataclasses.replace(inner, name=name, world_size=world, pp=pp, pp_schedule="1f1b", microbatches=pp)
    found = re.fullmatch(r"(ddp|fsdp|fsdp-noreshard|zero1|zero2|hsdp|tp|fsdp\+tp)(\d*)", name)
    if not found:
        raise OptionError(f"unknown strategy '{name}': use ddp, fsdp, fsdp-noreshard, hsdp<R>, tp<N>, fsdp+tp<N>")
    kind, n = found.group(1), int(found.group(2) or 1)
    if world % n:
        if quiet:
            return None
        raise OptionError(f"{name}: {n} does not divide {world} GPUs")
    if kind in ("tp", "fsdp+tp"):
        if kind == "fsdp+tp" and n == world:
            return None if quiet else Strategy(name, world, 1, n, "fsdp")
        return Strategy(name, world, world // n, n, "none" if kind == "tp" else "fsdp")
    if kind == "hsdp":
        return Strategy(name, world, world, 1, "hsdp", n)
    return Strategy(name, world, world, 1, "none" if world == 1 else kind)


def trace_sharded(workload, options, device, strategy: Strategy, local_batch: int) -> ShardedPoint:
    s, b = strategy, local_batch
    sharded = s.shard in ("fsdp", "fsdp-noreshard", "hsdp")
    state = STATE_BYTES // (s.dp if sharded else 1) // s.tp // s.pp
    params, grads, optimizer = state // 4, state // 4, state // 2
    if s.shard in ("zero1", "zero2"):
        optimizer //= s.dp
        grads //= s.dp if s.shard == "zero2" else 1
        state = params + grads + optimizer
    activations = ACT_BYTES_PER_SAMPLE * b // s.tp // s.pp
    breakdown = {"parameters": params, "gradients": grads, "optimizer": optimizer,
                 "activations": activations, "collective": 0, "other": 0}
    collectives = []
    if sharded and s.dp > 1:
        group = s.dp // s.replicas if s.shard == "hsdp" else s.dp
        collectives += [Collective("all_gather", "dp", group, PARAM_BYTES // s.tp, "forward"),
                        Collective("all_gather", "dp", group, PARAM_BYTES // s.tp, "backward"),
                        Collective("reduce_scatter", "dp", group, GRAD_BYTES // s.tp, "backward")]
        if s.shard == "hsdp" and s.replicas > 1:
            collectives.append(Collective("all_reduce", "dp", s.replicas, GRAD_BYTES // s.dp, "backward"))
    if s.shard in ("ddp", "zero1", "zero2"):
        collectives += [Collective("all_reduce", "dp", s.dp, GRAD_BYTES // 2, "backward")] * 2
    if s.shard in ("zero1", "zero2"):
        collectives.append(Collective("broadcast", "dp", s.dp, PARAM_BYTES, "optimizer"))
    if s.tp > 1:
        collectives += [Collective("all_reduce", "tp", s.tp, TP_BYTES_PER_SAMPLE * b, "forward"),
                        Collective("all_reduce", "tp", s.tp, TP_BYTES_PER_SAMPLE * b, "backward")]
    tokens = workload.tokens_per_sample or 1
    return ShardedPoint(s, b, state + activations, breakdown, 6 * PARAMS * tokens * b // s.tp // s.pp,
                        tuple(collectives), PARAMS, PARAMS // (s.dp if sharded else 1) // s.tp // s.pp)


def fresh_stream(point: ShardedPoint) -> tuple[list[tuple[str, int, int]], tuple[int, int]]:
    """Rank 0's allocation stream of a fresh process, for ``plan --limit reserved``: the state
    in one allocation at the build, then in each of two steps the activations, one allocation
    per sample, freed at the step's end. Every request is a whole number of 2 MiB (the
    allocator's large segments): each gets a segment of exactly its size, and the second
    step reuses the first's, so reserved = allocated, by hand, and every answer is the same
    under either limit."""
    state = point.breakdown["parameters"] + point.breakdown["gradients"] + point.breakdown["optimizer"]
    per_sample = point.breakdown["activations"] // point.local_batch
    events = [("malloc", 0, state)]
    starts = []
    for step in (1, 2):
        starts.append(len(events))
        idents = [step * 10**6 + i for i in range(point.local_batch)]
        events += [("malloc", i, per_sample) for i in idents] + [("free", i, 0) for i in idents]
    return events, tuple(starts)


def replay_sharded(workload, options, device, strategy: Strategy, local_batch: int):
    """plan's ``replay=`` for the stand-in (``plan --limit reserved``): :func:`fresh_stream` through the
    allocator model, as the real tracer's session replays its own."""
    from batchfit.plan.reserved import replay_steps

    events, starts = fresh_stream(trace_sharded(workload, options, device, strategy, local_batch))
    return replay_steps(events, starts, device)


def workload(tokens: int | None = 1000) -> Workload:
    """A Workload the stand-in traces: only its name and tokens per sample are read."""
    return Workload(name="standin", build_model=lambda: torch.nn.Linear(1, 1),
                    make_batch=lambda b, d: torch.zeros(b, 1), loss_fn=lambda m, x: m(x).sum(),
                    tokens_per_sample=tokens, description="stand-in: peak = 16 GiB / shards + 1 GiB x b / tp")


def gpu(usable_gib: int = 100) -> Device:
    """A GPU with round numbers: ``usable_gib`` usable, no cuBLAS workspace, 1000 TFLOP/s
    bf16, 100 GB/s within a node and 10 GB/s between nodes."""
    return Device(name="test-gpu", display_name="Test GPU", total_bytes=usable_gib * GiB + 512 * 2**20,
                  workspace_bytes=0, bf16_tflops=1000.0, fp32_tflops=100.0, intra_node_gb_per_s=100.0,
                  intra_node_link="test link", inter_node_gb_per_s=10.0, inter_node_link="test network")
