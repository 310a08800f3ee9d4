"""The CUDA mirrors: autocast's op table and cast cache, fused attention's saved tensors.

Checked against torch's own autocast registrations (the installed header and dispatcher) and, for the
dtypes CUDA gives, batchfit's own table of CUDA's behaviour (checks the mirroring, not a GPU run)."""

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
from batchfit.trace.cuda_norm import CudaRmsNorm
from batchfit.trace.memory import MemoryTracker
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


def test_the_mirror_holds_under_the_python_dispatcher():
    """dynamo and AOTAutograd trace fake tensors with the Python dispatcher on, which turns the
    mirror's redispatch into a fresh call that met the mirror again, without end (compiled traces
    under mixed precision ran eager because of it): the same dtypes there, and outside forward()."""
    from torch._dispatch.python import enable_python_dispatcher

    with CudaAutocast(torch.bfloat16) as mirror, FakeTensorMode(allow_non_fake_inputs=True), \
            enable_python_dispatcher():
        with mirror.forward():
            assert {name: fn().dtype for name, (fn, _) in CUDA_DTYPES.items()} == {
                name: dtype for name, (_, dtype) in CUDA_DTYPES.items()}
        assert torch.softmax(xb, -1).dtype == torch.bfloat16 and torch.cat([xb, xb]).dtype == torch.bfloat16


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


def _allocated_by(fn):
    """(op, shape, dtype) of every storage a call allocates on fake tensors, as the tracer counts them."""
    tracker = MemoryTracker(round_bytes=1)
    with tracker:
        out = fn()
    return out, [(r.op, r.shape, r.dtype) for r in tracker._window]


def test_rms_norm_allocates_and_saves_what_cudas_fused_kernel_does():
    """aten::_fused_rms_norm on CUDA (gpt-tinystories-22m, fp32, batch 32: the H100 timeline's
    16,777,216 B output + 32,768 B rstd at transformer.py:98): the output and an fp32 rstd per
    row; autograd keeps input, rstd and weight, not the composite's x * rstd."""
    with FakeTensorMode(), CudaRmsNorm():
        x = torch.empty(32, 256, 512, requires_grad=True)
        norm = torch.nn.RMSNorm(512)
        tracker = MemoryTracker(round_bytes=1)
        with tracker:
            y, saved = _saved_by(lambda: norm(x))
        assert [(r.shape, r.dtype, r.nbytes) for r in tracker._window] == [
            ((32, 256, 512), "float32", 16_777_216), ((32, 256, 1), "float32", 32_768)]
        assert [(tuple(s.shape), s.dtype) for s in saved] == [
            ((32, 256, 512), torch.float32), ((32, 256, 1), torch.float32), ((512,), torch.float32)]
        assert saved[0] is x and saved[2] is norm.weight
        with tracker:
            y.sum().backward()
        grads = [(r.op, r.shape) for r in tracker._window if r.op == "_fused_rms_norm_backward"]
        assert grads == [("_fused_rms_norm_backward", (32, 256, 512)), ("_fused_rms_norm_backward", (512,))]


def test_rms_norm_mirror_computes_what_rms_norm_computes():
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    probe = torch.arange(8.0, dtype=torch.float64)
    expected = F.rms_norm(x, [8], w, 1e-5)
    expected_grads = torch.autograd.grad((expected * probe).sum(), (x, w))
    with CudaRmsNorm():
        out = F.rms_norm(x, [8], w, 1e-5)
        grads = torch.autograd.grad((out * probe).sum(), (x, w))
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(grads, expected_grads)


def test_rms_norm_runs_in_fp32_under_bf16_autocast_as_on_cuda():
    """llama-1b bf16-mixed b8 on the H100: a 134,217,728 B fp32 output + 65,536 B rstd per norm."""
    with FakeTensorMode(), CudaAutocast(torch.bfloat16) as mirror, mirror.forward(), CudaRmsNorm():
        x = torch.empty(8, 2048, 2048, dtype=torch.bfloat16)
        y, allocated = _allocated_by(lambda: F.rms_norm(x, [2048], torch.empty(2048)))
    assert y.dtype == torch.float32
    assert [a for a in allocated if a[0] == "cuda_fused_rms_norm"] == [
        ("cuda_fused_rms_norm", (8, 2048, 2048), "float32"), ("cuda_fused_rms_norm", (8, 2048, 1), "float32")]


