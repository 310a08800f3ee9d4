"""Reading the answer off the parent and its branches: the critical batch size, the
extrapolation to the budget, the recommendation with its interval, and what it cost."""

from __future__ import annotations

import numpy as np
import torch

from batchfit.recommend.branch import Curve
from batchfit.recommend.config import Plan
from batchfit.recommend.jobs import cooldown_from
from batchfit.recommend.priors import priors
from batchfit.recommend.result import SWEEP_EVAL_EVERY, RecommendResult
from batchfit.workload import Workload


def power_exponent(val: list[tuple[int, float]]) -> float:
    """p in loss = a x position^p (a power law: a straight line in log-log), least squares over
    the points; 0 with one point, or with a loss that is not positive (no power law then)."""
    if len(val) < 2 or min(loss for _, loss in val) <= 0:
        return 0.0
    p, _ = np.polyfit(np.log([x for x, _ in val]), np.log([loss for _, loss in val]), 1)
    return float(p)


def extrapolate(val: list[tuple[int, float]], end: int, exponent: float, position: int | None = None) -> float:
    """The window's last validation loss carried to ``end`` along the power law's ``exponent``,
    from ``position`` (what the model has trained on; default the last point's position): one
    factor for every branch, so the ranking at the window's end is kept, and a positive loss
    stays positive."""
    at, loss = val[-1]
    return loss * (end / (position or at)) ** exponent


def _shared_slope(plan: Plan, parent: Curve, branches: list[dict]) -> float:
    """The exponent every branch is carried along: the parent's power law over its validation
    losses at the branch points (a baseline of the whole stretch between them, at the schedule's
    own rate); with one branch point, the smallest batch's first window before its cooldown."""
    at_points = [(p, v) for p, v in parent.val if p > 0]
    if len(at_points) >= 2:
        return power_exponent(at_points)
    first = next(e["curve"] for e in branches if e["seed"] == 0 and e["curve"].batch_size == plan.branched[0])
    edge = cooldown_from(first.start_samples, plan.window_samples, plan.cooldown)
    return power_exponent([v for v in first.val if edge is None or v[0] <= edge])


def _best_per_batch(rows: list[dict], key: str) -> dict[int, dict]:
    best: dict[int, dict] = {}
    for row in rows:
        b = row["batch_size"]
        if b not in best or row[key] < best[b][key]:
            best[b] = row
    return dict(sorted(best.items()))


