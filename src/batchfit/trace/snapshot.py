"""What a traced step measured, as plain numbers: the records the trace cache keeps.

Defined apart from the tracer (``trace/memory.py``, ``trace/session.py``), which import torch, so
that reading a cached trace back (``trace/cache.py``) imports no torch: a question asked again
answers without loading it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Snapshot:
    """The peak of one traced step."""

    peak_bytes: int
    phase: str
    breakdown: dict[str, int]
    top: list[dict] = field(default_factory=list)
    peak_by_phase: dict[str, int] = field(default_factory=dict)
    breakdown_by_phase: dict[str, dict[str, int]] = field(default_factory=dict)
    """The breakdown at each phase's own peak."""
    peak_by_part: dict[str, int] = field(default_factory=dict)
    """Each phase's peak in the parts that its run over the main stack of blocks cuts it into,
    keyed 'phase:part' (:data:`PARTS`): what a deep model's extrapolation needs (trace/depth.py)."""
    breakdown_by_part: dict[str, dict[str, int]] = field(default_factory=dict)
    host_peak_bytes: int = 0
    """The most host bytes the step held at once for offloading (pinned, rounded as PyTorch's
    host allocator rounds on CUDA); 0 without --offload."""
    host_reserved_bytes: int = 0
    """What the pinned host allocator holds after the step: it caches every block it made."""
    total_peak_bytes: int = 0
    """The most device + host bytes alive at once (what one CPU's memory holds: the CPU truth)."""
    offloaded_bytes: int = 0
    """Bytes the step made on the host (unrounded): the device-to-host copies of --offload."""


@dataclass
class TracePoint:
    batch_size: int
    snapshot: Snapshot
    paged_bytes: int = 0
    """Paged optimizer state (bitsandbytes' paged optimizers: CUDA unified memory), not in the peak."""
