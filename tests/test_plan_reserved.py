"""``plan --limit reserved``: rank 0's fresh process replayed through the caching allocator model.

By hand on the stand-in (``standin.py``, 100 GiB usable, no workspace): a stream whose
first step holds an 8 GiB buffer once (freed before the second) reserves 8 GiB more than the
steady step allocates, and the peak is named as the first step's. On the real tracer: the
reserved peak plan replays on one GPU is estimate's, byte for byte, and DDP's bucket rebuild
is in the stream: one bucket of every gradient from the build, freed at the start of the
second step before the new buckets are allocated (``Reducer::initialize_buckets``).

Checked against the stand-in by hand, and batchfit's own estimate of the same step (checks plan's replay, not the
fidelity to a GPU).
"""

from __future__ import annotations

import dataclasses

import pytest

from batchfit.devices import GiB, get_device
from batchfit.plan.engine import plan
from batchfit.plan.reserved import replay_steps
from batchfit.plan.world import World
from batchfit.workload import StepOptions
from standin import gpu, trace_sharded, workload
from tiny import deep_workload, tiny_workload

ONCE_BYTES = 8 * GiB


def once_replay(workload, options, device, strategy, local_batch):
    """The stand-in's fresh stream with an 8 GiB buffer in the first step only."""
    point = trace_sharded(workload, options, device, strategy, local_batch)
    state = point.breakdown["parameters"] + point.breakdown["gradients"] + point.breakdown["optimizer"]
    per_sample = point.breakdown["activations"] // local_batch
    events, starts = [("malloc", 0, state)], []
    for step in (1, 2):
        starts.append(len(events))
        idents = [step * 10**6 + i for i in range(local_batch)]
        once = [("malloc", -step, ONCE_BYTES)] if step == 1 else []
        events += once + [("malloc", i, per_sample) for i in idents] + [("free", i, 0) for i in idents]
        events += [("free", -step, 0)] if step == 1 else []
    return replay_steps(events, tuple(starts), device)


def test_a_one_time_buffer_of_the_first_step_is_reserved_and_named(standin):
    # ddp on 4 GPUs: allocated 16 + b GiB in the steady step; reserved 16 + 8 + b GiB (the first
    # step's segments stay cached): max local 76 (not 84), micro under 90 GiB: 66 (not 74)
    result = plan(workload(), device=gpu(), worlds=[World(4)], strategies="ddp", trace=trace_sharded,
                  replay=once_replay, parse=standin.parse_strategies)
    ddp = result.plans[0]
    assert (ddp.max_local_batch, ddp.micro_batch, ddp.limit, result.limit) == (76, 66, "reserved", "reserved")
    assert ddp.peak_reserved_bytes_at_micro == (16 + 8 + 66) * GiB and ddp.peak_bytes_at_micro == (16 + 66) * GiB
    assert ddp.peak_step == "first step"
    assert result.to_json()["recommended"][0]["peak_step"] == "first step"
    allocated = plan(workload(), device=gpu(), worlds=[World(4)], strategies="ddp", trace=trace_sharded,
                     replay=once_replay, parse=standin.parse_strategies, limit="allocated").plans[0]
    assert (allocated.max_local_batch, allocated.micro_batch, allocated.peak_step) == (84, 74, None)
    assert all(p.reserved is None for p in allocated.points)  # nothing replayed under --limit allocated


def test_plan_replays_what_estimate_replays_on_one_gpu():
    from batchfit.plan.deep import DeepSession
    from batchfit.plan.sharded import parse_strategy
    from batchfit.trace.point import TracedCurve

    h100 = get_device("h100-80gb")
    device = dataclasses.replace(h100, total_bytes=h100.context_bytes + h100.workspace_bytes + 160 * 2**20)
    with TracedCurve(tiny_workload(), StepOptions(), device, keep_streams=True) as traced:
        estimated = traced.reserved(40)
    with DeepSession(tiny_workload(), StepOptions(), device, parse_strategy("ddp", 1)) as deep:
        planned = deep.reserved(40)
    assert estimated.peak_reserved_bytes is not None
    assert planned.peak_reserved_bytes == estimated.peak_reserved_bytes
    assert planned.steps == ("model build", "first step", "steady step")


