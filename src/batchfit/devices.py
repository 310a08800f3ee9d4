"""The GPU catalog, memory sizes such as '48GiB', and the real device.

Capacity figures are ``memory.total`` as ``nvidia-smi`` (``rocm-smi`` for the MI300X) prints
it for each card, in MiB; TFLOP/s are the vendors' dense (no sparsity) datasheet figures:
``bf16_tflops`` the bf16 tensor-core peak (fp16 where the card has no bf16: V100, T4) and
``fp32_tflops`` the plain fp32 (CUDA core) peak, which is what an fp32 PyTorch run uses
(``torch.backends.cuda.matmul.allow_tf32`` is False by default since PyTorch 1.12);
bandwidths are the vendors' datasheet numbers. Sources: NVIDIA H100, H200, A100, A10, L4,
L40S, RTX 6000 Ada, V100 and T4 datasheets, the Ada Lovelace architecture whitepaper
(RTX 4090), AMD's MI300X data sheet.

Interconnect (``batchfit plan``'s communication time) is per GPU and per direction, in GB/s:
the vendors quote NVLink as the sum of both directions (H100 SXM "900 GB/s"), and a ring
collective sends one way while it receives the other, so the catalog halves their figure.
Within a node: NVLink 4 for H100/H200 SXM (900 GB/s), NVLink 3 for A100 SXM (600 GB/s),
NVLink 2 for V100 SXM2 (300 GB/s), AMD Infinity Fabric for MI300X (7 links x 128 GB/s =
896 GB/s), each from the card's datasheet; the PCIe cards talk over PCIe (Gen5 x16: 64 GB/s a
way for the H100 PCIe, Gen4 x16: 32 GB/s, Gen3 x16: 16 GB/s for the T4), which is what they
have without an NVLink bridge. Between nodes: one 400 Gb/s InfiniBand NDR adapter per GPU
(50 GB/s) as in NVIDIA's DGX H100/H200 reference design, one 200 Gb/s HDR adapter per GPU
(25 GB/s) as in DGX A100, and for the cards with no reference cluster design one 100 Gb/s
link per GPU (12.5 GB/s), an assumption the report prints. Every figure can be overridden
(``batchfit plan --intra-node-gb-per-s/--inter-node-gb-per-s``).

Host link (``--offload``'s transfer time): the PCIe interface between each GPU and the host,
per direction, from the same datasheets: PCIe Gen5 x16 (64 GB/s a way) for H100 SXM and PCIe,
H200 and MI300X; Gen4 x16 (32 GB/s) for A100, A10G, L4, L40S, RTX 4090 and RTX 6000 Ada; Gen3
x16 (16 GB/s) for V100 and T4. These are the links' signalling rates: a pinned-memory copy
reaches about 80-90% of them in practice, which the time model does not take off (stated where
it is used, ``plan/time_model.py``).

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
from batchfit.options import PrecisionSpec

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
    """Dense bf16 (or fp16, where the card has no bf16) tensor TFLOP/s, for MFU."""
    fp32_tflops: float | None = None
    """Dense fp32 TFLOP/s without tensor cores (what an fp32 PyTorch run gets by default)."""
    supports_bf16: bool = True
    """The card has bf16 tensor cores (V100 and T4 do fp16 only)."""
    supports_fp8: bool = True
    """The card has float8 tensor cores (compute capability 8.9 and up: Ada, Hopper; AMD MI300),
    which ``torch._scaled_mm`` needs: torchtitan refuses float8 below SM89 (``has_cuda_capability(8, 9)``)."""
    bandwidth_gb_per_s: float | None = None
    """Memory bandwidth in GB/s (10**9 bytes)."""
    source: str = "catalog"
    """Where the numbers come from: catalog, user (--gpu-memory) or measured."""
    intra_node_gb_per_s: float | None = None
    """GPU-to-GPU bandwidth within a node, per GPU and per direction, GB/s (10**9 bytes)."""
    intra_node_link: str | None = None
    """What carries it, as the vendor names it (e.g. 'NVLink 4, 900 GB/s bidirectional')."""
    inter_node_gb_per_s: float | None = None
    """Bandwidth between nodes, per GPU and per direction, GB/s."""
    inter_node_link: str | None = None
    """What carries it (e.g. 'InfiniBand NDR 400 Gb/s per GPU, as DGX H100')."""
    host_link_gb_per_s: float | None = None
    """GPU-to-host bandwidth (PCIe), per direction, GB/s: what ``--offload`` moves over."""
    host_link: str | None = None
    """What carries it (e.g. 'PCIe Gen5 x16, 128 GB/s bidirectional')."""

    @property
    def usable_bytes(self) -> int:
        """What the caching allocator can hand out: total minus the context."""
        return self.total_bytes - self.context_bytes

    def peak_tflops(self, precision: str) -> float | None:
        """The dense peak a run at ``precision`` can reach, for MFU; None when unknown.

        fp32 runs use the fp32 (CUDA core) peak; fp16-mixed the fp16 tensor peak; bf16 and
        bf16-mixed the bf16 tensor peak, None on cards without bf16 tensor cores (there bf16
        is emulated, and an MFU against the fp16 peak would flatter it).
        """
        if precision == "fp32":
            return self.fp32_tflops
        if PrecisionSpec.parse(precision).bf16 and not self.supports_bf16:
            return None
        return self.bf16_tflops

    def to_json(self) -> dict:
        return {**asdict(self), "usable_bytes": self.usable_bytes}


# (GB/s per direction, what the vendor calls it): see the module docstring for the sources.
NVLINK4 = (450.0, "NVLink 4, 900 GB/s bidirectional")
NVLINK3 = (300.0, "NVLink 3, 600 GB/s bidirectional")
NVLINK2 = (150.0, "NVLink 2, 300 GB/s bidirectional")
INFINITY_FABRIC = (448.0, "Infinity Fabric, 7 links x 128 GB/s bidirectional")
PCIE5 = (64.0, "PCIe Gen5 x16, 128 GB/s bidirectional")
PCIE4 = (32.0, "PCIe Gen4 x16, 64 GB/s bidirectional")
PCIE3 = (16.0, "PCIe Gen3 x16, 32 GB/s bidirectional")
IB_NDR = (50.0, "InfiniBand NDR 400 Gb/s per GPU (as DGX H100)")
IB_HDR = (25.0, "InfiniBand HDR 200 Gb/s per GPU (as DGX A100)")
NET_100G = (12.5, "100 Gb/s per GPU (assumed: no reference cluster design)")


def _gpu(name, display, mib, tflops, fp32_tflops, bandwidth_gb_per_s, cc_major, bf16=True,
         intra=PCIE4, inter=NET_100G, fp8=True, host=PCIE4) -> Device:
    return Device(
        name=name,
        display_name=display,
        total_bytes=mib * MiB,
        workspace_bytes=cublas_workspace_bytes(cc_major),
        bf16_tflops=tflops,
        fp32_tflops=fp32_tflops,
        supports_bf16=bf16,
        supports_fp8=fp8,
        bandwidth_gb_per_s=bandwidth_gb_per_s,
        intra_node_gb_per_s=intra[0],
        intra_node_link=intra[1],
        inter_node_gb_per_s=inter[0],
        inter_node_link=inter[1],
        host_link_gb_per_s=host[0],
        host_link=host[1],
    )


CATALOG: dict[str, Device] = {
    d.name: d
    for d in [
        _gpu("h100-80gb", "NVIDIA H100 80GB HBM3 (SXM)", 81559, 989.0, 67.0, 3350, 9, intra=NVLINK4,
             inter=IB_NDR, host=PCIE5),
        _gpu("h100-pcie-80gb", "NVIDIA H100 PCIe 80GB", 81559, 756.0, 51.0, 2000, 9, intra=PCIE5, host=PCIE5),
        _gpu("h200-141gb", "NVIDIA H200 141GB HBM3e", 143771, 989.0, 67.0, 4800, 9, intra=NVLINK4,
             inter=IB_NDR, host=PCIE5),
        _gpu("a100-80gb", "NVIDIA A100 80GB", 81920, 312.0, 19.5, 2039, 8, intra=NVLINK3, inter=IB_HDR, fp8=False),
        _gpu("a100-40gb", "NVIDIA A100 40GB", 40960, 312.0, 19.5, 1555, 8, intra=NVLINK3, inter=IB_HDR, fp8=False),
        _gpu("a10g-24gb", "NVIDIA A10G", 23028, 70.0, 31.2, 600, 8, fp8=False),
        _gpu("l4-24gb", "NVIDIA L4", 23034, 121.0, 30.3, 300, 8),
        _gpu("l40s-48gb", "NVIDIA L40S", 46068, 362.0, 91.6, 864, 8),
        _gpu("rtx4090-24gb", "NVIDIA GeForce RTX 4090", 24564, 165.0, 82.6, 1008, 8),
        _gpu("rtx6000ada-48gb", "NVIDIA RTX 6000 Ada Generation", 49140, 364.0, 91.1, 960, 8),
        _gpu("v100-16gb", "NVIDIA Tesla V100 16GB", 16160, 125.0, 15.7, 900, 7, bf16=False, intra=NVLINK2,
             host=PCIE3, fp8=False),
        _gpu("v100-32gb", "NVIDIA Tesla V100 32GB", 32510, 125.0, 15.7, 900, 7, bf16=False, intra=NVLINK2,
             host=PCIE3, fp8=False),
        _gpu("t4-16gb", "NVIDIA Tesla T4", 15360, 65.0, 8.1, 320, 7, bf16=False, intra=PCIE3, host=PCIE3, fp8=False),
        _gpu("mi300x-192gb", "AMD Instinct MI300X", 196592, 1307.0, 163.4, 5300, 9, intra=INFINITY_FABRIC, host=PCIE5),
    ]
}


def _squash(text: str) -> str:
    """The part of a GPU name that identifies it: lower case, no vendor, no separators.
    'NVIDIA H100 80GB', 'h100_80gb' and 'H100-80GB' are all 'h10080gb'."""
    key = re.sub(r"[\s_\-]+", "", text.strip().lower())
    for vendor in ("nvidia", "amd", "geforce", "tesla", "instinct"):
        key = key.removeprefix(vendor)
    return key


def _aliases(name: str) -> set[str]:
    """One rule for every entry: its name, its name without the memory ('t4'), and without
    an 'rtx' prefix ('4090'); all squashed."""
    family = re.sub(r"-\d+gb$", "", name)
    keys = {name, family}
    keys |= {k.removeprefix("rtx") for k in keys if k.startswith("rtx")}
    return {_squash(k) for k in keys}


_BY_ALIAS: dict[str, list[str]] = {}
for _name in CATALOG:
    for _alias in _aliases(_name):
        _BY_ALIAS.setdefault(_alias, []).append(_name)


def _letters(key: str) -> str:
    """The family's letters ('h' for h100, 'v' for v100, 'rtx' for rtx4090), to keep
    suggestions within a family."""
    return re.match(r"[a-z]*", key).group(0)


def get_device(name: str) -> Device:
    """Look a GPU up by catalog name or alias (``t4``, ``rtx4090``, ``4090``, ``H100 80GB``);
    refuse an alias that names several cards; suggest the closest in the same family."""
    key = _squash(name)
    found = _BY_ALIAS.get(key, [])
    if len(found) == 1:
        return CATALOG[found[0]]
    if found:
        raise UnknownGPUError(f"'{name}' is ambiguous: {' or '.join(found)}; give the full name, e.g. `gpu` {found[0]}")
    family = [n for n in CATALOG if _letters(_squash(n)) == _letters(key)] or list(CATALOG)
    by_key = {_squash(n): n for n in family}
    close = [by_key[k] for k in difflib.get_close_matches(key, by_key, n=2, cutoff=0.5)]
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    raise UnknownGPUError(
        f"unknown GPU '{name}': {hint}run `batchfit gpus` for the catalog, "
        "or give the capacity with `gpu_memory` 24GiB"
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


DEFAULT_HOST_LINK_GB_PER_S = 32.0
"""For a GPU given only by its memory: PCIe Gen4 x16, per direction (said as assumed)."""


def host_link_seconds(nbytes: int, device: Device) -> float:
    """One direction's time to move ``nbytes`` over ``device``'s host link (PCIe, per direction,
    the link's signalling rate; PCIe Gen4 x16 when the GPU is known only by its memory):
    ``--offload``'s copies, in bench and plan."""
    if not nbytes:
        return 0.0
    return nbytes / ((device.host_link_gb_per_s or DEFAULT_HOST_LINK_GB_PER_S) * 1e9)


def custom_device(total_bytes: int) -> Device:
    """A GPU known only by its capacity (--gpu-memory); assumes a current NVIDIA card."""
    least = DEFAULT_CONTEXT_BYTES + cublas_workspace_bytes(9)
    if total_bytes <= least:
        raise SizeError(
            f"`gpu_memory` {format_bytes(total_bytes)} leaves no usable memory ({format_bytes(DEFAULT_CONTEXT_BYTES)} "
            "go to the CUDA context, 64 MiB to cuBLAS): give the card's total, e.g. `gpu_memory` 24GiB")
    return Device(name="custom", display_name=f"GPU with {format_bytes(total_bytes)}",
                  total_bytes=total_bytes, source="user")


def detect_cuda_device(index: int = 0) -> Device:
    """The real GPU, as CUDA reports it."""
    import torch

    props = torch.cuda.get_device_properties(index)
    return Device(name="cuda", display_name=props.name, total_bytes=props.total_memory,
                  workspace_bytes=cublas_workspace_bytes(props.major), source="measured",
                  supports_fp8=(props.major, props.minor) >= (8, 9))


def precision_warning(device: Device, precision: str) -> str | None:
    """One line to print when ``precision`` does not suit ``device``; None when it does."""
    spec = PrecisionSpec.parse(precision)
    if spec.fp8_recipe and not device.supports_fp8:
        return (f"{device.name} has no float8 tensor cores (they start with compute capability 8.9: H100, H200, "
                "L4, L40S, RTX 4090/6000 Ada): torch._scaled_mm fails there; use --precision bf16-mixed")
    if spec.bf16 and not device.supports_bf16:
        return (f"{device.name} has no bf16 tensor cores: bf16 runs emulated and slowly there; "
                "use --precision fp16-mixed")
    return None


def format_bytes(n: float) -> str:
    """Binary units, spelled out: 1.50 GiB."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
