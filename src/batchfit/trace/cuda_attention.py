"""Make ``F.scaled_dot_product_attention`` keep what the CUDA kernels keep, while tracing.

On a GPU (compute capability >= 8.0) SDPA runs a fused kernel (flash attention, or the
memory-efficient one when there is a mask or fp32): it saves the output and an fp32
log-sum-exp per query row, never the T x T scores. On a CPU the same call may fall back to
the math path (with dropout, say), which saves the whole softmax and the dropout mask: for
GPT-2 at seq 1024 that is gigabytes a layer that a GPU never holds.

While tracing, :class:`CudaAttention` replaces SDPA's composite kernel (the one that picks a
backend) with one that picks as CUDA does: PyTorch's CPU flash kernel, whose saved tensors
(output + logsumexp) match the CUDA fused kernels, or the math path for head sizes the fused
kernels refuse. Grouped-query calls (``enable_gqa=True``, Llama-3's 8 K/V heads for 32 Q
heads) keep K/V unexpanded on the flash path, as CUDA's flash kernel does, and go to the
math path (K/V repeated to Q's heads) where CUDA's fused kernels refuse them. It is a
:class:`~batchfit.trace.cuda_kernel.KernelMirror`: registered below autocast (which has already
cast the inputs) and above autograd, so activation-checkpointing recomputation sees it too.

A dispatcher registration is process-wide, but the mirror is not: only the thread that
entered :class:`CudaAttention` (the one tracing) gets it; SDPA called from any other thread
meanwhile (a user's real model next to the trace) runs PyTorch's own kernel, kept before the
registration. Backward, where recomputation happens, runs in the tracing thread for CPU
(and fake CPU) tensors.

Known limit: the fused backward kernels allocate scratch of their own (flash attention's
fp32 dq accumulator; with GQA, dK/dV at Q's head count before they are summed per group)
that no op returns; it is not counted.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from batchfit.errors import OptionError
from batchfit.trace.cuda_kernel import KernelMirror, mirrored_here

_SDPA = "aten::scaled_dot_product_attention"
_PYTORCH_SDPA = torch._C._dispatch_get_computed_kernel_for_dispatch_key(_SDPA, "CPU")
"""PyTorch's own SDPA (the composite kernel that picks a backend), kept before any mirror is
registered: what a thread that is not tracing runs."""
_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_MATH = torch.ops.aten._scaled_dot_product_attention_math.default
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention.default
_EFFICIENT = torch.ops.aten._scaled_dot_product_efficient_attention.default
_EFFICIENT_BACKWARD = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default


def cuda_would_fuse(query: torch.Tensor) -> bool:
    """Fused kernels need the head size to be a multiple of 8 (and at most 256 for flash;
    memory-efficient attention takes larger ones)."""
    return query.shape[-1] % 8 == 0


def cuda_flash_takes_gqa(query: torch.Tensor, attn_mask: torch.Tensor | None) -> bool:
    """Whether CUDA runs a grouped-query call (``enable_gqa=True``, fewer K/V heads) fused.

    Only flash attention reads K/V with fewer heads than Q (``can_use_flash_attention`` in
    ``cuda/sdp_utils.cpp`` checks heads with GQA allowed); the memory-efficient kernel of
    the released versions refuses it, so a masked, fp32 or head-size > 256 GQA call runs
    the math path. Flash takes no mask and only fp16/bf16 (compute capability >= 8.0).
    """
    return (cuda_would_fuse(query) and query.shape[-1] <= 256 and attn_mask is None
            and query.dtype in (torch.float16, torch.bfloat16))


@torch.library.custom_op("batchfit::cuda_efficient_attention", mutates_args=())
def cuda_efficient_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attn_bias: torch.Tensor | None, compute_log_sumexp: bool, dropout_p: float,
                             is_causal: bool, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA's ``_scaled_dot_product_efficient_attention`` without its philox seed and offset,
    which CUDA keeps on the host (``at::empty({}, kLong)``, not the device): (out, logsumexp).
    Only fake tensors are traced through it (its meta kernel gives CUDA's shapes and strides)."""
    raise NotImplementedError("batchfit.cuda_efficient_attention runs on fake tensors only")


@cuda_efficient_attention.register_fake
def _(query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, scale):
    out, logsumexp, _, _ = _EFFICIENT(query, key, value, attn_bias, compute_log_sumexp, dropout_p,
                                      is_causal, scale=scale)
    return out, logsumexp


@torch.library.custom_op("batchfit::cuda_efficient_attention_backward", mutates_args=())
def cuda_efficient_attention_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                                      value: torch.Tensor, attn_bias: torch.Tensor | None, out: torch.Tensor,
                                      logsumexp: torch.Tensor, dropout_p: float, is_causal: bool,
                                      scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_scaled_dot_product_efficient_attention_backward``'s dq, dk, dv (fake tensors only)."""
    raise NotImplementedError("batchfit.cuda_efficient_attention_backward runs on fake tensors only")


@cuda_efficient_attention_backward.register_fake
def _(grad_out, query, key, value, attn_bias, out, logsumexp, dropout_p, is_causal, scale):
    seed, offset = (torch.empty((), dtype=torch.int64) for _ in range(2))  # host scalars on CUDA
    dq, dk, dv, _ = _EFFICIENT_BACKWARD(grad_out, query, key, value, attn_bias, out, logsumexp, seed, offset,
                                        dropout_p, [True, True, True, False], is_causal, scale=scale)
    return dq, dk, dv


