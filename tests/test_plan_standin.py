"""The stand-in tracer of tests/standin.py is what its docstring says, and keeps to the real
tracer's contract (plan takes either as ``trace=`` / ``parse=``)."""

from __future__ import annotations

import inspect

from standin import GiB, parse_strategies, trace_sharded, workload


def test_the_standin_is_what_its_docstring_says():
    s = parse_strategies("fsdp+tp2", 4)[0]
    assert (s.dp, s.tp, s.shard) == (2, 2, "fsdp")
    point = trace_sharded(workload(), None, None, s, 8)
    assert point.peak_bytes == 4 * GiB + 4 * GiB  # 16 GiB / (2 x 2) + 8 GiB / 2


def test_the_standin_keeps_to_the_real_contract():
    """The stand-in's functions take the real ones' arguments: plan takes either as ``trace=`` / ``parse=``."""
    from batchfit.plan import sharded as real
    from standin import replay_sharded

    assert list(inspect.signature(real.trace_sharded).parameters)[:5] == \
        ["workload", "options", "device", "strategy", "local_batch"]
    assert list(inspect.signature(real.parse_strategies).parameters)[:2] == ["text", "world_size"]
    assert list(inspect.signature(replay_sharded).parameters) == list(inspect.signature(trace_sharded).parameters)
