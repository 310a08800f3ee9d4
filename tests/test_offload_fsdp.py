"""--offload params: FSDP2's CPUOffloadPolicy in plan, traced on the fake process group.

Truth: a real 2-process gloo run on this CPU (35 s here, over the suite's budget: run with
BATCHFIT_GLOO_TRUTH=1 or by ``benchmarks/recipes.py --only offload``) of the same FSDP2 step with the policy (torch
allows it on CPU, without pinning), rank 0 measured by the profiler, against the trace's device +
host total (a CPU holds both). By hand: the device bytes fall by exactly rank 0's parameter shards
and its optimizer state (the gradients are gone at the peak either way), and they reappear on the
host (the tiny Llama of test_plan_trace, 2 ranks: shards exact, no padding).

Checked against torch's own FSDP2 CPUOffloadPolicy running for real over gloo, and bytes by hand.
"""

from __future__ import annotations

import json
import os

import pytest

from batchfit.devices import get_device
from batchfit.errors import OptionError
from batchfit.plan.sharded import parse_strategy, trace_sharded
from batchfit.workload import StepOptions
from cpu_truth import gloo_step, join_gloo, leave_gloo, spawn_profiled_gloo
from tiny import LOCAL_BATCH, TOTAL, rank0_profiled_peaks, tiny_workload

OFFLOAD = StepOptions(offload="params")


def _trace(options: StepOptions, name: str = "fsdp"):
    return trace_sharded(tiny_workload(), options, get_device("h100-80gb"), parse_strategy(name, 2), LOCAL_BATCH,
                         cuda_semantics=False)


def _gloo_main(rank: int, port: int, out_dir: str) -> None:
    join_gloo(rank, 2, port, timeout_s=60)
    step = gloo_step(tiny_workload(), OFFLOAD, parse_strategy("fsdp", 2), cpu_offload=True)
    step.run(LOCAL_BATCH)
    peaks = rank0_profiled_peaks(step, os.path.join(out_dir, "timeline.json"))  # the smaller of two
    leave_gloo(rank, os.path.join(out_dir, "peak.json"), min(peaks, default=None))


@pytest.mark.skipif(not os.environ.get("BATCHFIT_GLOO_TRUTH"), reason="a 2-process gloo run (35 s here): "
                    "BATCHFIT_GLOO_TRUTH=1, or benchmarks/recipes.py --only offload, runs it")
def test_traced_device_plus_host_matches_a_real_gloo_run(tmp_path) -> None:
    spawn_profiled_gloo(_gloo_main, lambda port: (port, str(tmp_path)), nprocs=2)
    real = json.loads((tmp_path / "peak.json").read_text())
    point = _trace(OFFLOAD)
    assert abs(point.total_peak_bytes - real) / real < 0.02, (point.total_peak_bytes, real)


def test_device_bytes_fall_by_the_shards_and_state_that_moved() -> None:
    plain, moved = _trace(StepOptions()), _trace(OFFLOAD)
    shard = TOTAL // 2 * 4  # rank 0's fp32 parameter shard, bytes
    buffers = 64 * 32 * 4  # RoPE's table, 8,192 bytes: a buffer, which FSDP2 neither shards nor offloads
    assert plain.breakdown["parameters"] == shard + buffers and plain.breakdown["optimizer_state"] == 2 * shard  # AdamW
    assert moved.breakdown["parameters"] == buffers and moved.breakdown["optimizer_state"] == 0
    assert plain.peak_bytes - moved.peak_bytes == 3 * shard
    assert moved.total_peak_bytes == plain.total_peak_bytes  # on one CPU nothing moved at all
    # On the host: the shards, AdamW's two states and the gradients (one flat reduce-scatter
    # output per FSDP group), and the optimizer step's temporaries, counted where they run.
    assert moved.host_peak_bytes >= 4 * shard


def test_params_offload_needs_fsdp() -> None:
    with pytest.raises(OptionError, match="`offload` params is FSDP2's CPUOffloadPolicy"):
        _trace(OFFLOAD, "ddp")
