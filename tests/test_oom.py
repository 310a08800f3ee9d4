"""Out of memory means the device could not hand out memory: real message texts -> class.

The texts are the ones torch and its libraries raise (CUDACachingAllocator.cpp,
CachingHostAllocator.cpp through C10_CUDA_CHECK, cuBLAS / cuDNN status names, the CPU
allocator), so the table fails when the classification drifts from what a GPU says.
"""

from __future__ import annotations

import pytest
import torch

from batchfit.train.oom import classify, describe

CUDA_RUNTIME_OOM = ("CUDA error: out of memory\nSearch for `cudaErrorMemoryAllocation' in "
                    "https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html for more information.\n"
                    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n")

DEVICE = [  # the device ran out: the batch does not fit
    torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
        "1.06 GiB is free. Of the allocated memory 76.50 GiB is allocated by PyTorch, and 1.10 GiB is reserved "
        "by PyTorch but unallocated."),
    RuntimeError("CUDA out of memory. Tried to allocate 36.00 MiB (GPU 0; 7.93 GiB total capacity; 130.35 MiB "
                 "already allocated; 47.06 MiB free; 188.00 MiB reserved in total by PyTorch)"),  # torch < 1.13
    RuntimeError("HIP out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 63.98 GiB"),
    RuntimeError("MPS backend out of memory (MPS allocated: 1.00 GB, other allocations: 2.00 GB, max allowed: "
                 "18.13 GB). Tried to allocate 256 bytes on shared pool."),
    RuntimeError("XPU out of memory. Tried to allocate 1.00 GiB"),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),  # cuDNN 8: an internal cudaMalloc failed
    RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED"),  # cuDNN 9
]

NOT_DEVICE = [  # anything else stops the search as itself
    RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a "
                 "non-contiguous input."),
    RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                 "tried to allocate 1125899906842624 bytes. Error code 12 (Cannot allocate memory)"),
    torch.AcceleratorError(CUDA_RUNTIME_OOM),  # cudaHostAlloc (pinned memory) failing, torch >= 2.8
    RuntimeError(CUDA_RUNTIME_OOM),  # the same before torch 2.8
    torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
    RuntimeError("CUDA error: invalid configuration argument"),  # huge-batch launch configuration
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"),
    ValueError("my data loader ran out of memory-mapped files"),  # the user's own, whatever it says
]


@pytest.mark.parametrize("error", DEVICE, ids=lambda e: str(e)[:40])
def test_device_allocation_failures_are_out_of_memory(error):
    assert classify(error) == "oom"


@pytest.mark.parametrize("error", NOT_DEVICE, ids=lambda e: str(e)[:40])
def test_everything_else_is_an_error(error):
    assert classify(error) == "error"


def test_a_real_host_allocation_failure_is_not_out_of_memory():
    """The CPU allocator's own failure, raised here for real: host memory is not the device's."""
    with pytest.raises(RuntimeError) as caught:
        torch.empty(2**50, dtype=torch.uint8)  # 1 PiB of host memory
    assert "DefaultCPUAllocator" in str(caught.value)
    assert classify(caught.value) == "error"


def test_a_bare_cuda_out_of_memory_says_why_it_is_not_the_batch():
    text = describe(torch.AcceleratorError(CUDA_RUNTIME_OOM))
    assert text.startswith("AcceleratorError: CUDA error: out of memory (") and "pinned host memory" in text
    assert "\n" not in text
