"""What a bench is asked, beside the workload, its StepOptions and the target: one typed value.

``bench(workload, request, target=..., options=...)`` reads it; the config layer
(``config/bench.py``) builds it from the flags and a ``--trainer`` file, and a Python caller
builds it directly or passes its fields to ``bench`` as keywords.
"""

from __future__ import annotations

import dataclasses

from batchfit.errors import OptionError


@dataclasses.dataclass(kw_only=True, frozen=True)
class BenchRequest:
    """The batch sizes benched, the timed and burn-in steps, and the leak check."""

    batch_sizes: list[int]
    """Micro-batches benched, each a row (a step runs ``accumulation_steps`` of them)."""
    steps: int = 10
    """Timed steps per batch size."""
    warmup: int = 3
    """Burn-in steps before timing."""
    leak_check_steps: int | None = None
    """Steps watched for growing allocated memory at the smallest batch that ran; None: no leak check."""

    def check(self) -> None:
        """Every value in range, before anything runs (the CLI: before torch loads)."""
        if self.steps < 1 or self.warmup < 0:
            raise OptionError("`steps` must be 1 or more and `warmup` 0 or more, e.g. `steps` 10 `warmup` 3")
