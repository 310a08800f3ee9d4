"""``batchfit sweep``: which batch size trains best for a budget, measured.

1. Check everything the user typed (budget exact at every batch size, executor, store) and
   refuse bad input before the store is opened, so a refused command changes nothing.
2. Load the data and tokenize it (cached), or use the workload's own batches.
3. Size the micro-batch per batch size for the GPU with ``batchfit.estimate`` (traced): a
   batch that does not fit runs accumulated instead of crashing.
4. Plan one run per (batch size, learning rate); skip runs that are done; hand the rest to
   the executor; every run writes to the store.
5. Read the store back into a :class:`SweepResult`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from batchfit.devices import Device
from batchfit.errors import OptionError, UsageError
from batchfit.runs.budget import LR_SCALINGS, Budget, Schedule, micro_batch_for, parse_amount, scaled_lr
from batchfit.runs.data import BatchSource, TokenData, lm_format, tokenize
from batchfit.runs.executors import WorkerContext, check_executor, run_in_process, run_local, run_ray
from batchfit.runs.store import Store, check_store
from batchfit.sweep.result import SweepResult, read_result
from batchfit.sweep.run import RunSpec
from batchfit.workload import PRECISIONS, Workload


@dataclass(kw_only=True)
class SweepConfig:
    """One sweep: what to train, on what, for how long, with which batch sizes and rates."""

    model: str
    """The MODEL spec (zoo name, hf:..., file.py:fn): worker processes rebuild it from this."""
    batch_sizes: list[int]
    tokens: int | None = None
    """The budget in tokens (every run consumes exactly this); or give ``samples``."""
    samples: int | None = None
    data: str | None = None
    """A text file, a folder of .txt/.jsonl/.parquet, or a datasets name; None: the workload's batches."""
    tokenizer: str = "bpe"
    """bpe (trained on the train split at the model's vocabulary size), bytes, or a cached name."""
    val_fraction: float = 0.01
    seq_len: int | None = None
    lrs: list[float] | None = None
    """Peak learning rates at ``lr_ref_batch``; None: the workload optimizer's own rate."""
    lr_scaling: str = "none"
    lr_ref_batch: int | None = None
    """The batch size the ``lrs`` are right for (default: the smallest batch size)."""
    warmup: str = "1%"
    """Warmup in the budget's unit ('2M') or as a fraction ('1%', '0.01')."""
    min_lr_ratio: float = 0.1
    eval_every: str = "10%"
    eval_samples: int = 64
    checkpoint_every: str | None = None
    """Default: at every evaluation."""
    seed: int = 0
    grad_clip: float | None = 1.0
    precision: str = "fp32"
    store: Path = Path("sweep.db")
    resume: bool = False
    executor: str = "local"
    workers: int = 1
    ray_address: str | None = None
    cache_dir: Path | None = None
    device: str | None = None
    """Where runs train: 'cpu', 'cuda' or 'cuda:N'; default the GPU here, else the CPU."""
    require_data: bool = False
    """Refuse a language model without --data (the CLI sets it for zoo and hf: models)."""

    def __post_init__(self) -> None:
        self.store = Path(self.store)
        if self.resume and not self.store.exists():  # a typo'd store name started a new sweep
            raise OptionError(f"`resume`: `store` {self.store} does not exist, so there is nothing to resume: give "
                              "the store of the sweep to finish, or drop `resume` to start a new one")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise OptionError("`batch_sizes` must be positive integers, e.g. 1,2,4,8")
        self.batch_sizes = sorted(set(self.batch_sizes))
        if (self.tokens is None) == (self.samples is None):
            raise OptionError("give the budget once: `tokens` (e.g. `tokens` 50M) or `samples` (e.g. `samples` 200k)")
        if self.lr_scaling not in LR_SCALINGS:
            raise OptionError(f"unknown `lr_scaling` '{self.lr_scaling}': use none, linear or sqrt")
        if self.lr_ref_batch is not None and self.lr_ref_batch < 1:
            raise OptionError(f"`lr_ref_batch` must be 1 or more, got {self.lr_ref_batch}")
        if self.eval_samples < 1:
            raise OptionError(f"`eval_samples` must be 1 or more, got {self.eval_samples}")
        if self.precision not in PRECISIONS:
            raise OptionError(f"unknown precision '{self.precision}': use one of {', '.join(PRECISIONS)}")
        if self.grad_clip is not None and not (self.grad_clip >= 0 and math.isfinite(self.grad_clip)):
            raise OptionError("`grad_clip` must be 0 (no clipping) or more, e.g. `grad_clip` 1.0; got "
                              f"{self.grad_clip}")
        if self.grad_clip == 0:
            self.grad_clip = None
        check_executor(self.executor, self.workers)

    def budget(self, tokens_per_sample: int | None) -> Budget:
        if self.tokens is not None:
            return Budget(unit="tokens", total=self.tokens, tokens_per_sample=tokens_per_sample)
        return Budget(unit="samples", total=self.samples, tokens_per_sample=tokens_per_sample)

    def identity(self, data_key: str | None, data_kind: str) -> dict:
        """What decides a run's numbers: a store made with any other is refused."""
        return {"model": self.model, "seq_len": self.seq_len, "data": data_key or data_kind,
                "tokenizer": self.tokenizer if self.data else None,
                "val_fraction": self.val_fraction if self.data else None, "tokens": self.tokens,
                "samples": self.samples, "warmup": self.warmup, "min_lr_ratio": self.min_lr_ratio,
                "eval_every": self.eval_every, "eval_samples": self.eval_samples, "seed": self.seed,
                "grad_clip": self.grad_clip, "precision": self.precision, "lr_scaling": self.lr_scaling,
                "lr_ref_batch": self.lr_ref_batch}

    def to_json(self) -> dict:
        data = asdict(self)
        data["store"] = str(self.store)
        data["cache_dir"] = str(self.cache_dir) if self.cache_dir else None
        return data


