"""The CUDA mirrors: autocast's op table and cast cache, fused attention's saved tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchfit.specs import load_workload
from batchfit.trace.cuda_autocast import CudaAutocast, cuda_op_lists
from batchfit.trace.session import TraceSession
from batchfit.workload import StepOptions

x = torch.randn(4, 8)
xb = x.bfloat16()


def test_op_lists_come_from_the_installed_header():
    lists = cuda_op_lists()
    assert "linear" in lists["AT_FORALL_LOWER_PRECISION_FP"]
    assert "layer_norm" in lists["AT_FORALL_FP32"]
    assert "log_softmax" in lists["AT_FORALL_FP32_SET_OPT_DTYPE"]


def test_cuda_table_replaces_cpu_table_and_is_restored():
    cases = {  # what CUDA autocast gives (aten/src/ATen/autocast_mode.h), CPU differs on each
        "softmax": (lambda: torch.softmax(xb, -1), torch.float32),
        "log_softmax": (lambda: torch.log_softmax(xb, -1), torch.float32),
        "layer_norm": (lambda: F.layer_norm(xb, (8,)), torch.float32),
        "rms_norm": (lambda: F.rms_norm(xb, (8,)), torch.float32),
        "exp": (lambda: xb.exp(), torch.float32),
        "mv": (lambda: x.mv(x[0]), torch.bfloat16),
        "mm": (lambda: x @ x.T, torch.bfloat16),
    }
    with CudaAutocast(torch.bfloat16) as mirror, mirror.forward():
        for name, (fn, dtype) in cases.items():
            assert fn().dtype == dtype, name
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.softmax(xb, -1).dtype == torch.bfloat16  # CPU's own table is back


def test_weight_casts_are_cached_within_forward_only():
    linear = torch.nn.Linear(8, 8)
    with CudaAutocast(torch.bfloat16) as mirror:
        with mirror.forward():
            linear(x)
            linear(x)
            assert len(mirror.cache.copies) == 2  # weight and bias, cast once each
        assert mirror.cache.copies == {}


def test_attention_saves_no_seq_by_seq_tensor():
    """GPT-2 has attention dropout: the CPU math path would keep B x H x T x T scores."""
    work = load_workload("hf:gpt2", seq_len=256)
    snap = TraceSession(work, StepOptions(precision="bf16-mixed")).trace(2).snapshot
    assert all(t["shape"][-2:] != [256, 256] for t in snap.top)


def test_checkpointing_recomputes_under_the_same_table():
    work = load_workload("gpt-tinystories-22m", seq_len=64)
    plain = TraceSession(work, StepOptions(precision="bf16-mixed")).trace(64).snapshot
    ckpt = TraceSession(work, StepOptions(precision="bf16-mixed", checkpointing="full")).trace(64).snapshot
    assert ckpt.breakdown["activations"] < plain.breakdown["activations"]
