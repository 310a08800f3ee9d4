"""Tests that need a CUDA device: skipped on CPU machines (and in CI)."""

from __future__ import annotations

import pytest
import torch

from batchfit import StepOptions, estimate, load_workload, parse_target
from batchfit.devices import detect_cuda_device
from batchfit.probe.runner import probe_once

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_traced_peak_within_3_percent_of_measured(precision):
    workload = load_workload("gpt-tinystories-22m")
    options = StepOptions(precision=precision)
    traced = estimate(workload, device=detect_cuda_device(), options=options, batch_sizes=[32], suggest=False)
    measured = probe_once(workload, options, parse_target("cuda"), 32).peak_allocated_bytes
    assert abs(traced.point(32).peak_bytes - measured) / measured < 0.03


def test_real_oom_is_classified_and_the_memory_comes_back():
    workload = load_workload("gpt2-124m")
    baseline = torch.cuda.memory_allocated()
    trial = probe_once(workload, StepOptions(), parse_target("cuda"), 100_000)
    assert trial.status == "oom"
    assert torch.cuda.memory_allocated() == baseline


def test_traced_reserved_within_5_percent_of_a_fresh_process():
    """The allocator model's reserved peak against a real fresh process (spawned, two steps)."""
    from batchfit.probe.runner import probe_isolated
    from batchfit.targets import Target

    workload = load_workload("gpt-tinystories-22m")
    options = StepOptions(precision="bf16-mixed")
    device = detect_cuda_device()
    traced = probe_once(workload, options, Target("virtual", device, "virtual:here"), 32, limit="reserved")
    measured = probe_isolated("gpt-tinystories-22m", None, options, parse_target("cuda"), 32, limit="reserved")
    assert measured.status == "ok", measured.error
    assert abs(traced.peak_reserved_bytes - measured.peak_reserved_bytes) / measured.peak_reserved_bytes < 0.05
