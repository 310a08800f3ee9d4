"""``plan --limit reserved``: rank 0's fresh process replayed through the caching allocator model.

By hand on the stand-in (``test_plan_standin.py``, 100 GiB usable, no workspace): a stream whose
first step holds an 8 GiB buffer once (freed before the second) reserves 8 GiB more than the
steady step allocates, and the peak is named as the first step's. On the real tracer: the
reserved peak plan replays on one GPU is estimate's, byte for byte, and DDP's bucket rebuild
is in the stream: one bucket of every gradient from the build, freed at the start of the
second step before the new buckets are allocated (``Reducer::initialize_buckets``).
"""

from __future__ import annotations

import dataclasses

import pytest

from batchfit.devices import GiB, get_device
from batchfit.plan.engine import plan
from batchfit.plan.reserved import replay_steps
from batchfit.plan.world import World
from batchfit.workload import StepOptions
from test_plan_standin import gpu, standin, trace_sharded, workload  # noqa: F401 - standin is a fixture
from test_plan_trace import tiny_workload

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
