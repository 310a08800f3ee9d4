"""What an estimate is asked, beside the workload, its StepOptions and the GPU: two typed values.

``estimate(workload, request, device=..., options=...)`` reads an :class:`EstimateRequest`;
``estimate_run`` also a :class:`RunRequest` (the data a run steps through). The config layer
(``config/estimate.py``) builds both from the flags and a ``--trainer`` file; a Python caller
builds them directly, or passes an EstimateRequest's fields to ``estimate`` as keywords
(as ``plan`` takes ``plan/request.py``'s PlanRequest).
"""

from __future__ import annotations

import dataclasses

from batchfit.estimator.batching import Batching
from batchfit.search import DEFAULT_MAX_BATCH, check_estimate_options


@dataclasses.dataclass(kw_only=True, frozen=True)
class EstimateRequest:
    """The batch search of an estimate: the sizes traced, the limits, the global batch and the eval loop."""

    batch_sizes: list[int] | None = None
    """Batch sizes traced besides the search's."""
    target_util: float = 0.9
    """The fraction of usable memory the second answer (``max_batch_size_at_target``) is sized for."""
    multiple_of: int = 1
    """Batches are multiples of this (and of the workload's own group)."""
    max_batch: int = DEFAULT_MAX_BATCH
    """No batch above this."""
    limit: str = "reserved"
    """What must fit: ``reserved`` (the caching allocator model) or ``allocated``."""
    host_memory_bytes: int | None = None
    """Pinned host memory the offloaded bytes must fit; None: not checked (still reported)."""
    global_batch: int | None = None
    """Samples per optimizer step: also the micro-batch and accumulation steps that make it on one GPU."""
    eval_batch_size: int | None = None
    """HF Trainer's eval loop traced at this batch after the answer's training step; None: no eval loop."""
    eval_held_steps: int = 1
    """Eval steps whose logits stay on the GPU together (``eval_accumulation_steps``)."""
    suggest: bool = True
    """When nothing fits: trace what would make the smallest batch fit."""
    cache: bool = True
    """Reuse the traces of an earlier call in the trace cache (``trace/cache.py``) and write this call's there."""

    def check(self) -> None:
        """Every value in range, before anything is traced (the CLI: before torch loads)."""
        check_estimate_options(target_util=self.target_util, multiple_of=self.multiple_of,
                               batch_sizes=self.batch_sizes, max_batch=self.max_batch, limit=self.limit)


@dataclasses.dataclass(kw_only=True, frozen=True)
class RunRequest:
    """The data a run steps through (``--data``): each traced batch size's run over it (``estimator/run.py``)."""

    data: str
    """The data's name, as the outputs say it (a file, a folder, or a description of made-up lengths)."""
    batching: Batching
    """How the samples become rows (``--batching``)."""
    seq_len: int | None = None
    """The tokenizer's max_length: every sample cut to it before batching; None: not cut."""
    replay_steps: int = 0
    """The answer's first K steps replayed through the allocator model (fragmentation); 0: none."""
    replay_order: str = "data"
    """``data`` (the data's order) or ``worst`` (also the orders that fragment most)."""
