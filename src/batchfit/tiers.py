"""Memory tiers: the largest benched batch under each fraction of usable memory.

Pure Python, no torch: the bench computes tiers from its rows and the report names every
tier, including the ones no benched size reaches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TIERS: tuple[tuple[str, float], ...] = (("maximum", 1.0), ("aggressive", 0.95), ("default", 0.85),
                                        ("conservative", 0.70))
"""(name, fraction of usable memory) of each tier, from the largest."""


@dataclass
class Tier:
    name: str
    util: float
    batch_size: int
    headroom_bytes: int
    tokens_per_s: float | None
    samples_per_s: float | None


def tiers(rows: list, capacity: int) -> list[Tier]:
    """Per tier, the largest benched batch whose reserved (else allocated) peak fits under it."""
    out = []
    for name, util in TIERS:
        fitting = [r for r in rows if r.status == "ok" and (r.peak_reserved_bytes or r.peak_allocated_bytes or math.inf)
                   <= util * capacity]
        if fitting:
            best = max(fitting, key=lambda r: r.batch_size)
            used = best.peak_reserved_bytes or best.peak_allocated_bytes
            out.append(Tier(name, util, best.batch_size, capacity - used, best.tokens_per_s, best.samples_per_s))
    return out
