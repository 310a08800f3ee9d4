"""What ``batchfit recommend`` was asked (RecommendConfig) and the plan it checked before any training
(Plan): below the engine, so the branch jobs and the reader take them without importing the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchfit.errors import OptionError
from batchfit.recommend.result import SWEEP_EVAL_EVERY
from batchfit.runs.budget import LR_SCALINGS, Budget, Schedule


@dataclass(kw_only=True)
class RecommendConfig:
    """One recommendation: the budget, the batch sizes and rates a sweep would try, and how to branch."""

    batch_sizes: list[int]
    tokens: int | None = None
    """The budget in tokens; or give ``samples``."""
    samples: int | None = None
    lrs: list[float] | None = None
    """Peak rates at the smallest batch size; None: the optimizer's own."""
    lr_scaling: str = "sqrt"
    """How a branch at k x the batch scales its rate: sqrt (the paper's rule for Adam), linear, none."""
    branch_points: tuple[float, ...] = (0.1, 0.25)
    """Where the parent branches, as shares of the budget."""
    window: float = 0.04
    """Each branch trains this share of the budget, or more: at least 2 steps of the largest branched
    batch (``layout.py``)."""
    epsilon: float = 0.01
    """Relative loss tolerance: a batch within it of the best (or the smallest batch) loses nothing."""
    seeds: int = 2
    """Data windows at the last branch point (2 or more gives an interval)."""
    cooldown: float = 0.75
    """The last share of each window in which the rate decays linearly to the schedule's final
    rate, so branches are compared as the sweep's runs end: decayed (0: no cooldown)."""
    evals_per_window: int = 1
    """Validation passes per branch: 1, at the window's end, is all the recommendation reads;
    more draw the curves (each pass costs ``eval_samples``, counted in the cost)."""
    warmup: str = "1%"
    min_lr_ratio: float = 0.1
    eval_samples: int = 64
    seed: int = 0
    grad_clip: float | None = 1.0
    max_share: float = 0.2
    """The plan's aim: train at most this share of the sweep's samples (``layout.py`` cuts branch
    points, then the largest batch sizes, to reach it; never more than the sweep)."""

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise OptionError("`batch_sizes` must be positive integers, e.g. 1,2,4,8")
        self.batch_sizes = sorted(set(self.batch_sizes))
        if len(self.batch_sizes) < 2:
            raise OptionError("give at least two `batch_sizes` to compare, e.g. 1,2,4,8,16")
        if (self.tokens is None) == (self.samples is None):
            raise OptionError("give the budget once: `tokens` (e.g. `tokens` 50M) or `samples` (e.g. `samples` 200k)")
        if self.lr_scaling not in LR_SCALINGS:
            raise OptionError(f"unknown `lr_scaling` '{self.lr_scaling}': use sqrt, linear or none")
        if not self.branch_points or not all(0 < p < 1 for p in self.branch_points):
            raise OptionError("`branch_at` takes shares of the budget between 0 and 1, e.g. 10%,25%")
        if not 0 < self.window < 1:
            raise OptionError(f"`window` must be a share of the budget between 0 and 1, e.g. 4%; got {self.window}")
        if self.epsilon <= 0:
            raise OptionError(f"`epsilon` must be above 0, e.g. 0.01; got {self.epsilon}")
        if not 0 <= self.cooldown < 1:
            raise OptionError("`cooldown` must be a share of the window from 0 to below 1, e.g. 75%; got "
                              f"{self.cooldown}")
        if not 0 < self.max_share <= 1:
            raise OptionError(f"`max_share` must be a share of the sweep above 0 and at most 1, e.g. 20%; got "
                              f"{self.max_share}")
        if self.seeds < 1:
            raise OptionError(f"`seeds` must be 1 or more, got {self.seeds}")
        self.branch_points = tuple(sorted(set(self.branch_points)))

    def budget(self, tokens_per_sample: int | None) -> Budget:
        if self.tokens is not None:
            return Budget(unit="tokens", total=self.tokens, tokens_per_sample=tokens_per_sample)
        return Budget(unit="samples", total=self.samples, tokens_per_sample=tokens_per_sample)


@dataclass(kw_only=True)
class Plan:
    """The validated recommendation: positions in samples, rates, micro-batches."""

    config: RecommendConfig
    budget: Budget
    schedule: Schedule
    total_samples: int
    points: list[int]
    """Branch points, in samples consumed by the parent (multiples of the smallest batch)."""
    window_samples: int
    lrs: dict[int, list[float]]
    micro_batches: dict[int, int]
    fits: int | None
    branched: list[int]
    """The batch sizes that get a branch (``layout.py``): the smallest ones, all of them in most plans."""
    seeds: int
    """Data windows at the last point (``config.seeds``; 1 in a sweep)."""
    cooldown: float
    """``config.cooldown``; 0 in a sweep (its runs end on the schedule's own decay)."""
    mode: str = "branch"
    """branch, or sweep: every batch size on the whole budget, where branching cannot cost less."""
    notes: list[str] = field(default_factory=list)

    @property
    def windows(self) -> int:
        """Data windows branched: one per point, ``seeds`` at the last."""
        return len(self.points) + self.seeds - 1

    @property
    def cost_samples(self) -> int:
        """Trained: the parent to its last point, and every branch's window."""
        branches = sum(len(self.lrs[b]) for b in self.branched)
        return self.points[-1] + self.windows * branches * self.window_samples

    @property
    def val_samples(self) -> int:
        """Validated (forward only, the fixed set of ``eval_samples``): the parent at its start and
        at each point; each branch at each of its evaluations (``evals_per_window``, fewer when a
        large batch's steps hold two)."""
        config, W = self.config, self.window_samples
        evals = 1 + len(self.points)
        for b in self.branched:
            aligned = {W * (i + 1) // config.evals_per_window // b * b for i in range(config.evals_per_window)}
            evals += self.windows * len(self.lrs[b]) * len([e for e in aligned if e > 0])
        return evals * config.eval_samples

    def sweep_val_samples(self, eval_every: float = SWEEP_EVAL_EVERY) -> int:
        """What the sweep it replaces validates (``sweep_validated``)."""
        rates = len(next(iter(self.lrs.values())))
        return sweep_validated(self.budget, self.config.batch_sizes, rates, self.config.eval_samples, eval_every)


def sweep_validated(budget: Budget, batch_sizes: list[int], rates: int, eval_samples: int,
                    eval_every: float = SWEEP_EVAL_EVERY) -> int:
    """Samples the sweep validates, by the sweep's rule (``sweep/run.py``): at step 0, and after
    each step that crosses a multiple of ``eval_every`` of the budget or ends the run."""
    every, u = max(1, round(eval_every * budget.total)), budget.per_sample
    evals = 0
    for b in batch_sizes:
        steps = budget.total // u // b
        crossed = sum(1 for s in range(1, steps + 1)
                      if (s * b * u) // every > ((s - 1) * b * u) // every or s == steps)
        evals += (1 + crossed) * rates
    return evals * eval_samples
