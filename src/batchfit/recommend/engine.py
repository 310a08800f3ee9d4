"""``batchfit recommend``: which batch size trains best for a budget, without the whole sweep.

1. Check everything before any training: the budget exact at every batch size, branch points
   and a window that hold whole steps at every batch size, data long enough for the budget,
   and (with a GPU to fit) a micro-batch of at least 1 at every batch size.
2. Train one parent run at the smallest batch size, on the sweep's schedule (warmup and
   cosine in tokens over the whole budget), up to the last branch point.
3. At each branch point, branch every (batch size, learning rate) for a window of tokens
   (``branch.py``); at the last one, repeat the branches on ``seeds`` - 1 further windows of
   data (the same state, the data position moved on by whole windows) for an interval.
4. Critical batch size (Merrill et al. 2025): the largest batch whose validation loss at the
   end of the window is within ``epsilon`` (relative) of the smallest batch's.
5. Short-horizon extrapolation: the smallest batch's branch at the last point gives a slope c
   (validation loss = a + c ln(tokens), least squares over its window), and every branch's
   window-end validation loss is carried to the budget along it. The recommended batch (and
   its rate) has the lowest extrapolated loss, averaged over the data windows; its interval is
   every batch within ``epsilon`` of the best in any window. Stated, simple: one shared slope
   keeps the window's ranking (the gaps between batch sizes are assumed to stay as they are at
   the window's end), and the cosine decay's late drop is left out (the same for every batch).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from batchfit.errors import OptionError, UsageError
from batchfit.recommend.branch import Curve, Trainer
from batchfit.recommend.priors import priors
from batchfit.recommend.result import RecommendResult
from batchfit.recommend.store import BranchStore
from batchfit.train.budget import LR_SCALINGS, Budget, Schedule, micro_batch_for, parse_amount, scaled_lr
from batchfit.train.data import BatchSource, TokenData, lm_format
from batchfit.workload import StepOptions, Workload


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
    """Each branch trains this share of the budget."""
    epsilon: float = 0.01
    """Relative loss tolerance: a batch within it of the best (or the smallest batch) loses nothing."""
    seeds: int = 2
    """Data windows at the last branch point (2 or more gives an interval)."""
    evals_per_window: int = 4
    warmup: str = "1%"
    min_lr_ratio: float = 0.1
    eval_samples: int = 64
    seed: int = 0
    grad_clip: float | None = 1.0

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise OptionError("--batch-sizes must be positive integers, e.g. 1,2,4,8")
        self.batch_sizes = sorted(set(self.batch_sizes))
        if len(self.batch_sizes) < 2:
            raise OptionError("give at least two --batch-sizes to compare, e.g. 1,2,4,8,16")
        if (self.tokens is None) == (self.samples is None):
            raise OptionError("give the budget once: --tokens (e.g. --tokens 50M) or --samples (e.g. --samples 200k)")
        if self.lr_scaling not in LR_SCALINGS:
            raise OptionError(f"unknown --lr-scaling '{self.lr_scaling}': use sqrt, linear or none")
        if not self.branch_points or not all(0 < p < 1 for p in self.branch_points):
            raise OptionError("--branch-at takes shares of the budget between 0 and 1, e.g. 10%,25%")
        if not 0 < self.window < 1:
            raise OptionError(f"--window must be a share of the budget between 0 and 1, e.g. 4%; got {self.window}")
        if self.epsilon <= 0:
            raise OptionError(f"--epsilon must be above 0, e.g. 0.01; got {self.epsilon}")
        if self.seeds < 1:
            raise OptionError(f"--seeds must be 1 or more, got {self.seeds}")
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
    notes: list[str] = field(default_factory=list)

    @property
    def cost_samples(self) -> int:
        branches = sum(len(v) for v in self.lrs.values())
        windows = len(self.points) + self.config.seeds - 1
        return self.points[-1] + windows * branches * self.window_samples


def default_lr(workload: Workload) -> float:
    with torch.device("meta"):
        params = [torch.nn.Parameter(torch.empty(1))]
    return float(workload.build_optimizer(params).param_groups[0]["lr"])


def plan_recommend(config: RecommendConfig, workload: Workload, tokens: TokenData | None = None, *,
                   largest_fitting: Callable[[int], int] | None = None, fit_device_name: str = "the GPU"
                   ) -> Plan:
    """Validate and plan; raises UsageError before any training. ``largest_fitting(max_batch)``
    is the largest batch that fits (the caller's traced answer: an engine never calls another)."""
    budget = config.budget(workload.tokens_per_sample)
    budget.check(config.batch_sizes)
    per_sample = budget.per_sample
    total = budget.total // per_sample
    b0, b_max = config.batch_sizes[0], config.batch_sizes[-1]
    step_all = math.lcm(*config.batch_sizes)
    window = int(config.window * total) // step_all * step_all
    if window < 2 * b_max:
        need = math.ceil(2 * step_all / config.window) * per_sample
        raise UsageError(f"budget too small to branch: a window of {config.window:.0%} of {budget.total:,} "
                         f"{budget.unit} holds {window * per_sample:,}, fewer than 2 steps at batch {b_max}; "
                         f"raise --{budget.unit} to at least {need:,}, widen --window, or drop the largest batch sizes")
    points = sorted({max(b0, round(p * total / b0) * b0) for p in config.branch_points})
    last_end = points[-1] + config.seeds * window
    if last_end > total:
        raise UsageError(f"the last branch point ({config.branch_points[-1]:.0%}) plus {config.seeds} window(s) of "
                         f"{config.window:.0%} runs past the budget: branch earlier or use a smaller --window")
    if tokens is not None:
        fmt = lm_format(workload)
        available = (len(tokens.train) - 1) // fmt.seq_len
        if available < total:
            raise UsageError(f"data too short for the budget: the train split holds {available:,} samples of "
                             f"{fmt.seq_len} tokens, the budget needs {total:,} ({budget.total:,} {budget.unit}) "
                             "without repeating data; give more text or a smaller budget")
    fits = largest_fitting(b_max) if largest_fitting is not None else None
    if fits is not None and fits < 1:
        raise UsageError(f"batch sizes {', '.join(map(str, config.batch_sizes))} cannot fit {fit_device_name} even "
                         "at micro-batch 1 (traced): use a larger GPU, --precision bf16-mixed, or checkpointing")
    micro = {b: micro_batch_for(b, fits) for b in config.batch_sizes}
    base = config.lrs or [default_lr(workload)]
    lrs = {b: [scaled_lr(lr, b, config.lr_scaling, b0) for lr in base] for b in config.batch_sizes}
    warmup = parse_amount(config.warmup, budget.total, "--warmup")
    schedule = Schedule(total=budget.total, warmup=warmup, min_lr_ratio=config.min_lr_ratio)
    notes = [f"batch {b} runs as {b // m} accumulated micro-batches of {m} (largest that fits: {fits}, traced)"
             for b, m in micro.items() if m < b]
    return Plan(config=config, budget=budget, schedule=schedule, total_samples=total, points=points,
                window_samples=window, lrs=lrs, micro_batches=micro, fits=fits, notes=notes)


def identity(plan: Plan, workload: Workload, tokens: TokenData | None) -> dict:
    """What decides a recommendation's numbers: a store made with anything else is refused."""
    from dataclasses import asdict

    return {**asdict(plan.config), "branch_points": list(plan.config.branch_points), "workload": workload.name,
            "data": tokens.key if tokens is not None else None, "lrs_per_batch": {str(b): v for b, v in plan.lrs.items()},
            "micro_batches": {str(b): m for b, m in plan.micro_batches.items()}}


def _evaluator(workload: Workload, source: BatchSource, micro: int, device: torch.device, autocast
               ) -> Callable[[torch.nn.Module], float]:
    def evaluate(model: torch.nn.Module) -> float:
        model.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for size, batch in source.validation(micro, device):
                with autocast():
                    total += workload.loss_fn(model, batch).item() * size
                count += size
        model.train()
        return total / count
    return evaluate


def log_slope(val: list[tuple[int, float]]) -> float:
    """c in loss = a + c ln(position), least squares over the points (0 with one point)."""
    if len(val) < 2:
        return 0.0
    c, _ = np.polyfit(np.log([p for p, _ in val]), [loss for _, loss in val], 1)
    return float(c)


def extrapolate(val: list[tuple[int, float]], end: int, slope: float) -> float:
    """The window's last validation loss carried to ``end`` along ``slope`` (per ln position)."""
    position, loss = val[-1]
    return loss + slope * math.log(end / position)


def run_recommend(plan: Plan, workload: Workload, source: BatchSource, *, device: torch.device | None = None,
                  progress: Callable[[str], None] | None = None,
                  stop: Callable[[], None] | None = None, store: BranchStore | None = None) -> RecommendResult:
    """Train the parent and its branches; read the answer off them. With ``store``, every
    branch point and finished branch is saved there, and a run that finds them resumes."""
    say = progress or (lambda message: None)
    started = time.perf_counter()
    device = device or torch.device("cpu")
    config, per_sample = plan.config, plan.budget.per_sample
    b0 = config.batch_sizes[0]
    torch.manual_seed(config.seed)
    step = _training_step(workload, device)
    evaluate = _evaluator(workload, source, min(plan.micro_batches.values()), device, step.forward_autocast)
    trainer = Trainer(step, source, plan.schedule, per_sample=per_sample, grad_clip=config.grad_clip,
                      evaluate=evaluate)
    step.model.train()
    W = plan.window_samples
    branches: list[dict] = []
    resumed = store.last_point() if store is not None else None
    if resumed is not None:
        first, snap, parent = resumed
        trainer.restore(snap)
        position = snap.samples
        say(f"resuming at branch point {first + 1} of {len(plan.points)} ({position * per_sample:,} {plan.budget.unit})")
    else:
        first, snap = 0, None
        parent = Curve(batch_size=b0, lr=plan.lrs[b0][0], start_samples=0)
        parent.val.append((0, evaluate(step.model)))
        position = 0
    for n, point in enumerate(plan.points):
        if n < first:  # done before the run stopped: every branch of it is in the store
            for seed in range(config.seeds if n == len(plan.points) - 1 else 1):
                branches += [{"point": point, "seed": seed, "curve": store.branch(point, seed, b, lr)}
                             for b in config.batch_sizes for lr in plan.lrs[b]]
            continue
        if snap is None or n > first:
            say(f"parent at batch {b0}: training to {point * per_sample:,} {plan.budget.unit}")
            position = trainer.train(parent, start=position, samples=point - position,
                                     micro=plan.micro_batches[b0], eval_at={point}, stop=stop)
            snap = trainer.snapshot(position)
            if store is not None:
                store.save_point(n, snap, parent)
        last = n == len(plan.points) - 1
        for seed in range(config.seeds if last else 1):
            start = point + seed * W
            evals = {start + W * (i + 1) // config.evals_per_window for i in range(config.evals_per_window)}
            for b in config.batch_sizes:
                for lr in plan.lrs[b]:
                    curve = store.branch(point, seed, b, lr) if store is not None else None
                    if curve is None:
                        trainer.restore(snap)
                        curve = Curve(batch_size=b, lr=lr, start_samples=start)
                        aligned = {start + (e - start) // b * b for e in evals}
                        trainer.train(curve, start=start, samples=W, micro=plan.micro_batches[b], eval_at=aligned,
                                      stop=stop)
                        if store is not None:
                            store.save_branch(point, seed, curve)
                    branches.append({"point": point, "seed": seed, "curve": curve})
                    say(f"branch at {point * per_sample:,}, window {seed}: batch {b}, lr {lr:.3g}: "
                        f"val {curve.val[-1][1]:.4f}")
        trainer.restore(snap)
    return _read(plan, workload, parent, branches, time.perf_counter() - started)


def _training_step(workload: Workload, device: torch.device):
    from batchfit.train.step import TrainingStep

    return TrainingStep(workload, StepOptions(), device)


def _best_per_batch(rows: list[dict], key: str) -> dict[int, dict]:
    best: dict[int, dict] = {}
    for row in rows:
        b = row["batch_size"]
        if b not in best or row[key] < best[b][key]:
            best[b] = row
    return dict(sorted(best.items()))


def _read(plan: Plan, workload: Workload, parent: Curve, branches: list[dict], seconds: float) -> RecommendResult:
    config, per_sample, eps = plan.config, plan.budget.per_sample, plan.config.epsilon
    end = plan.total_samples
    b0 = config.batch_sizes[0]
    slopes = {(e["point"], e["seed"]): log_slope(e["curve"].val) for e in branches
              if e["curve"].batch_size == b0 and e["curve"].lr == plan.lrs[b0][0]}
    rows = []
    for entry in branches:
        c: Curve = entry["curve"]
        slope = slopes[(entry["point"], entry["seed"])]
        rows.append({"point": entry["point"] * per_sample, "seed": entry["seed"], "batch_size": c.batch_size,
                     "lr": c.lr, "window_val": c.val[-1][1], "slope": slope,
                     "extrapolated_val": extrapolate(c.val, end, slope)})
    critical: dict[int, int] = {}
    for point in plan.points:
        at = _best_per_batch([r for r in rows if r["point"] == point * per_sample and r["seed"] == 0], "window_val")
        small = at[config.batch_sizes[0]]["window_val"]
        critical[point * per_sample] = max(b for b, r in at.items() if r["window_val"] <= small + eps * abs(small))
    last = plan.points[-1] * per_sample
    per_seed = []
    interval: set[int] = set()
    for seed in range(config.seeds):
        best = _best_per_batch([r for r in rows if r["point"] == last and r["seed"] == seed], "extrapolated_val")
        low = min(r["extrapolated_val"] for r in best.values())
        per_seed.append(best)
        interval |= {b for b, r in best.items() if r["extrapolated_val"] <= low + eps * abs(low)}
    mean = {b: float(np.mean([s[b]["extrapolated_val"] for s in per_seed])) for b in config.batch_sizes}
    choice = min(mean, key=mean.get)
    lrs = [s[choice]["lr"] for s in per_seed]
    lr = max(set(lrs), key=lrs.count)
    n_lrs = len(plan.lrs[config.batch_sizes[0]])
    params = sum(p.numel() for p in _parameters(workload))
    notes = list(plan.notes)
    if config.seeds < 2:
        notes.append("one data window (--seeds 1): the interval is only the batches within epsilon of the best")
    notes.append("validation passes (forward only, on the fixed validation set) are not counted in cost_tokens")
    return RecommendResult(
        workload=workload.name, description=workload.description, unit=plan.budget.unit, budget=plan.budget.total,
        batch_sizes=config.batch_sizes, lr_scaling=config.lr_scaling, epsilon=config.epsilon,
        recommended_batch_size=choice, interval=(min(interval), max(interval)), lr=lr,
        critical_batch_size=critical[last], critical_by_point=critical, extrapolated=mean,
        branches=rows, curves=[{**e["curve"].to_json(per_sample), "point": e["point"] * per_sample,
                                "seed": e["seed"]} for e in branches],
        parent=parent.to_json(per_sample), cost=plan.cost_samples * per_sample,
        sweep_equivalent=plan.budget.total * len(config.batch_sizes) * n_lrs, params=params,
        priors=[p.to_json() for p in priors(params, plan.budget.total if plan.budget.unit == "tokens" else None,
                                             workload.tokens_per_sample)],
        window=plan.window_samples * per_sample, points=[p * per_sample for p in plan.points], seeds=config.seeds,
        notes=notes, seconds=seconds)


def _parameters(workload: Workload):
    """The model's parameters, built on the meta device (no memory), for the priors' N."""
    with torch.device("meta"):
        return list(workload.build_model().parameters())
