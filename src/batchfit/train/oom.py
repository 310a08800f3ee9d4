"""Out of memory, and only out of memory: the *device* could not hand out memory.

The exception type decides first: ``torch.OutOfMemoryError`` is what the CUDA, ROCm, MPS
and XPU caching allocators raise (``CUDACachingAllocator.cpp``: "CUDA out of memory. Tried
to allocate ..."), and what batchfit's virtual device raises. Then the messages of device
allocation failures that arrive as a plain RuntimeError (or, since torch 2.8,
``torch.AcceleratorError``): the caching allocators' own messages on older builds, cuBLAS
failing to allocate its handle or workspace, and cuDNN's device allocation failures.

Not out of memory, so an error that stops the search (the batch size did not decide it):

- cuDNN's ``CUDNN_STATUS_NOT_SUPPORTED`` (an unsupported configuration: a layout, a dtype,
  a kernel limit) and its ``..._HOST_ALLOCATION_FAILED`` (host memory);
- host memory: the CPU allocator ("DefaultCPUAllocator: can't allocate memory") and pinned
  memory, whose ``cudaHostAlloc`` failure (``CachingHostAllocator.cpp``, through
  ``C10_CUDA_CHECK``) reads "CUDA error: out of memory": a bare CUDA runtime error that a
  training step's device tensors never produce (they come from the caching allocator), but
  pinned memory, a CUDA context or a library's own ``cudaMalloc`` do;
- everything else: shape errors, launch configuration errors at huge batches, NaN, the
  user's own exceptions (even when their message mentions memory).
"""

from __future__ import annotations

import torch

OOM_MESSAGES: tuple[str, ...] = (
    "CUDA out of memory",                                   # CUDACachingAllocator (older builds: RuntimeError)
    "HIP out of memory",                                    # ROCm's caching allocator
    "MPS backend out of memory",                            # Apple MPS
    "XPU out of memory",                                    # Intel XPU
    "CUBLAS_STATUS_ALLOC_FAILED",                           # cuBLAS: its handle or workspace on the device
    "CUDNN_STATUS_ALLOC_FAILED",                            # cuDNN 8: "usually an internal cudaMalloc() failure"
    "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",  # cuDNN 9: device memory
)
"""Substrings of device allocation failures raised as a RuntimeError / AcceleratorError."""

BARE_CUDA_OOM = "CUDA error: out of memory"
"""cudaErrorMemoryAllocation from a runtime call outside the caching allocator: not the batch."""


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite (with --stop-on-nan)."""


# Since torch 2.8 an error from a CUDA runtime call (C10_CUDA_CHECK) arrives as
# torch.AcceleratorError, a RuntimeError subclass.
_RUNTIME_ERRORS: tuple[type, ...] = (RuntimeError, *(
    [torch.AcceleratorError] if hasattr(torch, "AcceleratorError") else []))


def classify(error: BaseException) -> str:
    """'oom' when ``error`` means the device ran out of memory, else 'error'."""
    if isinstance(error, torch.OutOfMemoryError):
        return "oom"
    # Only the runtime's own error types: a user's RuntimeError subclass that happens to
    # mention memory is the user's error.
    if type(error) in _RUNTIME_ERRORS and any(m in str(error) for m in OOM_MESSAGES):
        return "oom"
    return "error"


def describe(error: BaseException) -> str:
    """The exception's type and the first line of its message (with why a bare CUDA
    "out of memory" is not counted as the batch not fitting)."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}".strip()
    if BARE_CUDA_OOM in text and classify(error) == "error":
        text += (" (a CUDA runtime allocation outside the caching allocator: pinned host memory, a CUDA context "
                 "or a library's own cudaMalloc, not the batch's tensors)")
    return text
