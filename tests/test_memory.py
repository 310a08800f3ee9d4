"""The tracer's bytes against bytes worked out by hand, and against a real CPU step."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from batchfit.step import TrainingStep
from batchfit.trace.memory import rounded
from batchfit.trace.session import TraceSession
from batchfit.workload import StepOptions, Workload

# Linear(1024, 4096) + Linear(4096, 1024) in fp32: each tensor is a multiple of 512 bytes.
W1, B1, W2, B2 = 4096 * 1024 * 4, 4096 * 4, 1024 * 4096 * 4, 1024 * 4
P = W1 + B1 + W2 + B2  # 33,574,912 bytes


def test_rounding_is_the_cuda_allocators():
    assert [rounded(n) for n in (0, 1, 512, 513, 4096 * 4)] == [0, 512, 512, 1024, 16384]


def test_mlp_adamw_fp32_by_hand(mlp):
    snap = TraceSession(mlp, StepOptions()).trace(4).snapshot
    assert snap.breakdown["parameters"] == P
    assert snap.breakdown["gradients"] == P
    # AdamW keeps exp_avg and exp_avg_sq; its step counters stay on the host on CUDA.
    assert snap.breakdown["optimizer_state"] == 2 * P
    # The foreach step's one parameter-sized temporary, and the 4-byte loss in a 512 B block.
    assert snap.phase == "optimizer"
    assert snap.peak_bytes == 5 * P + 512


def test_sgd_without_momentum_has_no_state(mlp):
    snap = TraceSession(mlp, StepOptions(optimizer="sgd")).trace(4).snapshot
    assert snap.breakdown["optimizer_state"] == 0


def test_bf16_mixed_forward_by_hand():
    """One bias-free Linear(4096, 4096), batch 1, loss = y.float().sum(), under CUDA autocast."""
    n = 4096
    work = Workload(name="linear", build_model=lambda: nn.Linear(n, n, bias=False),
                    make_batch=lambda b, device: torch.randn(b, n, device=device),
                    loss_fn=lambda model, x: model(x).float().sum())
    snap = TraceSession(work, StepOptions(precision="bf16-mixed")).trace(1).snapshot
    weight, state = n * n * 4, 2 * n * n * 4
    # The forward peak is at y.float(): the fp32 weight and its Adam state, the cached bf16
    # copy of the weight, x (fp32) and its bf16 cast, y (bf16) and y.float() (fp32). Then y
    # is freed (nothing saves it) before sum() makes the 512-byte loss.
    forward = weight + state + n * n * 2 + rounded(n * 4) + rounded(n * 2) + rounded(n * 2) + rounded(n * 4)
    assert snap.peak_by_phase["forward"] == forward


def test_pure_bf16_halves_weights_and_state(mlp):
    snap = TraceSession(mlp, StepOptions(precision="bf16")).trace(4).snapshot
    assert snap.breakdown["parameters"] == P // 2
    assert snap.breakdown["optimizer_state"] == P


def test_frozen_parameters_have_no_gradients_or_state(mlp):
    snap = TraceSession(mlp, StepOptions(frozen=("0.*",))).trace(4).snapshot
    assert snap.breakdown["gradients"] == W2 + B2
    assert snap.breakdown["optimizer_state"] == 2 * (W2 + B2)


def test_gradient_accumulation_keeps_gradients_across_micro_batches(mlp):
    one = TraceSession(mlp, StepOptions()).trace(2048).snapshot
    four = TraceSession(mlp, StepOptions(accumulation_steps=4)).trace(2048).snapshot
    # From the second micro-batch on, gradients are alive through the backward pass.
    assert four.peak_bytes >= one.peak_bytes
    assert four.breakdown["gradients"] > 0


def _profiled_peak(work: Workload, batch_size: int, tmp_path) -> int:
    step = TrainingStep(work, StepOptions(), torch.device("cpu"))
    step.run(batch_size)  # the optimizer state exists before the profiled step, as in the trace
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        step.run(batch_size)
    path = tmp_path / "timeline.json"
    with pytest.warns(FutureWarning):
        prof.export_memory_timeline(str(path), device="cpu")
    _, sizes = json.loads(path.read_text())
    return max(sum(row) for row in sizes)


@pytest.mark.parametrize("batch_size", [64, 4096])
def test_traced_peak_matches_the_profilers_memory_timeline(mlp, batch_size, tmp_path):
    """An independent measurement: PyTorch's profiler on a real CPU step, within 2%."""
    traced = TraceSession(mlp, StepOptions(), cuda_semantics=False).trace(batch_size).snapshot.peak_bytes
    measured = _profiled_peak(mlp, batch_size, tmp_path)
    assert abs(traced - measured) / measured < 0.02
