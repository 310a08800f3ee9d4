"""What a plan is asked, beside the workload, its StepOptions and the GPU: one typed value.

``plan(workload, request, device=..., options=...)`` reads it; the config layer
(``config/plan.py``) builds it from the flags, a ``--trainer`` file or a torchtitan job, and a
Python caller builds it directly (or passes its fields to ``plan`` as keywords).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from batchfit.search import DEFAULT_MAX_BATCH

if TYPE_CHECKING:  # annotations only: the CLI reads DEFAULT_STRATEGIES without the time model's imports
    from batchfit.plan.time_model import TimeModel
    from batchfit.plan.world import World

DEFAULT_STRATEGIES = "ddp,fsdp"


@dataclasses.dataclass(kw_only=True)
class PlanRequest:
    """The worlds, strategies and batch of a plan, and how its time is computed."""

    worlds: list[World]
    """The GPU counts (and nodes) to plan for, one table row group each (``plan/world.py``)."""
    strategies: str = DEFAULT_STRATEGIES
    """Comma-separated strategy names (``distributed/strategy_name.py``), or ``auto``."""
    global_batch: int | None = None
    """Samples per optimizer step over all GPUs: the micro-batch x accumulation to reach; None: the largest."""
    tokens: str | float | None = None
    """Tokens to train on, for days: a count, ``'chinchilla'`` (20 x parameters) or a string either way."""
    batch_sizes: list[int] | None = None
    """Local batch sizes traced besides the search's."""
    target_util: float = 0.9
    """The fraction of usable memory planned for."""
    multiple_of: int = 1
    """Local batches are multiples of this."""
    max_batch: int = DEFAULT_MAX_BATCH
    """No local batch above this."""
    time_model: TimeModel | None = None
    """The MFU and links behind every computed time; None: the defaults (``TimeModel()``)."""
    processes: int | None = None
    """Strategies traced at once, one process each (None: one per CPU core); 1: one after another."""
    cache: bool = True
    """Read each strategy session's rows from the trace cache where an earlier plan asked the same of it, and
    write them there (``plan/row_cache.py``)."""
    limit: str = "reserved"
    """What must fit: ``reserved`` (the caching allocator model) or ``allocated``."""
    host_memory_bytes: int | None = None
    """Pinned host memory the offloaded bytes of a rank must fit; None: not checked."""
    pp_schedule: str = "1f1b"
    """The pipeline schedule of pp<N> strategies (``distributed/pp_schedules.py``)."""
    microbatches: int = 0
    """Pipeline micro-batches per step of pp<N> strategies; 0: as many as the stages."""