def read_recommendation(plan: Plan, workload: Workload, parent: Curve, branches: list[dict],
                        seconds: float) -> RecommendResult:
    config, per_sample, eps = plan.config, plan.budget.per_sample, plan.config.epsilon
    end, W = plan.total_samples, plan.window_samples
    slope = _shared_slope(plan, parent, branches)
    rows = []
    for entry in branches:
        c: Curve = entry["curve"]
        trained = entry["point"] + W  # a later data window starts from the same state: W trained since the point
        rows.append({"point": entry["point"] * per_sample, "seed": entry["seed"], "batch_size": c.batch_size,
                     "lr": c.lr, "window_val": c.val[-1][1], "exponent": slope,
                     "extrapolated_val": extrapolate(c.val, end, slope, trained)})
    critical: dict[int, int] = {}
    for point in plan.points:
        at = _best_per_batch([r for r in rows if r["point"] == point * per_sample and r["seed"] == 0], "window_val")
        small = at[plan.branched[0]]["window_val"]
        critical[point * per_sample] = max(b for b, r in at.items() if r["window_val"] <= small + eps * abs(small))
    last = plan.points[-1] * per_sample
    per_seed = []
    interval: set[int] = set()
    for seed in range(plan.seeds):
        best = _best_per_batch([r for r in rows if r["point"] == last and r["seed"] == seed], "extrapolated_val")
        low = min(r["extrapolated_val"] for r in best.values())
        per_seed.append(best)
        interval |= {b for b, r in best.items() if r["extrapolated_val"] <= low + eps * abs(low)}
    mean = {b: float(np.mean([s[b]["extrapolated_val"] for s in per_seed])) for b in plan.branched}
    choice = min(mean, key=mean.get)
    lrs = [s[choice]["lr"] for s in per_seed]
    lr = max(set(lrs), key=lrs.count)
    n_lrs = len(plan.lrs[config.batch_sizes[0]])
    params, non_embedding = _parameter_counts(workload)
    notes = list(plan.notes)
    low_b, high_b = min(interval), max(interval)
    if plan.mode == "sweep":
        rule = "the lowest final validation loss of the runs (the sweep's own answer)"
    else:
        rule = ("the lowest extrapolated validation loss, averaged over the data windows; the interval is every batch "
                "size within epsilon of the best in some data window: the branches cannot tell them apart")
        notes.append("the interval covers the spread between data windows, not the bias of short windows from one "
                     "parent's state (docs/training-runs.md: the full sweep's runs differ from the start; on a "
                     "fixed-rate benchmark the sweep's best, 2, lay outside the interval 1-1)")
        notes.append("a full sweep is one draw too: on batchfit's benchmarks its best batch moved 2-4x between seeds "
                     "on 2 of 6 setups (docs/accuracy.md), so one sweep checks an answer only to about 2x")
    if high_b == plan.branched[-1] and plan.branched != config.batch_sizes:
        notes.append(f"the interval reaches {high_b}, the largest batch branched: the larger ones, not measured, may "
                     "be as good")
    if high_b > 4 * low_b:
        notes.append(f"the interval {low_b}-{high_b} spans more than 4x: the evidence cannot place the best batch "
                     "within 2x of the answer")
    if plan.seeds < 2 and plan.mode == "branch":
        notes.append("one data window (--seeds 1): the interval is only the batches within epsilon of the best")
    notes.append(f"cost counts trained and validated {plan.budget.unit} alike (a validation pass is forward only): "
                 f"{plan.cost_samples * per_sample:,} trained + {plan.val_samples * per_sample:,} validated; the sweep "
                 f"it is compared with validates at batchfit sweep's default --eval-every "
                 f"{SWEEP_EVAL_EVERY:.0%} ({plan.sweep_val_samples() * per_sample:,})")
    return RecommendResult(
        workload=workload.name, description=workload.description, unit=plan.budget.unit, budget=plan.budget.total,
        batch_sizes=config.batch_sizes, lr_scaling=config.lr_scaling, epsilon=config.epsilon,
        recommended_batch_size=choice, interval=(low_b, high_b), choice_rule=rule, lr=lr,
        critical_batch_size=critical[last], critical_by_point=critical, extrapolated=mean,
        branches=rows, curves=[{**e["curve"].to_json(per_sample), "point": e["point"] * per_sample,
                                "seed": e["seed"]} for e in branches],
        parent=parent.to_json(per_sample), cost=(plan.cost_samples + plan.val_samples) * per_sample,
        cost_val=plan.val_samples * per_sample,
        sweep_equivalent=plan.budget.total * len(config.batch_sizes) * n_lrs + plan.sweep_val_samples() * per_sample,
        sweep_val=plan.sweep_val_samples() * per_sample, params=params,
        priors=[p.to_json() for p in priors(params, plan.budget.total if plan.budget.unit == "tokens" else None,
                                             workload.tokens_per_sample, non_embedding_params=non_embedding,
                                             batch_size=choice, lr=lr)],
        window=plan.window_samples * per_sample, cooldown=plan.cooldown,
        points=[p * per_sample for p in plan.points], seeds=plan.seeds, mode=plan.mode, branched=plan.branched,
        notes=notes, seconds=seconds)


def _parameter_counts(workload: Workload) -> tuple[int, int]:
    """The model's parameters, all and without the embeddings (Step Law's N), built on the meta
    device (no memory)."""
    with torch.device("meta"):
        model = workload.build_model()
    embedding = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    params = list(model.parameters())  # shared (tied) weights once
    total = sum(p.numel() for p in params)
    return total, total - sum(p.numel() for p in params if id(p) in embedding)