def _efficient_setup(ctx, inputs, output) -> None:
    query, key, value, attn_bias, _, ctx.dropout_p, ctx.is_causal, ctx.scale = inputs
    # derivatives.yaml: query, key, value, attn_bias, result0 (out), result1 (logsumexp)
    ctx.save_for_backward(query, key, value, attn_bias, *output)


def _efficient_backward(ctx, grad_out, _grad_logsumexp):
    query, key, value, attn_bias, out, logsumexp = ctx.saved_tensors
    dq, dk, dv = cuda_efficient_attention_backward(grad_out, query, key, value, attn_bias, out, logsumexp,
                                                   ctx.dropout_p, ctx.is_causal, ctx.scale)
    return dq, dk, dv, None, None, None, None, None  # a mask's own gradient is not traced


cuda_efficient_attention.register_autograd(_efficient_backward, setup_context=_efficient_setup)


def _bool_mask_as_bias(attn_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``convert_boolean_attn_mask`` (sdp_utils): CUDA's SDPA turns a boolean mask into an
    additive one of the query's dtype before it picks a kernel."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    return torch.where(attn_mask.logical_not(), -float("inf"), torch.zeros((), dtype=dtype))


def _sharded_on_sequence(query: torch.Tensor) -> bool:
    """A DTensor query: torch's context-parallel SDPA (the ring) is running."""
    from torch.distributed.tensor import DTensor

    return isinstance(query, DTensor)


def _check_ring(query, attn_mask, fused: bool, *, efficient: bool) -> None:
    """What torch's ring attention (context parallelism) cannot run, refused in one line: a mask, SDPA's
    math kernel, and the memory-efficient kernel's logsumexp (padded to 32 positions) at half-chunks that
    are not a multiple of 32. Each crashed inside the ring."""
    if attn_mask is not None:
        raise OptionError("context parallelism: this model passes SDPA an attention mask, which torch's ring "
                          "attention does not take (causal attention only, is_causal=True): drop cp<N>")
    if not fused:
        raise OptionError("context parallelism: this attention (grouped-query K/V, or a head size or dtype no fused "
                          "CUDA kernel takes) runs SDPA's math kernel, which torch's ring attention does not take: "
                          "use `precision` bf16-mixed (flash takes grouped K/V), or drop cp<N>")
    local = query.to_local().shape[-2]
    if efficient and (local // 2) % 32:
        raise OptionError(f"context parallelism: the memory-efficient kernel (fp32, or a mask) pads its logsumexp to "
                          f"32 positions, and torch's ring merges half-chunks of {local // 2}, which it cannot: use "
                          f"`seq_len` a multiple of {64 * (query.shape[-2] // local)} (64 x cp), or "
                          "`precision` bf16-mixed (flash)")


def _sdpa_as_on_cuda(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                     scale=None, enable_gqa=False):
    if not mirrored_here("scaled_dot_product_attention"):  # another thread's SDPA, not the trace's
        return _PYTORCH_SDPA.call_boxed(torch._C._dispatch_keys(query), query, key, value, attn_mask, dropout_p,
                                        is_causal, scale=scale, enable_gqa=enable_gqa)
    grouped = enable_gqa and key.shape[-3] != query.shape[-3]
    flash = cuda_flash_takes_gqa(query, attn_mask)
    fused = flash if grouped else cuda_would_fuse(query)
    if _sharded_on_sequence(query):
        _check_ring(query, attn_mask, fused, efficient=fused and not flash and is_fake(query))
    if not fused:
        # The math path repeats K/V to Q's heads itself (pre_process_group_query_attention_input).
        return _MATH(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                     is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)[0]
    if not is_fake(query):  # a FakeTensor, or AOTAutograd's FunctionalTensor over one (a compiled trace)
        # Real tensors (the tests' numerics): the CUDA kernels have no CPU kernel; the CPU flash
        # kernel saves the same tensors. K/V go in with their own (fewer) heads.
        out, _ = _FLASH_CPU(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
        return out
    if flash:
        # Flash (fp16/bf16, no mask, head size <= 256) reads K/V with their own heads and saves
        # q, k, v, the output (laid out as q is), an fp32 logsumexp and its 2 RNG words.
        return _FLASH(query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    # Memory-efficient attention (fp32, or a mask): its output is allocated [B, S, H, D] and
    # returned transposed, so the usual out.transpose(1, 2).reshape(B, S, H * D) is free.
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if _sharded_on_sequence(query):
        # context parallelism (distributed/context_parallel.py): q, k, v are DTensors, and torch's ring
        # takes CUDA's own op (its CP table names it); its seed and offset come out as 0-dim tensors
        return _EFFICIENT(query, key, value, _bool_mask_as_bias(attn_mask, query.dtype), True, dropout_p,
                          is_causal, scale=scale)[0]
    return cuda_efficient_attention(query, key, value, _bool_mask_as_bias(attn_mask, query.dtype), grad,
                                    dropout_p, is_causal, scale)[0]


class CudaAttention(KernelMirror):
    """Context manager: SDPA picks its kernel as CUDA would, for fake CPU tensors, in this thread."""

    def __init__(self) -> None:
        super().__init__("scaled_dot_product_attention", _sdpa_as_on_cuda)
