"""Out of memory, and only out of memory.

The exception type decides first (``torch.OutOfMemoryError``, which the CUDA, ROCm, MPS and
XPU allocators raise, and which batchfit's virtual device raises). Then the known messages
of failures that mean the same but arrive as a plain RuntimeError (or, since torch 2.8,
``torch.AcceleratorError``): a CUDA/HIP runtime
allocation failure outside the caching allocator, cuBLAS failing to allocate its workspace,
and cuDNN's "not supported" that large batches provoke (Lightning and Accelerate count it
as out of memory too). Everything else (shape errors, CUDA launch configuration errors at
huge batches, NaN, the user's own exceptions) is an error that stops the search.
"""

from __future__ import annotations

import torch

OOM_MESSAGES: tuple[str, ...] = (
    "CUDA out of memory",                          # CUDACachingAllocator (older builds: RuntimeError)
    "CUDA error: out of memory",                   # cudaErrorMemoryAllocation outside the allocator
    "HIP out of memory",                           # ROCm's caching allocator
    "hipErrorOutOfMemory",                         # ROCm runtime
    "MPS backend out of memory",                   # Apple MPS
    "XPU out of memory",                           # Intel XPU
    "CUBLAS_STATUS_ALLOC_FAILED",                  # cuBLAS could not allocate its workspace
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED",     # cuDNN at very large batches
    "DefaultCPUAllocator: can't allocate memory",  # the CPU allocator
)


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite (with --stop-on-nan)."""


# Since torch 2.8 a CUDA error raised by the runtime (a failed allocation inside a kernel,
# "CUDA error: out of memory") arrives as torch.AcceleratorError, a RuntimeError subclass.
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
    """The exception's type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".strip()
