"""What torchao's float8 linears do differently on a CUDA device, mirrored for the trace.

The trace runs torchao's real ``Float8Linear`` and its tensor subclasses (``Float8TrainingTensor``,
``WeightWithDynamicFloat8CastTensor``) on fake CPU tensors; ``torch._scaled_mm`` runs its meta
kernel there (``torch/_meta_registrations.py``: ``meta_scaled_mm``), the same one for a CUDA
tensor, so every float8 buffer, scale and output has the size and dtype CUDA gives it. One thing
differs by device: ``Float8Linear.forward`` (torchao ``float8/float8_linear.py``) asks
``torch.is_autocast_enabled()``, which is CUDA's flag, and then casts its input to
``torch.get_autocast_gpu_dtype()``:

    if torch.is_autocast_enabled():
        autocast_dtype = torch.get_autocast_gpu_dtype()
        input = input.to(autocast_dtype)

Under the trace's autocast (CPU autocast with CUDA's op table, ``trace/cuda_autocast.py``) that
flag is off, so an fp32 input (an RMSNorm's fp32 output, under CUDA autocast) would be kept for
backward in fp32 where a GPU keeps its bf16 copy. :func:`mirror_float8_autocast` makes each float8
linear see CUDA's flag as a GPU run would: on, with the autocast dtype, whenever autocast is on
(the forward, and activation checkpointing's recomputation, which restores autocast as it was).
"""

from __future__ import annotations

import torch
from torch import nn

from batchfit.train.float8 import float8_linears


def _on_cuda(forward):
    def forward_as_on_cuda(input, *args, **kwargs):
        if not torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
            return forward(input, *args, **kwargs)
        dtype = torch.get_autocast_dtype("cuda")
        torch.set_autocast_enabled("cuda", True)  # a flag only: no fake CPU tensor dispatches to AutocastCUDA
        torch.set_autocast_dtype("cuda", torch.get_autocast_dtype("cpu"))
        try:
            return forward(input, *args, **kwargs)
        finally:
            torch.set_autocast_enabled("cuda", False)
            torch.set_autocast_dtype("cuda", dtype)

    forward_as_on_cuda.batchfit_float8_mirror = True
    return forward_as_on_cuda


def mirror_float8_autocast(model: nn.Module) -> int:
    """Give each torchao ``Float8Linear`` of ``model`` CUDA's autocast flag while autocast is on;
    returns how many (0 for a model without float8 linears)."""
    linears = float8_linears(model)
    for _, module in linears:
        if not getattr(module.forward, "batchfit_float8_mirror", False):
            module.forward = _on_cuda(module.forward)
    return len(linears)
