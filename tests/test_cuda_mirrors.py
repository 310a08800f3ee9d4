"""The CUDA mirrors: autocast's op table and cast cache, fused attention's saved tensors."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from batchfit.specs import load_workload
from batchfit.trace import cuda_autocast
from batchfit.trace.cuda_attention import CudaAttention
from batchfit.trace.cuda_autocast import (
    BCE_BANNED_MESSAGE,
    CudaAutocast,
    cuda_autocast_policies,
    not_mirrored,
)
from batchfit.trace.session import TraceSession
from batchfit.workload import StepOptions

x = torch.randn(4, 8)
xb = x.bfloat16()


def test_every_cuda_autocast_registration_has_a_policy_or_a_reason():
    policies, skipped = cuda_autocast_policies(), not_mirrored()
    for op in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA"):
        assert (op in policies) != (op in skipped), op
    assert all(skipped.values())
    # On the installed torch, every aten op CUDA autocast handles has its rule here...
    assert [op for op in skipped if op.startswith("aten::")] == []
    # ...including those autocast_mode.cpp registers outside the header's macros.
    assert policies["aten::norm.Scalar"] == "fp32_append_dtype"
    assert policies["aten::binary_cross_entropy"] == "banned"
    assert policies["aten::softmax.int"] == "fp32_set_opt_dtype"
    assert "aten::softmax.Dimname" not in policies  # CUDA registers one overload, not all


def test_every_policy_has_a_kernel_in_the_mirror():
    with CudaAutocast(torch.bfloat16):
        pass
    for op in cuda_autocast_policies():
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "AutocastIPU"), op


@pytest.mark.skipif(not cuda_autocast._HEADER.exists(), reason="this build ships no ATen headers")
def test_fallback_table_is_the_installed_header():
    parsed = cuda_autocast._header_policies(cuda_autocast._HEADER.read_text())
    assert parsed == cuda_autocast._fallback_policies()


labels = torch.tensor([0, 1, 2, 3])
CUDA_DTYPES = {  # what CUDA autocast(bf16) gives, from autocast_mode.h/.cpp; CPU differs on most
    "mm": (lambda: x @ x.T, torch.bfloat16),
    "linear": (lambda: F.linear(x, x), torch.bfloat16),
    "mv": (lambda: x.mv(x[0]), torch.bfloat16),
    "softmax": (lambda: torch.softmax(xb, -1), torch.float32),
    "log_softmax": (lambda: torch.log_softmax(xb, -1), torch.float32),
    "layer_norm": (lambda: F.layer_norm(xb, (8,)), torch.float32),
    "rms_norm": (lambda: F.rms_norm(xb, (8,)), torch.float32),
    "norm": (lambda: xb.norm(), torch.float32),
    "norm(dim)": (lambda: torch.norm(xb, dim=1), torch.float32),
    "sum": (lambda: xb.sum(), torch.float32),
    "sum(dim)": (lambda: xb.sum(0), torch.float32),
    "sum(dtype given)": (lambda: xb.sum(dtype=torch.bfloat16), torch.bfloat16),
    "exp": (lambda: xb.exp(), torch.float32),
    "pow": (lambda: xb.pow(2), torch.float32),
    "addcmul (bf16, fp32)": (lambda: torch.addcmul(xb, x, xb), torch.float32),
    "addcmul (bf16)": (lambda: torch.addcmul(xb, xb, xb), torch.bfloat16),
    # cat and stack are not in CUDA's table (since 1.10): their own type promotion decides.
    "cat": (lambda: torch.cat([xb, x]), torch.float32),
    "stack": (lambda: torch.stack([xb, x]), torch.float32),
    # cross_entropy is not registered: it decomposes into log_softmax (dtype given) + nll_loss (fp32)
    "cross_entropy": (lambda: F.cross_entropy(xb, labels), torch.float32),
    "float64 untouched": (lambda: x.double() @ x.double().T, torch.float64),
}


@pytest.mark.parametrize("name", CUDA_DTYPES)
def test_ops_give_cudas_dtype(name):
    fn, dtype = CUDA_DTYPES[name]
    with CudaAutocast(torch.bfloat16) as mirror, mirror.forward():
        assert fn().dtype == dtype


def test_binary_cross_entropy_is_refused_as_on_cuda():
    probs, target = torch.sigmoid(xb), torch.rand(4, 8)
    with CudaAutocast(torch.bfloat16) as mirror, mirror.forward():
        with pytest.raises(RuntimeError) as refused:
            F.binary_cross_entropy(probs, target)
        assert F.binary_cross_entropy_with_logits(xb, target).dtype == torch.float32
    assert str(refused.value) == BCE_BANNED_MESSAGE
    with CudaAutocast(torch.bfloat16):  # outside forward() autocast is off: nothing refused
        assert F.binary_cross_entropy(probs, target.bfloat16()).dtype == torch.bfloat16


def test_kernels_are_registered_once_and_cpu_autocast_is_left_as_it_was(mlp):
    TraceSession(mlp, StepOptions(precision="bf16-mixed")).trace(4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):  # a second registration would warn "overriding a previously registered kernel"
            with CudaAutocast(torch.bfloat16) as mirror, mirror.forward():
                assert torch.softmax(xb, -1).dtype == torch.float32
    assert [str(w.message) for w in seen] == []
    assert not torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.AutocastIPU)
    cpu_kernel = next(line for line in torch._C._dispatch_dump("aten::mm").splitlines()
                      if line.startswith("AutocastCPU:"))
    assert "autocast_mode.cpp" in cpu_kernel  # CPU autocast's own kernel, never replaced
    with torch.autocast("cpu", dtype=torch.bfloat16):  # CPU autocast's table, on real tensors
        assert (x @ x.T).dtype == torch.bfloat16
        assert torch.softmax(xb, -1).dtype == torch.bfloat16
        assert xb.sum().dtype == torch.bfloat16
        assert F.binary_cross_entropy(torch.sigmoid(xb), torch.rand(4, 8)).dtype == torch.float32


def test_weight_casts_are_cached_within_forward_only():
    linear = torch.nn.Linear(8, 8)
    with CudaAutocast(torch.bfloat16) as mirror:
        with mirror.forward():
            linear(x)
            linear(x)
            assert len(mirror.cache.copies) == 2  # weight and bias, cast once each
        assert mirror.cache.copies == {}


def _saved_by(fn):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    return out, saved


def test_grouped_query_attention_saves_what_cuda_flash_saves():
    """Llama-3's 32 query heads over 8 K/V heads, bf16, causal, no mask: CUDA runs flash
    attention, which reads K/V with their 8 heads and saves q, k, v, the output and an fp32
    logsumexp per query row (derivatives.yaml, _scaled_dot_product_flash_attention)."""
    b, hq, hkv, t, d = 2, 32, 8, 16, 64
    q = torch.randn(b, hq, t, d, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, hkv, t, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    with CudaAttention():
        out, saved = _saved_by(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    assert out.shape == (b, hq, t, d)
    assert sorted(s.numel() * s.element_size() for s in saved) == [
        b * hq * t * 4,  # logsumexp, fp32: 4096
        b * hkv * t * d * 2, b * hkv * t * d * 2,  # k and v, not expanded: 32768 each
        b * hq * t * d * 2, b * hq * t * d * 2,  # q and the output: 131072 each
    ]
    assert any(s is k for s in saved) and any(s is v for s in saved)  # the inputs, no copy
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, reference)
    with FakeTensorMode(), CudaAttention():  # and as the tracer runs it
        fake = F.scaled_dot_product_attention(*(torch.empty(s.shape, dtype=torch.bfloat16) for s in (q, k, v)),
                                              is_causal=True, enable_gqa=True)
        assert fake.shape == (b, hq, t, d)


def test_masked_grouped_query_attention_takes_the_math_path_as_on_cuda():
    """Flash takes no mask and CUDA's memory-efficient kernel no GQA: the math path repeats
    K/V to 32 heads and keeps the 32 x T x T softmax."""
    b, hq, hkv, t, d = 1, 32, 8, 16, 64
    q = torch.randn(b, hq, t, d, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, hkv, t, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    with CudaAttention():
        out, saved = _saved_by(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))
    assert out.shape == (b, hq, t, d)
    assert (b, hq, t, t) in [tuple(s.shape) for s in saved]


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


def test_another_threads_sdpa_is_real_while_a_trace_runs():
    """The mirror is scoped to the tracing thread: SDPA in a user's thread meanwhile runs
    PyTorch's own CPU kernel. Head size 12 is one CUDA's fused kernels refuse, so the mirror
    would take the math path; PyTorch's CPU kernel takes flash: the two differ in the kernel
    that saved the graph (its backward) and in the last bits of the output."""
    import threading

    from torch import nn

    from batchfit.workload import Workload

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 10, 12, requires_grad=True) for _ in range(3))
    outside = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert type(outside.grad_fn).__name__ == "ScaledDotProductFlashAttentionForCpuBackward0"

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(24, 72)

        def forward(self, x):
            a, b, c = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 12).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(a, b, c, is_causal=True).square().mean()

    work = Workload(name="attention", build_model=Attention, make_batch=lambda n, device: torch.randn(n, 16, 24),
                    loss_fn=lambda model, x: model(x))
    session = TraceSession(work, StepOptions())
    before = session.trace(4).snapshot
    seen = {}

    def user_thread():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        seen["out"], seen["backward"] = out.detach(), type(out.grad_fn).__name__

    with session.tracing("a test"):  # the trace's fake mode, tracker and attention mirror are on
        thread = threading.Thread(target=user_thread)
        thread.start()
        thread.join()
        traced = session.trace(4).snapshot  # and the trace still gets the mirror
    assert seen["backward"] == "ScaledDotProductFlashAttentionForCpuBackward0"
    assert torch.equal(seen["out"], outside.detach())
    assert traced.peak_bytes == before.peak_bytes and traced.breakdown == before.breakdown
