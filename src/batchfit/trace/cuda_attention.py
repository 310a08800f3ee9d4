"""Make ``F.scaled_dot_product_attention`` keep what the CUDA kernels keep, while tracing.

On a GPU (compute capability >= 8.0) SDPA runs a fused kernel (flash attention, or the
memory-efficient one when there is a mask or fp32): it saves the output and an fp32
log-sum-exp per query row, never the T x T scores. On a CPU the same call may fall back to
the math path (with dropout, say), which saves the whole softmax and the dropout mask: for
GPT-2 at seq 1024 that is gigabytes a layer that a GPU never holds.

While tracing, :class:`CudaAttention` replaces SDPA's composite kernel (the one that picks a
backend) with one that picks as CUDA does: PyTorch's CPU flash kernel, whose saved tensors
(output + logsumexp) match the CUDA fused kernels, or the math path for head sizes the fused
kernels refuse. It is a dispatcher registration, below autocast (which has already cast the
inputs) and above autograd, so activation-checkpointing recomputation sees it too.

Known limit: the fused backward kernels allocate scratch of their own (flash attention's
fp32 dq accumulator) that no op returns; it is not counted.
"""

from __future__ import annotations

import warnings

import torch

_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_MATH = torch.ops.aten._scaled_dot_product_attention_math.default


def cuda_would_fuse(query: torch.Tensor) -> bool:
    """Fused kernels need the head size to be a multiple of 8 (and at most 256 for flash;
    memory-efficient attention takes larger ones)."""
    return query.shape[-1] % 8 == 0


def _sdpa_as_on_cuda(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                     scale=None, enable_gqa=False):
    if cuda_would_fuse(query):
        out, _ = _FLASH_CPU(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
        return out
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
    return _MATH(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                 is_causal=is_causal, scale=scale)[0]


class CudaAttention:
    """Context manager: SDPA picks its kernel as CUDA would, for fake CPU tensors."""

    def __enter__(self) -> CudaAttention:
        self._lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
            self._lib.impl("scaled_dot_product_attention", _sdpa_as_on_cuda, "CompositeImplicitAutograd")
        return self

    def __exit__(self, *exc) -> None:
        self._lib._destroy()
