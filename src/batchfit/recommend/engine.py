"""``batchfit recommend``: which batch size trains best for a budget, without the whole sweep.

1. Check everything before any training: the budget exact at every batch size, data long
   enough for the budget, and (with a GPU to fit) a micro-batch of at least 1 at every batch
   size. Fit the plan to the budget and grid (``layout.py``): a window of whole steps at every
   branched batch size, branch points that leave room for it, the largest batch sizes left out
   where their window costs too much, and the sweep itself where no branch plan costs less.
2. Train one parent run at the smallest batch size, on the sweep's schedule (warmup and
   cosine in tokens over the whole budget), up to the last branch point, its exact state saved
   at each point (``jobs.py``).
3. At each branch point, branch every (batch size, learning rate) for a window of tokens
   (``branch.py``); at the last one, repeat the branches on ``seeds`` - 1 further windows of
   data (the same state, the data position moved on by whole windows) for an interval. Every
   branch is a job of the executors (``runs/executors.py``: here, local processes or Ray)
   and a row of the runs store (``runs/store.py``), so a killed recommendation resumes.
   Each window ends with a cooldown: over its last ``cooldown`` share the rate decays linearly
   to the schedule's final rate. The sweep compares runs after their decay; at peak rate a
   larger batch's smaller gradient noise shows as a loss advantage that the decay takes away
   (seed 002's shape at a fixed rate, ``benchmarks/recommend_cpu.py``: the sweep's best is 2;
   the windows pick 8 without a cooldown, 4 with 50% of the window cooled, 2 with 75% or 90%).
4. Critical batch size (Merrill et al. 2025): the largest batch whose validation loss at the
   end of the window is within ``epsilon`` (relative) of the smallest batch's.
5. Short-horizon extrapolation (``read.py``): one power law (validation loss = a tokens^p,
   least squares in log-log over the parent's validation losses at the branch points), and
   every branch's window-end validation loss carried to the budget along it from what it has
   trained on. The recommended batch (and its rate) has the lowest extrapolated loss, averaged
   over the data windows; its interval is every batch within ``epsilon`` of the best in any
   window. Stated, simple: one shared slope keeps the window's ranking (the gaps between batch
   sizes are assumed to stay as they are at the window's end, cooled).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from batchfit.errors import BatchfitError, UsageError
from batchfit.recommend.branch import Curve, Trainer, evaluator  # noqa: F401 - evaluator: the tests' name
from batchfit.recommend.config import Plan, RecommendConfig, sweep_validated
from batchfit.recommend.jobs import (
    BranchSpec,
    branch_name,
    cooldown_from,
    last_point,
    load_point,
    point_path,
    read_branch,
    save_point,
)
from batchfit.recommend.layout import lay_out
from batchfit.recommend.read import read_recommendation
from batchfit.recommend.result import RecommendResult
from batchfit.runs.budget import Schedule, micro_batch_for, parse_amount, scaled_lr
from batchfit.runs.data import BatchSource, TokenData, lm_format
from batchfit.train.oom import NonFiniteLoss
from batchfit.workload import StepOptions, Workload


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
    b0 = config.batch_sizes[0]
    rates = len(config.lrs or [None])
    layout = lay_out(total, config.batch_sizes, point_shares=config.branch_points, window_share=config.window,
                     seeds=config.seeds, rates=rates, max_share=config.max_share, eval_samples=config.eval_samples,
                     sweep_validated=sweep_validated(budget, config.batch_sizes, rates, config.eval_samples))
    if tokens is not None:
        fmt = lm_format(workload)
        budget.check_data((len(tokens.train) - 1) // fmt.seq_len, fmt.seq_len)
    fits = largest_fitting(config.batch_sizes[-1]) if largest_fitting is not None else None
    if fits is not None and fits < 1:
        raise UsageError(f"batch sizes {', '.join(map(str, config.batch_sizes))} cannot fit {fit_device_name} even "
                         "at micro-batch 1 (traced): use a larger GPU, `precision` bf16-mixed, or checkpointing")
    micro = {b: micro_batch_for(b, fits) for b in config.batch_sizes}
    base = config.lrs or [default_lr(workload)]
    lrs = {b: [scaled_lr(lr, b, config.lr_scaling, b0) for lr in base] for b in config.batch_sizes}
    warmup = parse_amount(config.warmup, budget.total, "`warmup`")
    schedule = Schedule(total=budget.total, warmup=warmup, min_lr_ratio=config.min_lr_ratio)
    notes = [f"batch {b} runs as {b // m} accumulated micro-batches of {m} (largest that fits: {fits}, traced)"
             for b, m in micro.items() if m < b]
    return Plan(config=config, budget=budget, schedule=schedule, total_samples=total, points=list(layout.points),
                window_samples=layout.window, lrs=lrs, micro_batches=micro, fits=fits,
                branched=list(layout.batch_sizes), seeds=layout.seeds, mode=layout.mode,
                cooldown=config.cooldown if layout.mode == "branch" else 0.0,
                notes=[*layout.notes, *notes])


def identity(plan: Plan, workload: Workload, tokens: TokenData | None) -> dict:
    """What decides a recommendation's numbers: a store made with anything else is refused."""
    from dataclasses import asdict

    return {**asdict(plan.config), "branch_points": list(plan.config.branch_points), "workload": workload.name,
            "data": tokens.key if tokens is not None else None,
            "lrs_per_batch": {str(b): v for b, v in plan.lrs.items()},
            "micro_batches": {str(b): m for b, m in plan.micro_batches.items()}}