def test_rms_norm_weight_gradient_takes_cudas_partial_sums_for_many_rows():
    """M = 1504 x 256 rows of N = 512 (gpt-tinystories-22m b1504): LaunchGammaBetaBackwardCUDAKernel
    sums [min(32768 / 16, M / 32) = 2048, 512] partials (the H100 timeline's 4,194,304 B) into a new
    2,048 B grad_weight; at M = 8192 (b32) it writes grad_weight directly (the timeline: none)."""
    for rows, partials in ((1504 * 256, [(2048, 512)]), (32 * 256, [])):
        with FakeTensorMode(), CudaRmsNorm():
            x = torch.empty(rows // 256, 256, 512, requires_grad=True)
            w = torch.empty(512, requires_grad=True)
            y = F.rms_norm(x, [512], w)
            _, allocated = _allocated_by(lambda: y.sum().backward())
        assert [a[1] for a in allocated if len(a[1]) == 2] == partials  # grad_input is [rows, 512] too
        assert [a[1] for a in allocated if a[1] == (512,)] == [(512,)] * (2 if partials else 1)
        assert w.grad.shape == (512,)


def test_efficient_attention_output_is_transposed_as_on_cuda():
    """fp32 goes to CUDA's memory-efficient kernel, which allocates its output [B, S, H, D] and
    returns it transposed: the model's y.transpose(1, 2).reshape(B, S, H * D) is a view, no copy
    (the fp32 b32 H100 timeline: 16,777,216 B output + 524,288 B fp32 logsumexp at transformer.py:60,
    nothing more, and no copy at line 61). Its philox seed and offset live on the host."""
    b, h, t, d = 32, 16, 256, 32
    with FakeTensorMode(), CudaAttention():
        q, k, v = (torch.empty(b, h, t, d, requires_grad=True) for _ in range(3))
        out, allocated = _allocated_by(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        assert [(shape, dtype) for _, shape, dtype in allocated] == [((b, h, t, d), "float32"), ((b, h, t), "float32")]
        assert out.transpose(1, 2).is_contiguous()
        out.sum().backward()
        assert q.grad.shape == (b, h, t, d)


def test_flash_attention_output_is_laid_out_as_its_query_as_on_cuda():
    """bf16 goes to flash attention, whose output takes the query's layout: a contiguous query
    (after RoPE) gives a contiguous output, which the model copies to transpose, as the bf16 H100
    timelines show (394,264,576 B at transformer.py:61 for b1504). Flash keeps 2 RNG words too."""
    with FakeTensorMode(), CudaAttention():
        q, k, v = (torch.empty(2, 4, 64, 32, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        out, allocated = _allocated_by(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        assert out.is_contiguous() and not out.transpose(1, 2).is_contiguous()
        assert sorted(shape for _, shape, _ in allocated) == [(), (2,), (2, 4, 64), (2, 4, 64, 32)]
        out.sum().backward()
        assert q.grad.shape == q.shape


def test_masked_attention_takes_the_efficient_kernel_with_an_additive_mask():
    """CUDA's SDPA turns a boolean mask into an additive one of the query's dtype (sdp_utils
    convert_boolean_attn_mask), then runs memory-efficient attention: no T x T scores kept."""
    with FakeTensorMode(), CudaAttention():
        q = torch.empty(2, 4, 64, 32, requires_grad=True)
        mask = torch.ones(64, 64, dtype=torch.bool)
        out, allocated = _allocated_by(lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=mask))
        assert ("where", (64, 64), "float32") in allocated
        assert not any(shape[-2:] == (64, 64) for op, shape, _ in allocated if op != "where" and op != "logical_not")
        out.sum().backward()


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


def test_another_threads_rms_norm_is_pytorchs_while_a_trace_runs():
    """The rms_norm override is process-wide: only the tracing thread may get the mirror."""
    import threading

    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8)
    seen = {}

    def other_thread():
        out = F.rms_norm(x, [8], w, 1e-6)
        seen["grad_fn"] = type(out.grad_fn).__name__

    with CudaRmsNorm():
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert "cuda_fused_rms_norm" not in seen["grad_fn"]  # PyTorch's composite (MulBackward0), not the mirror
