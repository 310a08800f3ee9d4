"""plan traces rank 0 compiled under --compile for FSDP2 (fsdp, fsdp-noreshard, hsdp), DDP, zero1
and zero2, against one real 2-process gloo run compiled with inductor on this CPU that steps each
strategy in turn (rank 0's steady step, the profiler's memory timeline). tp2 under --compile model
(DTensor in the compiled graph) and DDP's graph cut at its buckets under --compile model are in
benchmarks/recipes.py (--only compile-plan): their inductor compiles take minutes here.

Before the trace kept the saved input of a fused cat alive (trace/compiled.py: _FusedRun), fsdp
was -2.8% (9,007,880 traced against 9,270,084): the SwiGLU backward's two gradients are written
by inductor straight into their cat, allocated while the saved input they read is still alive.

Checked against torch's own code running for real over gloo (inductor compiling FSDP2, DDP and
ZeroRedundancyOptimizer steps); zero2's reduce to the owner is batchfit's own (checks its counting).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os

import pytest
import torch.distributed as dist

from batchfit.devices import get_device
from batchfit.plan.sharded import ShardedSession, parse_strategy
from batchfit.workload import StepOptions
from cpu_truth import gloo_step, join_gloo, leave_gloo, spawn_profiled_gloo
from tiny import LOCAL_BATCH, rank0_profiled_peaks, tiny_workload

OPTIONS = StepOptions(compile="blocks")  # fp32, AdamW; torchtitan compiles per block under FSDP2
MEASURED = ("fsdp", "fsdp-noreshard", "hsdp2", "ddp", "zero1", "zero2")
"""One gloo run steps each in turn: the blocks' graphs are the same in all (FSDP2's and DDP's
collectives run in hooks outside them), so inductor compiles them once (its FX graph cache)."""


def _gloo_main(rank: int, port: int, out_dir: str) -> None:
    from batchfit.distributed.zero import with_sharded_optimizer

    join_gloo(rank, 2, port, timeout_s=300)
    peaks: dict[str, list[int]] = {}
    for name in MEASURED:
        strategy = parse_strategy(name, 2)
        # seeded: the same parameters on both ranks (zero2 has no DDP to broadcast them)
        step = gloo_step(*with_sharded_optimizer(tiny_workload(), OPTIONS, strategy), strategy)
        step.run(LOCAL_BATCH)  # inductor compiles here, and AdamW builds its state
        step.run(LOCAL_BATCH)  # DDP rebuilds its buckets here
        # Two profiled steps, the least kept: one full run on a loaded 2-core machine read fsdp at 9,860,932 B
        # (+6%) where every other run reads 9,270,084 (not reproduced, cause not found); more steps only if
        # the profiler's timeline failed its own check (it does, now and then).
        peaks[name] = rank0_profiled_peaks(step, os.path.join(out_dir, "timeline.json"))
        del step
        gc.collect()  # the last strategy's model and optimizer (cycles): freed inside the next profile otherwise
        dist.barrier()
    leave_gloo(rank, os.path.join(out_dir, "peaks.json"), peaks)


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[str, list[int]]:
    path = tmp_path_factory.mktemp("gloo-compiled")
    spawn_profiled_gloo(_gloo_main, lambda port: (port, str(path)), nprocs=2)
    return json.loads((path / "peaks.json").read_text())


def _traced(name: str, options: StepOptions = OPTIONS) -> int:
    with ShardedSession(tiny_workload(), options, get_device("h100-80gb"), parse_strategy(name, 2),
                        cuda_semantics=False) as session:
        assert session.session.compiled == (options.compile != "none")
        return session.trace(LOCAL_BATCH).peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize("name", MEASURED)
def test_compiled_trace_matches_a_real_gloo_run_compiled_with_inductor(measured, name):
    real = min(measured[name])
    traced = _traced(name)
    # when written: -32 B (zero1, zero2) to -60 B of 9.3 to 12.7 MB
    assert abs(traced - real) / real < 0.02, (traced, real)
    if name == "fsdp":
        traced_eager = _traced(name, dataclasses.replace(OPTIONS, compile="none"))
        assert traced_eager > 1.1 * real, (traced_eager, real)  # what plan said before: +11.3%


def test_ddp_compiled_is_cut_at_its_buckets_as_dynamo_does():
    # --compile model under DDP: dynamo's DDPOptimizer cuts the graph where DDP's buckets end (a
    # 1 MiB first bucket, then 25 MiB): the tiny model's 1.7 MB of fp32 parameters make 2 graphs,
    # each partitioned by AOTAutograd alone (benchmarks/recipes.py: the real run's peak, as traced).
    from torch._dynamo.utils import counters

    before = counters["aot_autograd"]["total"]
    _traced("ddp", StepOptions(compile="model"))
    assert counters["aot_autograd"]["total"] - before == 2


def test_which_strategies_are_traced_compiled_in_plan():
    from batchfit.trace.compiled import TP_BLOCKS_FAIL, sharded_eager_reason, sharded_traces_compiled

    for name in ("fsdp", "fsdp-noreshard", "hsdp2", "ddp", "zero1", "zero2"):
        assert sharded_traces_compiled(parse_strategy(name, 4), OPTIONS), name
        assert not sharded_traces_compiled(parse_strategy(name, 4), StepOptions()), name
    assert sharded_traces_compiled(parse_strategy("tp4", 4), StepOptions(compile="model"))
    assert sharded_eager_reason(parse_strategy("tp4", 4), OPTIONS) == TP_BLOCKS_FAIL
    for name in ("fsdp+tp2", "pp4", "pp2+fsdp"):
        for options in (OPTIONS, StepOptions(compile="model")):
            assert sharded_eager_reason(parse_strategy(name, 4), options), name
    assert "CPUOffloadPolicy" in sharded_eager_reason(parse_strategy("fsdp", 4), StepOptions(compile="blocks",
                                                                                             offload="params"))


def test_a_plan_says_which_strategies_were_traced_compiled_and_why_not_the_others():
    from batchfit.trace.compiled import COMPILED_AS_EAGER, COMPILED_TRACED, plan_compile_approximations

    said = plan_compile_approximations(tiny_workload(), OPTIONS, ["fsdp", "ddp"], {"tp2": "why", "pp2": "why not"})
    assert [(a.what, a.detail) for a in said] == [
        (COMPILED_TRACED.what, "--compile blocks: fsdp, ddp traced compiled"),
        (COMPILED_AS_EAGER.what, "--compile blocks: tp2 traced eager: why"),
        (COMPILED_AS_EAGER.what, "--compile blocks: pp2 traced eager: why not")]
    compiled = plan_compile_approximations(tiny_workload(), OPTIONS, ["fsdp"], {})
    assert [a.what for a in compiled] == [COMPILED_TRACED.what]
    assert [a.what for a in plan_compile_approximations(tiny_workload(), OPTIONS, [], {"tp2": "why"})] == [
        COMPILED_AS_EAGER.what]
    assert plan_compile_approximations(tiny_workload(), StepOptions(), [], {"ddp": ""}) == []
