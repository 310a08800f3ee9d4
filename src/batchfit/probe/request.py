"""What a probe is asked, beside the workload, its StepOptions and the target: one typed value.

``find_max_batch(workload, request, target=..., options=...)`` reads it; the config layer
(``config/probe.py``) builds it from the flags and a ``--trainer`` file, and a Python caller
builds it directly or passes its fields to ``find_max_batch`` as keywords (as ``plan`` takes
``plan/request.py``'s PlanRequest).
"""

from __future__ import annotations

import dataclasses

from batchfit.search import DEFAULT_MAX_BATCH, check_probe_options


@dataclasses.dataclass(kw_only=True, frozen=True)
class ProbeRequest:
    """The search of a probe: its policy and bounds, the steps per probe, the tiers and the global batch."""

    policy: str = "guided"
    """The search policy (``search.POLICIES``)."""
    multiple_of: int = 1
    """Batches are multiples of this (and of the workload's own group)."""
    smallest: int = 1
    """The smallest batch probed (``min``)."""
    largest: int | None = None
    """The largest batch probed (``max``); None: ``search.DEFAULT_MAX_BATCH``, refused on a bare cpu target."""
    steps: int = 2
    """Training steps per probe (at least 2: the second has optimizer state)."""
    isolate: bool = False
    """Each probe in a fresh process, the workload rebuilt from ``spec``."""
    spec: str | None = None
    """The MODEL spec the workload came from (``isolate`` needs it)."""
    seq_len: int | None = None
    """The sequence length ``spec`` is loaded at in an isolated probe; None: the model's."""
    stop_on_nan: bool = False
    """A NaN or infinite loss is an error that stops the search."""
    target_util: float = 0.9
    """The production tier's share of usable memory."""
    global_batch: int | None = None
    """Samples per optimizer step: also the micro-batch and accumulation steps that reach it."""
    verify_tiers: bool = False
    """Probe every recommended tier (default: predicted from the measured line, one extra probe)."""
    limit: str = "reserved"
    """What must fit on a virtual device: ``reserved`` (the caching allocator model) or ``allocated``."""
    strategy: str | None = None
    """Under torchrun, how each rank wraps the model (``distributed/wrap.py``); None: ddp there."""

    @property
    def cap(self) -> int:
        """The largest batch the search may reach."""
        return DEFAULT_MAX_BATCH if self.largest is None else self.largest

    def check(self) -> None:
        """Every value in range, before anything runs (the CLI: before torch loads)."""
        check_probe_options(policy=self.policy, multiple_of=self.multiple_of, smallest=self.smallest,
                            largest=self.cap, steps=self.steps, target_util=self.target_util,
                            global_batch=self.global_batch, limit=self.limit)
