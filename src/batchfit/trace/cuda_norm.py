"""Make ``F.rms_norm`` (``nn.RMSNorm``) keep what CUDA's fused kernel keeps, while tracing.

On a CUDA device ``aten::rms_norm`` runs ``aten::_fused_rms_norm``, one kernel
(``layer_norm.cpp``'s ``rms_norm_symint``; ``cuda/layer_norm_kernel.cu``): it allocates the
output (contiguous, the input's dtype) and ``rstd``, one value per row in the accumulate
type (fp32 for fp32/bf16/fp16), shaped ``[..., 1]``; autograd saves the input, ``rstd`` and
the weight, and its backward ``_fused_rms_norm_backward`` allocates ``grad_input`` and
``grad_weight``. A CPU (and fake CPU) tensor takes the composite instead: pow, mean,
rsqrt, mul, mul, which keeps ``x * rstd`` (one more input-sized tensor) alive until the
backward; for gpt-tinystories-22m at batch 32 that is 16.7 MB per norm the GPU never holds.
Under bf16/fp16 autocast ``rms_norm`` runs in fp32 (autocast's fp32 list, mirrored by
``trace/cuda_autocast.py`` before this kernel is reached), so its output is fp32 there too.

While tracing, :class:`CudaRmsNorm` replaces ``aten::rms_norm``'s composite kernel with one
that picks as ``rms_norm_symint`` does on CUDA: the fused op (a ``torch.library.custom_op``,
``batchfit::cuda_fused_rms_norm``, whose fake kernel returns exactly the CUDA kernel's two
outputs and whose backward calls ``aten::_fused_rms_norm_backward``'s own meta kernel), or the
composite (``aten::_fused_rms_norm``'s CPU decomposition) for channels-last or complex input, a
weight whose dtype differs from the input's, or a tensor subclass such as a DTensor. Like
``CudaAttention`` it is a :class:`~batchfit.trace.cuda_kernel.KernelMirror`: registered below
autocast and above autograd (an activation-checkpointing recomputation runs it too), and only
the tracing thread gets it; another thread's rms_norm runs PyTorch's composite.

The backward also allocates what ``LaunchGammaBetaBackwardCUDAKernel`` allocates for the
weight's gradient when there are many rows and few columns (``M > 65536`` and
``N / 32 < SMs / 2``): partial sums ``[min(32768 / ceil(N / 32), ceil(M / 32)), N]`` in the
weight's dtype, summed with ``.sum(0)`` into a new ``grad_weight`` (the kernel's own
``grad_weight`` is dropped). The SM count is taken as an H100's (132); it decides only
whether these few MiB (at most 4 MiB for fp32) appear. Known limit: the ``.sum(0)``
reduction's own staging buffer on the GPU (8 MiB + 16 B for gpt-tinystories-22m at batch
1504), freed at once, is not counted; nor is the contiguous copy the kernel makes of a
non-contiguous input.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor

from batchfit.trace.cuda_kernel import KernelMirror, mirrored_here

SM_COUNT = 132
"""Streaming multiprocessors assumed for the weight-gradient scratch rule (an H100 SXM)."""

_AVAILABLE = hasattr(torch.ops.aten, "_fused_rms_norm_backward")
"""torch versions before the fused kernel ran rms_norm as the composite on CUDA too."""


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _stat_shape(input: torch.Tensor, normalized_shape: Sequence[int]) -> list[int]:
    axis = input.dim() - len(normalized_shape)
    return [*input.shape[:axis], *[1] * len(normalized_shape)]


@torch.library.custom_op("batchfit::cuda_fused_rms_norm", mutates_args=())
def cuda_fused_rms_norm(input: torch.Tensor, normalized_shape: Sequence[int], weight: torch.Tensor | None,
                        eps: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten::_fused_rms_norm`` as CUDA runs it: (output, rstd), nothing else kept."""
    out, rstd = torch.ops.aten._fused_rms_norm(input, list(normalized_shape), weight, eps)
    return out, rstd