def test_ddp_rebuilds_its_buckets_once_at_the_second_step():
    from batchfit.plan.sharded import ShardedSession, parse_strategy

    with ShardedSession(tiny_workload(), StepOptions(), get_device("h100-80gb"), parse_strategy("ddp", 2),
                        cuda_semantics=False) as session:
        session.trace(2)
        events, (first, second, rebuilt) = session.fresh_stream, session.fresh_steps
        params = sum(p.numel() for p in session.session.step.model.parameters())
    sizes = {ident: n for kind, ident, n in events if kind == "malloc"}
    # the build holds one bucket of every fp32 gradient (DDP's first-step bucketing)
    bucket = next(ident for kind, ident, n in events[:first] if kind == "malloc" and n == 4 * params)
    rebuild = events[second:rebuilt]  # the second step's inputs, then the rebuild in its forward
    freed = rebuild.index(("free", bucket, 0))  # the old bucket goes first, then the new ones
    new = [n for kind, _, n in rebuild[freed + 1:] if kind == "malloc"]
    assert sum(new) == 4 * params and len(new) == len(rebuild) - freed - 1 >= 2
    assert ("free", bucket, 0) not in events[first:second] and sizes[bucket] == 4 * params
    replayed = replay_steps(events, (first, second, rebuilt), get_device("h100-80gb"))
    assert replayed.steps[2] == "second step: DDP bucket rebuild"


def _stream_bytes(events, streams, start: int) -> dict[int, int]:
    """Bytes each side stream allocates from ``events[start]`` on."""
    made: dict[int, int] = {}
    for kind, ident, nbytes in events[start:]:
        if kind == "malloc" and ident in streams:
            made[streams[ident]] = made.get(streams[ident], 0) + nbytes
    return made


def test_fsdp2_gradients_stay_reserved_on_the_reduce_scatter_stream():
    """FSDP2 reduce-scatters each block's gradients into a buffer it allocates on its reduce-scatter
    stream (torch's ``_fsdp_collectives.foreach_reduce``; the sharded gradients are views of it) and
    gathers parameters into buffers of its all-gather copy-in stream. The caching allocator hands a
    cached block only to requests of the stream it was reserved on, so what zero_grad frees stays
    reserved, out of the next forward's reach (torchtitan's Llama 3 8B on 8 GPUs: 4.0 GB, its fp32
    gradient shard; docs/tracing/plan-memory.md). The trace names each malloc's stream: in the steady step the
    reduce-scatter stream allocates exactly the fp32 gradient shard, 4 B x the parameters of rank 0,
    and rank 0's reserved peak is what the three pools reserve each on its own, summed (a pool's
    reserved bytes never shrink unless the allocator runs out)."""
    from batchfit.plan.sharded import ShardedSession, parse_strategy
    from batchfit.trace.point import new_allocator

    h100 = get_device("h100-80gb")
    with ShardedSession(tiny_workload(), StepOptions(precision="bf16-mixed"), h100, parse_strategy("fsdp", 2)) as s:
        s.trace(2)
        events, steps, streams, per_rank = s.fresh_stream, s.fresh_steps, s.fresh_streams, s.params_per_rank
    made = _stream_bytes(events, streams, steps[1])
    assert sorted(made) == [1, 2] and made[2] == 4 * per_rank  # 1: all-gather copy-in, 2: reduce-scatter
    pools = []
    for stream in (0, 1, 2):
        mine = {ident for kind, ident, _ in events if kind == "malloc" and streams.get(ident, 0) == stream}
        allocator = new_allocator(h100) if stream == 0 else new_allocator(dataclasses.replace(h100, workspace_bytes=0))
        allocator.apply([e for e in events if e[1] in mine])
        pools.append(allocator.stats.reserved_bytes)
    assert pools[2] >= 4 * per_rank
    apart = replay_steps(events, steps, h100, streams).peak_reserved_bytes
    assert apart == sum(pools)
    assert apart > replay_steps(events, steps, h100).peak_reserved_bytes  # one pool: the forward took them


@pytest.mark.slow
def test_the_side_streams_survive_depth_extension():
    """The reserved stream written from depths 2, 3, 4 carries each side-stream malloc's stream
    (``trace.stream.tag_streams``): its replay is the whole model's, byte for byte."""
    from batchfit.plan.deep import DeepSession
    from batchfit.plan.sharded import ShardedSession, parse_strategy
    h100, options, strategy = get_device("h100-80gb"), StepOptions(precision="bf16-mixed"), parse_strategy("fsdp", 2)
    work = deep_workload()
    with DeepSession(work, options, h100, strategy) as deep:
        deep.trace(1)
        extended = deep.reserved(1)
        assert deep.whole_reserved == []  # written from the depths, not traced whole
    with ShardedSession(work, options, h100, strategy) as whole:
        whole.trace(1)
        traced = replay_steps(whole.fresh_stream, whole.fresh_steps, h100, whole.fresh_streams)
    assert extended.peak_reserved_bytes == traced.peak_reserved_bytes
    assert traced.peak_reserved_bytes > replay_steps(whole.fresh_stream, whole.fresh_steps, h100).peak_reserved_bytes
