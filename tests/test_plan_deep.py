"""A sharded step traced at depths 2, 3, 4 and extrapolated is the whole model's trace.

The check is against the tracer itself run on the whole model (``trace_sharded``): the same
peak, breakdown, FLOPs, parameter counts and every collective in order, byte for byte.

Checked against batchfit's own whole-model trace (checks the extrapolation, not the fidelity to a GPU).
"""

from __future__ import annotations

import dataclasses

import pytest

from batchfit.devices import get_device
from batchfit.plan.deep import DeepSession, collectives_at, trace_deep
from batchfit.plan.sharded import Collective, ShardedSession, parse_strategy, trace_sharded
from batchfit.workload import StepOptions
from tiny import deep_workload

WORKLOAD = deep_workload()
H100 = get_device("h100-80gb")


@pytest.mark.parametrize("strategy,gpus", [("fsdp+tp2", 4)])  # FSDP's and TP's collectives, both
def test_deep_trace_is_the_whole_trace(strategy, gpus):
    # (with checkpointing this tiny model's backward peak is not affine in depth, so
    # trace_deep traces it whole; Llama-3.1-8B's is, see the plan benchmark)
    options = StepOptions(precision="bf16-mixed")
    s = parse_strategy(strategy, gpus)
    whole = trace_sharded(WORKLOAD, options, H100, s, 2)
    opened = []
    deep = trace_deep(WORKLOAD, options, H100, s, 2,
                      session=lambda *a, **k: opened.append(1) or ShardedSession(*a, **k))
    assert len(opened) == 3  # depths 2, 3, 4; no fallback to the whole model
    fields = ("peak_bytes", "breakdown", "phase", "flops", "params", "params_per_rank", "collectives")
    assert {f: getattr(deep, f) for f in fields} == {f: getattr(whole, f) for f in fields}


def test_collectives_repeat_per_block_in_each_run():
    # forward gathers blocks 0..d-1, backward reduces them in reverse: two runs, one per pass
    def calls(d):
        fwd = [Collective("all_gather", "dp", 2, 100 + k % 1, "forward") for k in range(d)]
        bwd = [Collective("reduce_scatter", "dp", 2, 100, "backward") for _ in range(d)]
        head = Collective("all_gather", "dp", 2, 7, "forward")
        return tuple([head] + fwd + [head] + bwd)

    assert collectives_at([calls(2), calls(3), calls(4)], 32) == calls(32)
    bent = calls(4)[:-1] + (dataclasses.replace(calls(4)[-1], bytes=1),)
    assert collectives_at([calls(2), calls(3), bent], 32) is None


@pytest.mark.parametrize("strategy", [pytest.param("fsdp", marks=pytest.mark.slow),
                                      pytest.param("fsdp+tp2", marks=pytest.mark.slow)])
def test_one_session_per_depth_traces_every_local_batch_as_a_fresh_trace_would(strategy):
    options = StepOptions(precision="bf16-mixed")
    s = parse_strategy(strategy, 4)
    opened = []
    with DeepSession(WORKLOAD, options, H100, s, session=lambda *a, **k: opened.append(1) or ShardedSession(*a, **k)) \
            as deep:
        points = {b: deep.trace(b) for b in (3, 1, 2)}
    assert len(opened) == 3 and deep.whole_traces == []
    fields = ("peak_bytes", "breakdown", "phase", "flops", "params_per_rank", "collectives")
    for b, point in points.items():
        alone = trace_sharded(WORKLOAD, options, H100, s, b)  # a fresh session, the whole model
        assert {f: getattr(point, f) for f in fields} == {f: getattr(alone, f) for f in fields}, b


def test_ddp_of_small_blocks_is_traced_whole():
    # this model's 12 blocks share DDP's 25 MiB gradient buckets, so its collectives are not
    # one block's calls repeated: the depths' lists do not extrapolate and the whole model is traced
    opened = []
    with DeepSession(WORKLOAD, StepOptions(), H100, parse_strategy("ddp", 2),
                     session=lambda *a, **k: opened.append(a[0]) or ShardedSession(*a, **k)) as deep:
        point = deep.trace(1)
    assert len(opened) == 4 and opened[-1] is WORKLOAD and deep.whole_traces == [1]
    whole = trace_sharded(WORKLOAD, StepOptions(), H100, parse_strategy("ddp", 2), 1)
    assert (point.peak_bytes, point.collectives) == (whole.peak_bytes, whole.collectives)