@cuda_fused_rms_norm.register_fake
def _(input, normalized_shape, weight, eps):
    # layer_norm_kernel.cu: Y = empty_like(X, contiguous); rstd = empty({M}, acc type), viewed [..., 1]
    out = torch.empty_like(input, memory_format=torch.contiguous_format)
    return out, input.new_empty(_stat_shape(input, normalized_shape), dtype=_acc_dtype(input.dtype))


def _setup_context(ctx, inputs, output) -> None:
    input, normalized_shape, weight, _ = inputs
    ctx.normalized_shape = list(normalized_shape)
    ctx.save_for_backward(input, output[1], weight)  # derivatives.yaml: input, result1 (rstd), weight


def _real_backward(grad_out, input, normalized_shape, rstd, weight):
    """The math of ``_fused_rms_norm_backward`` for real tensors (it has no CPU kernel)."""
    dims = tuple(range(input.dim() - len(normalized_shape), input.dim()))
    acc = _acc_dtype(input.dtype)
    x_hat = input.to(acc) * rstd
    g = grad_out.to(acc)
    gw = g * weight.to(acc) if weight is not None else g
    grad_input = rstd * (gw - x_hat * (gw * x_hat).mean(dims, keepdim=True))
    grad_weight = None
    if weight is not None:
        grad_weight = (g * x_hat).sum(tuple(range(input.dim() - len(normalized_shape)))).to(weight.dtype)
    return grad_input.to(input.dtype), grad_weight


def _weight_grad_partials(grad_weight: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``LaunchGammaBetaBackwardCUDAKernel``'s tall-and-narrow path: partial sums, then ``.sum(0)``."""
    if not (rows > 64 * 1024 and cols // 32 < SM_COUNT // 2):
        return grad_weight
    blocks_x = -(-cols // 32)
    blocks_y = min((64 * 1024 // 2) // blocks_x, -(-rows // 32))
    partials = grad_weight.new_empty((blocks_y, cols))
    return partials.sum(0).view(grad_weight.shape)


def _backward(ctx, grad_out, grad_rstd):
    input, rstd, weight = ctx.saved_tensors
    mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[2]]
    if isinstance(input, FakeTensor):
        grad_input, grad_weight = torch.ops.aten._fused_rms_norm_backward(
            grad_out, input, ctx.normalized_shape, rstd, weight, mask)
        if mask[1]:
            cols = weight.numel()
            grad_weight = _weight_grad_partials(grad_weight, input.numel() // cols, cols)
    else:
        grad_input, grad_weight = _real_backward(grad_out, input, ctx.normalized_shape, rstd, weight)
    return (grad_input if mask[0] else None), None, (grad_weight if mask[1] else None), None


cuda_fused_rms_norm.register_autograd(_backward, setup_context=_setup_context)


def _fused_on_cuda(input: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """``rms_norm_symint``'s conditions for the fused kernel, plus: a plain or fake tensor."""
    plain = all(type(t) in (torch.Tensor, FakeTensor, torch.nn.Parameter) for t in (input, weight) if t is not None)
    format = {4: torch.channels_last, 5: torch.channels_last_3d}.get(input.dim())
    channels_last = (format is not None and not input.is_contiguous()
                     and input.is_contiguous(memory_format=format))
    return (plain and not input.is_complex() and not channels_last
            and (weight is None or weight.dtype == input.dtype))


def _rms_norm_as_on_cuda(input, normalized_shape, weight=None, eps=None):
    if mirrored_here("rms_norm") and _fused_on_cuda(input, weight):  # not another thread's
        return cuda_fused_rms_norm(input, list(normalized_shape), weight, eps)[0]
    return torch.ops.aten._fused_rms_norm(input, list(normalized_shape), weight, eps)[0]  # the composite, on CPU


class CudaRmsNorm(KernelMirror):
    """Context manager: ``rms_norm`` runs CUDA's fused kernel's allocations, for fake CPU tensors, in this thread."""

    def __init__(self) -> None:
        super().__init__("rms_norm", _rms_norm_as_on_cuda, available=_AVAILABLE)
