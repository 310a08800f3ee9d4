"""The GPU catalog, memory sizes such as '48GiB', and the real device.

Capacity figures are ``memory.total`` as ``nvidia-smi`` (``rocm-smi`` for the MI300X) prints
it for each card, in MiB; TFLOP/s are the vendors' dense (no sparsity) bf16 tensor-core
figures (fp16 where the card has no bf16) and bandwidths are the vendors' datasheet numbers.

What a training process can hand to tensors is less than the total: the CUDA context and
the kernels PyTorch loads take memory outside the caching allocator (``context_bytes``),
and cuBLAS keeps a workspace per handle inside it (``workspace_bytes``). Both are stated
assumptions, printed in every report, and the GPU benchmark checks them.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import asdict, dataclass

from batchfit.errors import SizeError, UnknownGPUError

MiB = 2**20
GiB = 2**30
GB = 10**9

# CUDA context plus PyTorch's kernels with lazy module loading (CUDA >= 11.7, PyTorch's
# default): a few hundred MiB on current cards; we assume 512 MiB and say so.
DEFAULT_CONTEXT_BYTES = 512 * MiB

# PyTorch gives each cuBLAS handle a workspace through the caching allocator, so it counts
# in memory_allocated. CublasHandlePool.cpp's default CUBLAS_WORKSPACE_CONFIG is ":4096:8"
# (32 MiB) on compute capability >= 9.0 and ":4096:2:16:8" (8 MiB + 128 KiB) before.
# A training step uses two handles: the main thread's (forward) and the autograd engine's
# worker thread's (backward).
CUBLAS_HANDLES_PER_STEP = 2


def cublas_workspace_bytes(compute_capability_major: int) -> int:
    """Bytes of cuBLAS workspace one training step allocates, by CUDA compute capability."""
    per_handle = 32 * MiB if compute_capability_major >= 9 else 8 * MiB + 128 * 1024
    return CUBLAS_HANDLES_PER_STEP * per_handle


@dataclass(frozen=True, kw_only=True)
class Device:
    """A GPU to size a batch for: a catalog entry, a custom capacity, or the real one."""

    name: str
    """Catalog key (``h100-80gb``), ``custom`` for --gpu-memory, or the real device's name."""
    display_name: str
    """How the vendor names it."""
    total_bytes: int
    """Memory the driver reports for the card."""
    context_bytes: int = DEFAULT_CONTEXT_BYTES
    """Taken by the CUDA context and kernels, outside PyTorch's allocator."""
    workspace_bytes: int = cublas_workspace_bytes(9)
    """cuBLAS workspaces one training step allocates inside PyTorch's allocator."""
    bf16_tflops: float | None = None
    """Dense bf16 (or fp16) tensor TFLOP/s, for MFU."""
    bandwidth_gb_per_s: float | None = None
    """Memory bandwidth in GB/s (10**9 bytes)."""
    source: str = "catalog"
    """Where the numbers come from: catalog, user (--gpu-memory) or measured."""

    @property
    def usable_bytes(self) -> int:
        """What the caching allocator can hand out: total minus the context."""
        return self.total_bytes - self.context_bytes

    def to_json(self) -> dict:
        return {**asdict(self), "usable_bytes": self.usable_bytes}


def _gpu(name, display, mib, tflops, bandwidth_gb_per_s, cc_major) -> Device:
    return Device(
        name=name,
        display_name=display,
        total_bytes=mib * MiB,
        workspace_bytes=cublas_workspace_bytes(cc_major),
        bf16_tflops=tflops,
        bandwidth_gb_per_s=bandwidth_gb_per_s,
    )


CATALOG: dict[str, Device] = {
    d.name: d
    for d in [
        _gpu("h100-80gb", "NVIDIA H100 80GB HBM3 (SXM)", 81559, 989.0, 3350, 9),
        _gpu("h100-pcie-80gb", "NVIDIA H100 PCIe 80GB", 81559, 756.0, 2000, 9),
        _gpu("h200-141gb", "NVIDIA H200 141GB HBM3e", 143771, 989.0, 4800, 9),
        _gpu("a100-80gb", "NVIDIA A100 80GB", 81920, 312.0, 2039, 8),
        _gpu("a100-40gb", "NVIDIA A100 40GB", 40960, 312.0, 1555, 8),
        _gpu("a10g-24gb", "NVIDIA A10G", 23028, 70.0, 600, 8),
        _gpu("l4-24gb", "NVIDIA L4", 23034, 121.0, 300, 8),
        _gpu("l40s-48gb", "NVIDIA L40S", 46068, 362.0, 864, 8),
        _gpu("rtx4090-24gb", "NVIDIA GeForce RTX 4090", 24564, 165.0, 1008, 8),
        _gpu("rtx6000ada-48gb", "NVIDIA RTX 6000 Ada Generation", 49140, 364.0, 960, 8),
        _gpu("v100-16gb", "NVIDIA Tesla V100 16GB (fp16)", 16160, 125.0, 900, 7),
        _gpu("v100-32gb", "NVIDIA Tesla V100 32GB (fp16)", 32510, 125.0, 900, 7),
        _gpu("t4-16gb", "NVIDIA Tesla T4 (fp16)", 15360, 65.0, 320, 7),
        _gpu("mi300x-192gb", "AMD Instinct MI300X", 196592, 1307.0, 5300, 9),
    ]
}

ALIASES = {"h100": "h100-80gb", "h100-sxm-80gb": "h100-80gb", "h200": "h200-141gb",
           "a100": "a100-80gb", "rtx6000-ada-48gb": "rtx6000ada-48gb", "4090": "rtx4090-24gb"}


def get_device(name: str) -> Device:
    """Look a GPU up by catalog name, case-insensitive; suggest the closest on a typo."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key in CATALOG:
        return CATALOG[key]
    close = difflib.get_close_matches(key, [*CATALOG, *ALIASES], n=1, cutoff=0.5)
    hint = f"did you mean '{ALIASES.get(close[0], close[0])}'? " if close else ""
    raise UnknownGPUError(
        f"unknown GPU '{name}': {hint}run `batchfit gpus` for the catalog, "
        "or give the capacity with --gpu-memory 24GiB"
    )


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": GB, "tb": 10**12,
          "kib": 2**10, "mib": MiB, "gib": GiB, "tib": 2**40}


def parse_size(text: str) -> int:
    """'48GiB' -> 51539607552; '80GB' -> 80000000000. A unit is required (GiB != GB)."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = found.group(2).lower() if found else ""
    if not found or unit not in _UNITS:
        raise SizeError(
            f"cannot read the size '{text}': write a number and a unit, e.g. 24GiB (2**30 bytes) "
            "or 80GB (10**9 bytes)"
        )
    return int(float(found.group(1)) * _UNITS[unit])


def custom_device(total_bytes: int) -> Device:
    """A GPU known only by its capacity (--gpu-memory); assumes a current NVIDIA card."""
    return Device(name="custom", display_name=f"GPU with {format_bytes(total_bytes)}",
                  total_bytes=total_bytes, source="user")


def detect_cuda_device(index: int = 0) -> Device:
    """The real GPU, as CUDA reports it."""
    import torch

    props = torch.cuda.get_device_properties(index)
    return Device(name="cuda", display_name=props.name, total_bytes=props.total_memory,
                  workspace_bytes=cublas_workspace_bytes(props.major), source="measured")


def format_bytes(n: float) -> str:
    """Binary units, spelled out: 1.50 GiB."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
