"""What ``batchfit recommend`` found: one answer with its interval, and the evidence per source.

No torch here: the report (``batchfit.report``) and the CLI read it."""

from __future__ import annotations

from dataclasses import dataclass, field

SWEEP_EVAL_EVERY = 0.1
"""``batchfit sweep``'s default --eval-every (10%): how the sweep a recommendation is compared
with validates (its validated tokens count in ``sweep_equivalent``)."""

NOISE_BIAS = ("the gradient noise scale B_simple (McCandlish et al. 2018) is known to underestimate the critical "
              "batch size under Adam, by up to orders of magnitude (Merrill et al. 2025): shown, not used")


@dataclass(kw_only=True)
class RecommendResult:
    workload: str
    description: str
    unit: str
    """'tokens' or 'samples': the unit of budget, cost, positions."""
    budget: int
    batch_sizes: list[int]
    lr_scaling: str
    epsilon: float
    recommended_batch_size: int
    """Measured (branched training, extrapolated): the lowest extrapolated validation loss."""
    interval: tuple[int, int]
    lr: float
    choice_rule: str = ""
    """How the answer was picked from the evidence, in words (its interval: what the evidence cannot separate)."""
    critical_batch_size: int
    """Measured: the largest batch within epsilon of the smallest at the last branch point."""
    critical_by_point: dict[int, int]
    extrapolated: dict[int, float]
    """Per batch size, the extrapolated validation loss at the budget (mean over data windows)."""
    branches: list[dict]
    curves: list[dict]
    parent: dict
    cost: int
    """In the budget's unit: trained (the parent to its last branch point, every branch) plus
    validated (forward passes over the fixed validation set, counted alike)."""
    sweep_equivalent: int
    """A sweep of the same batch sizes and rates at the same budget, in the same unit, counted
    by the same rule: trained plus validated (at batchfit sweep's default --eval-every)."""
    cost_val: int = 0
    """The validated part of ``cost``."""
    sweep_val: int = 0
    """The validated part of ``sweep_equivalent``."""
    params: int
    priors: list[dict]
    window: int
    cooldown: float = 0.0
    """The share of each window that decays the rate to the schedule's final one."""
    points: list[int]
    seeds: int
    notes: list[str] = field(default_factory=list)
    mode: str = "branch"
    """branch, or sweep: branching could not cost less than the sweep, so the sweep ran (``layout.py``)."""
    branched: list[int] = field(default_factory=list)
    """The batch sizes measured (all of them unless the plan left the largest out)."""
    noise: dict | None = None
    noise_cost: int = 0
    seconds: float = 0.0

    @property
    def total_cost(self) -> int:
        return self.cost + self.noise_cost

    @property
    def cost_share(self) -> float:
        return self.total_cost / self.sweep_equivalent

    def evidence(self) -> list[dict]:
        """One row per source: what it says, and what kind of figure it is."""
        rows = [{"source": "branched training, extrapolated to the budget", "batch_size": self.recommended_batch_size,
                 "lr": self.lr, "kind": "measured",
                 "note": f"interval {self.interval[0]}-{self.interval[1]} over {self.seeds} data window(s)"},
                {"source": "critical batch size (branches within epsilon of the smallest batch)",
                 "batch_size": self.critical_batch_size, "lr": None, "kind": "measured",
                 "note": ", ".join(f"{b} at {p:,}" for p, b in self.critical_by_point.items())}]
        if self.noise is not None:
            rows.append({"source": "gradient noise scale B_simple", "batch_size": self.noise.get("b_simple"),
                         "lr": None, "kind": "measured (biased)", "note": NOISE_BIAS})
        for prior in self.priors:
            rows.append({"source": prior["source"], "batch_size": prior["batch_size"], "lr": prior["lr"],
                         "kind": "prior (formula)", "note": "; ".join(prior["notes"])})
        return rows

    def to_json(self) -> dict:
        tokens = self.unit == "tokens"
        return {
            "workload": self.workload, "description": self.description, "unit": self.unit, "budget": self.budget,
            "batch_sizes": self.batch_sizes, "recommended_batch_size": self.recommended_batch_size,
            "recommended_interval": list(self.interval), "choice_rule": self.choice_rule,
            "critical_batch_size": self.critical_batch_size,
            "critical_batch_size_by_point": {str(k): v for k, v in self.critical_by_point.items()},
            "lr": self.lr, "lr_scaling": self.lr_scaling, "epsilon": self.epsilon,
            "cost_tokens" if tokens else "cost_samples": self.total_cost,
            "sweep_tokens_equivalent" if tokens else "sweep_samples_equivalent": self.sweep_equivalent,
            "cost_share_of_sweep": self.cost_share, "noise_cost": self.noise_cost,
            ("cost_val_tokens" if tokens else "cost_val_samples"): self.cost_val,
            ("sweep_val_tokens" if tokens else "sweep_val_samples"): self.sweep_val,
            "params": self.params, "branch_points": self.points, "window": self.window,
            "cooldown": self.cooldown, "seeds": self.seeds, "mode": self.mode, "branched": self.branched,
            "sources": {"branched": {"recommended_batch_size": self.recommended_batch_size,
                                     "interval": list(self.interval), "lr": self.lr,
                                     "critical_batch_size": self.critical_batch_size,
                                     "extrapolated_val_loss": {str(b): v for b, v in self.extrapolated.items()},
                                     "kind": "measured"},
                        "noise": ({**self.noise, "bias": NOISE_BIAS} if self.noise else None),
                        "priors": self.priors},
            "evidence": self.evidence(), "branches": self.branches, "curves": self.curves, "parent": self.parent,
            "notes": self.notes, "seconds": self.seconds}