@pytest.mark.slow
def test_reserved_replays_reuse_the_fresh_traces_they_have():
    """The depth sessions' first trace is a fresh process: a replay at that size takes its
    streams (no session opened); a replay at a size not traced yet opens fresh sessions, whose
    point is the steady one, which trace() then takes, byte for byte. (That the plan's figures do
    not change: benchmarks/plan_speed.py --keep-json, before and after, docs/tracing/plan-memory.md.)"""
    options = StepOptions(precision="bf16-mixed")
    s = parse_strategy("fsdp", 2)
    opened = []
    counting = lambda *a, **k: opened.append(1) or ShardedSession(*a, **k)  # noqa: E731
    with DeepSession(WORKLOAD, options, H100, s, session=counting) as deep, \
            DeepSession(WORKLOAD, options, H100, s) as other:
        deep.trace(1)
        reused = deep.reserved(1)
        assert len(opened) == 3  # the depth sessions only
        replayed = deep.reserved(2)
        assert len(opened) == 6
        point = deep.trace(2)
        assert len(opened) == 6 and deep.whole_reserved == [] and deep.whole_traces == []
        other.trace(1)
        steady = other.trace(2)  # traced the usual way: a later step of the depth sessions
    assert replayed.peak_allocated_by_step[-1] > reused.peak_allocated_by_step[-1]  # the steady step at 2, at 1
    fields = ("peak_bytes", "breakdown", "phase", "flops", "params_per_rank", "collectives")
    assert {f: getattr(point, f) for f in fields} == {f: getattr(steady, f) for f in fields}


@pytest.mark.slow
def test_a_whole_models_replay_gives_its_point_too():
    """A model too shallow to cut (1 block) replays a size not traced yet in a fresh session: that
    session's point is the size's steady step, so trace() takes it and opens nothing more (one
    trace of the size, not two), byte for byte what the long-lived session traces."""
    from tiny import tiny_workload

    options, s = StepOptions(precision="bf16-mixed"), parse_strategy("fsdp", 2)
    opened = []
    counting = lambda *a, **k: opened.append(1) or ShardedSession(*a, **k)  # noqa: E731
    with DeepSession(tiny_workload(), options, H100, s, session=counting) as deep, \
            DeepSession(tiny_workload(), options, H100, s) as other:
        deep.trace(1)
        deep.reserved(3)
        assert len(opened) == 2  # the whole model's session, and the replay's fresh one
        point = deep.trace(3)
        assert len(opened) == 2 and deep.whole_reserved == [3]
        other.trace(1)
        steady = other.trace(3)
    fields = ("peak_bytes", "breakdown", "phase", "flops", "params_per_rank", "collectives")
    assert {f: getattr(point, f) for f in fields} == {f: getattr(steady, f) for f in fields}



@pytest.mark.parametrize("strategy", ["fsdp", pytest.param("fsdp+cp2", marks=[pytest.mark.slow, pytest.mark.extended])])
def test_shallow_depths_in_a_forked_process_trace_what_one_process_does(strategy):
    """``fork``: depths 2 and 3 live in a forked child (trace/forked.py) while this process traces depth 4: the
    same points, fresh streams, reserved replays (written from the stream line too) as one process, byte for byte."""
    from batchfit.trace.forked import can_fork

    if not can_fork():
        pytest.skip("no second core here")
    options = StepOptions(precision="bf16-mixed", checkpointing="full")

    def traced(fork: bool):
        with DeepSession(WORKLOAD, options, H100, parse_strategy(strategy, 4), fork=fork) as deep:
            assert (deep._forked is not None) == fork
            points = [deep.trace(b) for b in (1, 2, 3)]
            replays = [deep.reserved(b).to_json() for b in (3, 1, 5, 4)]  # 5: fresh sessions; 4: from the line
            return points + [deep.trace(5)], replays, deep.whole_reserved, deep.line.summary()

    assert traced(True) == traced(False)


def test_plans_first_sizes_larger_first_give_the_stream_line_its_small_end():
    """plan traces a deep session's first two sizes the larger first (``trace_first_sizes(larger_first=True)``):
    the sessions' first trace, a fresh process's at 2, is the stream line's small end, so a reserved search below
    two fresh sizes opens no fresh sessions for it (traced 1 first, a model whose stream has fewer events at 1,
    as Llama-3.1-70B's under fsdp+cp8, traced a fresh 2 for it). That the plan's figures do not change:
    benchmarks/plan_auto70.py, the same plan.json as the order before (docs/accuracy.md)."""
    from batchfit.search import trace_first_sizes

    class Sizes:  # what trace_first_sizes reads of a curve
        def __init__(self, deep):
            self.points, self.point = {}, lambda b: self.points.setdefault(b, deep.trace(b))

    options = StepOptions(precision="bf16-mixed")

    def replays(larger_first: bool) -> tuple[dict, int]:
        opened = []
        counting = lambda *a, **k: opened.append(1) or ShardedSession(*a, **k)  # noqa: E731
        with DeepSession(WORKLOAD, options, H100, parse_strategy("fsdp", 4), session=counting) as deep:
            sizes = Sizes(deep)
            trace_first_sizes(sizes, None, 1, H100.usable_bytes, larger_first=larger_first)
            assert list(sizes.points) == ([2, 1] if larger_first else [1, 2])
            for b in (6, 4, 5):  # 6, 4: fresh sessions; 5: from the line
                deep.reserved(b)
            return deep.line.summary(), len(opened)

    assert replays(True) == ({"written": [5], "through": [2, 6], "checked_at": [4]},
                             3 + 3 + 3)  # the depth sessions, then fresh ones at 6 and at 4: none at 2