@dataclass
class Plan:
    """The validated sweep: budget, schedule, runs to do, and what data they read."""

    config: SweepConfig
    workload: Workload
    budget: Budget
    schedule: Schedule
    eval_every: int
    checkpoint_every: int
    steps: dict[int, int]
    lrs: dict[int, list[float]]
    micro_batches: dict[int, int]
    fits: int | None
    """The largest batch that fits the GPU (traced), or None with no GPU to fit."""
    tokens: TokenData | None
    data_kind: str
    identity: dict
    notes: list[str] = field(default_factory=list)


def default_lr(workload: Workload) -> float:
    """The rate the workload's optimizer is built with."""
    with torch.device("meta"):
        params = [torch.nn.Parameter(torch.empty(1))]
    return float(workload.build_optimizer(params).param_groups[0]["lr"])


def plan_sweep(config: SweepConfig, workload: Workload, *, largest_fitting: Callable[[int], int] | None = None,
               fit_device: Device | None = None, progress: Callable[[str], None] | None = None) -> Plan:
    """Validate and plan, touching nothing on disk but the token cache; raises UsageError.

    ``largest_fitting(max_batch)`` is the largest batch that fits ``fit_device`` (the caller's:
    ``batchfit sweep`` passes the estimator's traced answer; an engine never calls another),
    asked only once everything else has been checked."""
    say = progress or (lambda message: None)
    if config.data is None and config.require_data and lm_format(workload) is not None:
        raise UsageError(f"{workload.name} is a language model: give `data` (a text file, a folder of "
                         ".txt/.jsonl/.parquet, or a datasets name), e.g. `data` stories.txt; random tokens "
                         "teach it nothing")
    budget = config.budget(workload.tokens_per_sample)
    steps = budget.check(config.batch_sizes)
    schedule = Schedule(total=budget.total, warmup=parse_amount(config.warmup, budget.total, "`warmup`"),
                        min_lr_ratio=config.min_lr_ratio)
    eval_every = parse_amount(config.eval_every, budget.total, "`eval_every`")
    checkpoint_every = parse_amount(config.checkpoint_every or config.eval_every, budget.total, "`checkpoint_every`")
    if eval_every < 1 or checkpoint_every < 1:
        raise OptionError("`eval_every` and `checkpoint_every` must be more than 0, e.g. 10%")
    ref = config.lr_ref_batch or min(config.batch_sizes)
    base = config.lrs or [default_lr(workload)]
    lrs = {b: [scaled_lr(lr, b, config.lr_scaling, ref) for lr in base] for b in config.batch_sizes}
    tokens, kind = None, "synthetic"
    if config.data is not None:
        fmt = lm_format(workload)
        if fmt is None:
            raise UsageError(f"`data` gives text, but {workload.name} is not a token language model: drop `data`")
        tokens = tokenize(config.data, tokenizer=config.tokenizer, vocab_size=fmt.vocab_size,
                          val_fraction=config.val_fraction, cache_dir=config.cache_dir, progress=say)
        budget.check_data((len(tokens.train) - 1) // fmt.seq_len, fmt.seq_len)  # as recommend: before the store
        BatchSource(workload, seed=config.seed, tokens=tokens)  # its refusals (a split shorter than a sample), too
        kind = "text"
    elif workload.train_batches is not None:
        kind = "workload"
    identity = config.identity(tokens.key if tokens else None, kind)
    check_store(config.store, identity, resume=config.resume)
    fits = None
    if largest_fitting is not None and fit_device is not None:
        say(f"sizing the micro-batch for {fit_device.display_name} (traced)")
        fits = largest_fitting(max(config.batch_sizes))
    micro = {b: micro_batch_for(b, fits) for b in config.batch_sizes}
    notes = [f"batch {b} runs as {b // m} accumulated micro-batches of {m} (largest that fits: {fits})"
             for b, m in micro.items() if m and m < b]
    notes += [f"batch {b}: not even one sample fits "
              f"{fit_device.display_name} (traced)" for b, m in micro.items() if not m]
    if kind == "synthetic":
        notes.append("no --data: batches come from the workload's make_batch (synthetic data); validation "
                     "batches are drawn with a fixed seed")
    return Plan(config=config, workload=workload, budget=budget, schedule=schedule, eval_every=eval_every,
                checkpoint_every=checkpoint_every, steps=steps, lrs=lrs, micro_batches=micro, fits=fits,
                tokens=tokens, data_kind=kind, identity=identity, notes=notes)


def train_device(config: SweepConfig) -> str:
    if config.device:
        return config.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def run_sweep(plan: Plan, progress: Callable[[str], None] | None = None) -> SweepResult:
    """Run every run of ``plan`` that is not done yet; read the store back."""
    say = progress or (lambda message: None)
    config = plan.config
    started = time.perf_counter()
    with Store(config.store) as store:
        store.set_config(plan.identity, {"budget": plan.budget.to_json(), "data_kind": plan.data_kind,
                                         "data_info": plan.tokens.to_json() if plan.tokens else None,
                                         "notes": plan.notes, "fits": plan.fits,
                                         "schedule": plan.schedule.to_json(), "workload": plan.workload.name,
                                         "description": plan.workload.description})
        stale = store.reclaim_stale()
        if stale:
            say(f"{len(stale)} run(s) left running by a sweep that stopped are pending again")
        specs = []
        eval_batch = min([m for m in plan.micro_batches.values() if m] or [1])
        for b in config.batch_sizes:
            for lr in plan.lrs[b]:
                run_id = store.add_run(b, lr, plan.steps[b])
                if store.run(run_id)["status"] == "done":
                    continue  # runs that are done are never repeated
                specs.append(RunSpec(run_id=run_id, batch_size=b, lr=lr, micro_batch=plan.micro_batches[b],
                                     budget=plan.budget, schedule=plan.schedule, seed=config.seed,
                                     eval_every=plan.eval_every, checkpoint_every=plan.checkpoint_every,
                                     eval_samples=config.eval_samples, eval_batch=eval_batch,
                                     grad_clip=config.grad_clip,
                                     precision=config.precision))
    checkpoints = config.store.with_name(config.store.name + ".checkpoints")
    context = WorkerContext(model=config.model, seq_len=config.seq_len,
                            token_cache=str(plan.tokens.folder) if plan.tokens else None, seed=config.seed,
                            eval_samples=config.eval_samples, store=str(config.store), checkpoints=str(checkpoints),
                            device=train_device(config))
    if not specs:
        say("every run is done already")
    elif config.executor == "ray":
        run_ray(context, specs, config.workers, config.ray_address, say)
    elif config.workers > 1:
        run_local(context, specs, config.workers, say)
    else:
        run_in_process(plan.workload, plan.tokens, context, specs, say)
    return read_result(config.store, seconds=time.perf_counter() - started)