def run_recommend(plan: Plan, workload: Workload, tokens: TokenData | None, *, device: torch.device | None = None,
                  progress: Callable[[str], None] | None = None, store: Path | str | None = None,
                  executor: str = "local", workers: int = 1, ray_address: str | None = None,
                  model: str | None = None) -> RecommendResult:
    """Train the parent to every branch point (its state saved at each), then every branch as a
    job of the executors (``runs/executors.py``: this process, ``workers`` local processes, or
    Ray), into the runs store at ``store`` (a temporary one if None). A run that finds the store
    and the points' files of the same recommendation resumes: the parent from its last saved
    point, and only the branches not done. ``model`` is the MODEL spec workers rebuild the
    workload from (needed with worker processes or Ray)."""
    import tempfile

    from batchfit.runs.executors import WorkerContext, check_executor, run_in_process, run_local, run_ray
    from batchfit.runs.store import Store, check_store

    check_executor(executor, workers)
    if (executor == "ray" or workers > 1) and model is None:
        raise UsageError("branches in worker processes or on Ray rebuild the model from its MODEL spec: pass model=")
    say = progress or (lambda message: None)
    started = time.perf_counter()
    device = device or torch.device("cpu")
    with tempfile.TemporaryDirectory(prefix="batchfit-recommend-") as tmp:
        path = Path(store) if store is not None else Path(tmp) / "recommend.db"
        checkpoints = path.with_name(path.name + ".checkpoints")
        ident = identity(plan, workload, tokens)
        check_store(path, ident, resume=True)
        parent = _train_parent(plan, workload, tokens, device, checkpoints, say)
        config, W = plan.config, plan.window_samples
        keys, specs = [], []
        with Store(path) as db:
            db.set_config(ident, {"kind": "recommend", "workload": workload.name})
            stale = db.reclaim_stale()
            if stale:
                say(f"{len(stale)} branch(es) left running by a recommendation that stopped are pending again")
            for n, point in enumerate(plan.points):
                for seed in range(plan.seeds if n == len(plan.points) - 1 else 1):
                    start = point + seed * W
                    evals = {start + W * (i + 1) // config.evals_per_window for i in range(config.evals_per_window)}
                    for b in plan.branched:
                        for lr in plan.lrs[b]:
                            run_id = db.add_run(b, lr, W // b, branch=branch_name(point, seed))
                            keys.append((point, seed, start, run_id))
                            if db.run(run_id)["status"] == "done":
                                continue
                            specs.append(BranchSpec(
                                run_id=run_id, batch_size=b, lr=lr, micro_batch=plan.micro_batches[b], point=point,
                                start=start, window=W, eval_at=tuple(sorted({start + (e - start) // b * b
                                                                             for e in evals})),
                                cooldown_from=cooldown_from(start, W, plan.cooldown),
                                snapshot=str(point_path(checkpoints, n)), schedule=plan.schedule,
                                per_sample=plan.budget.per_sample, tokens_per_sample=plan.budget.tokens_per_sample,
                                seed=config.seed, eval_batch=eval_batch(plan), grad_clip=config.grad_clip))
        context = WorkerContext(model=model or "", seq_len=workload.tokens_per_sample,
                                token_cache=str(tokens.folder) if tokens is not None else None, seed=config.seed,
                                eval_samples=config.eval_samples, store=str(path), checkpoints=str(checkpoints),
                                device=str(device))
        if not specs:
            say("every branch is done already")
        elif executor == "ray":
            run_ray(context, specs, workers, ray_address, say)
        elif workers > 1:
            run_local(context, specs, workers, say)
        else:
            run_in_process(workload, tokens, context, specs, say)
        with Store(path) as db:
            failed = [r for r in db.runs() if r["branch"] and r["status"] != "done"]
            if failed:
                raise UsageError(f"{len(failed)} branch(es) did not finish, e.g. batch {failed[0]['batch_size']}: "
                                 f"{failed[0]['status']} ({failed[0]['error']}); run the same command again to resume")
            branches = [{"point": point, "seed": seed, "curve": read_branch(db, run_id, start)}
                        for point, seed, start, run_id in keys]
    return read_recommendation(plan, workload, parent, branches, time.perf_counter() - started)


def eval_batch(plan: Plan) -> int:
    """Validation in pieces of the smallest micro-batch, the same for the parent and every branch."""
    return min(plan.micro_batches.values())


def _train_parent(plan: Plan, workload: Workload, tokens: TokenData | None, device: torch.device,
                  checkpoints: Path, say: Callable[[str], None]) -> Curve:
    """The parent at the smallest batch, to every branch point, its state saved at each; from
    the last saved point when there is one. Returns its curve."""
    config, per_sample = plan.config, plan.budget.per_sample
    b0 = config.batch_sizes[0]
    saved = last_point(checkpoints, len(plan.points))
    if saved == len(plan.points) - 1:
        return load_point(point_path(checkpoints, saved))[1]
    source = BatchSource(workload, seed=config.seed, tokens=tokens, eval_samples=config.eval_samples)
    torch.manual_seed(config.seed)
    step = _training_step(workload, device)
    trainer = Trainer(step, source, plan.schedule, per_sample=per_sample, grad_clip=config.grad_clip,
                      evaluate=evaluator(workload, source, eval_batch(plan), device, step.forward_autocast))
    step.model.train()
    if saved is not None:
        snap, parent = load_point(point_path(checkpoints, saved), device)
        trainer.restore(snap)
        position = snap.samples
        say(f"resuming the parent at branch point {saved + 1} of {len(plan.points)}")
    else:
        parent = Curve(batch_size=b0, lr=plan.lrs[b0][0], start_samples=0)
        parent.val.append((0, trainer.evaluate(step.model)))
        position = 0
    for n, point in enumerate(plan.points):
        if saved is not None and n <= saved:
            continue
        if point > 0:  # a sweep's runs start from the initial state: no parent to train
            say(f"parent at batch {b0}: training to {point * per_sample:,} {plan.budget.unit}")
        try:
            position = trainer.train(parent, start=position, samples=point - position, micro=plan.micro_batches[b0],
                                     eval_at={point})
        except NonFiniteLoss as error:  # no branch can start from it: the whole recommendation stops
            raise BatchfitError(f"the parent run at batch {b0}: {error}") from None
        save_point(checkpoints, n, trainer.snapshot(position), parent)
    return parent


def _training_step(workload: Workload, device: torch.device):
    from batchfit.train.step import TrainingStep

    return TrainingStep(workload, StepOptions(), device)
