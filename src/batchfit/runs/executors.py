"""Where runs execute: this process, local worker processes, or Ray tasks.

Shared by the engines that train many runs (``batchfit sweep``'s runs, ``batchfit
recommend``'s branches): a run is a *job*, a picklable spec with the fields below and a
``train(workload, source, store, checkpoints, device, progress)`` method that trains it into
the store and returns its row (``sweep/run.py: RunSpec``, ``recommend/jobs.py: BranchSpec``).
Every executor trains through the same function, :func:`guarded_run`, and every run ends up in
the same SQLite store (``runs/store.py``); the executors differ only in who calls it. A worker process (or Ray
task) rebuilds the workload from its MODEL spec and reads the tokens from the on-disk cache,
so nothing unpicklable crosses a process boundary. Ray is imported only inside
:func:`run_ray`: it is an optional extra (``pip install 'batchfit[ray]'``).

The driver (the ``batchfit sweep`` process) claims each run in the store just before it
starts it (two sweeps on one store never train the same run), hands it a free device
(:class:`DevicePool`), and says when it starts and ends. Local workers write to the store
file themselves (one machine: SQLite's locking works); a Ray task, which may run on another
machine, trains into a store of its own in a temporary folder and returns the run, which the
driver writes back (SQLite's WAL does not work on a network filesystem). Ctrl-C stops the
workers (they ignore SIGINT, so they print no traceback; the driver ends them), gives the
runs they were training back as pending (``--resume`` continues them from their
checkpoints), and leaves runs not started pending.

A run that fails is recorded and the sweep goes on: out of memory (``batchfit.train.oom``) is
retried with half the micro-batch from the run's last checkpoint (the gradient is the
same, accumulated), and is recorded as ``oom`` only when one sample does not fit; any other
error is recorded as ``error`` with its type, message and the line that raised it.
"""

from __future__ import annotations

import gc
import os
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Protocol

import torch

from batchfit.errors import OptionError
from batchfit.runs.budget import micro_batch_for, time_left
from batchfit.runs.data import BatchSource, TokenData, open_tokens
from batchfit.runs.store import Store, owner_id
from batchfit.train.oom import classify, describe
from batchfit.workload import Workload


class RunSpec(Protocol):
    """A job: what every executor needs of it (``sweep/run.py: RunSpec``, ``recommend/jobs.py:
    BranchSpec``). Frozen dataclasses, so that ``replace(spec, micro_batch=...)`` retries one."""

    run_id: int
    batch_size: int
    lr: float
    micro_batch: int

    @property
    def steps(self) -> int: ...

    @property
    def accumulation_steps(self) -> int: ...

    def train(self, workload: Workload, source: BatchSource, store: Store, checkpoints: Path, device: torch.device,
              progress: Callable[[str], None] | None = None) -> dict: ...

EXECUTORS: tuple[str, ...] = ("local", "ray")
PROGRESS_EVERY_S = 30.0
"""How often a pool of workers says how far its runs are (they report to the store, not to it)."""


@dataclass(frozen=True, kw_only=True)
class WorkerContext:
    """What a worker needs besides its RunSpec (picklable)."""

    model: str
    seq_len: int | None
    token_cache: str | None
    """The folder of the tokenized data (``TokenData.folder``), or None without --data."""
    seed: int
    eval_samples: int
    store: str
    checkpoints: str
    device: str
    """'cpu', 'cuda', or 'cuda:N': where this run trains (the local executor gives each run a
    free device of its pool; a Ray task's 'cuda' is the GPU Ray gave it)."""
    threads: int | None = None


def check_executor(executor: str, workers: int) -> None:
    if executor not in EXECUTORS:
        raise OptionError(f"unknown `executor` '{executor}': use local (worker processes here) or ray")
    if workers < 1:
        raise OptionError(f"`workers` must be 1 or more, got {workers}")
    if executor == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise OptionError("`executor` ray needs Ray: pip install 'batchfit[ray]'") from None


def guarded_run(workload: Workload, source: BatchSource, spec: RunSpec, store: Store, checkpoints: Path,
                device: torch.device, progress: Callable[[str], None] | None = None) -> dict:
    """``spec.train``, recording failures instead of raising them."""
    while True:
        if spec.micro_batch < 1:
            store.update_run(spec.run_id, status="oom", micro_batch=0,
                             error="one sample does not fit the GPU (estimated): nothing ran")
            return store.run(spec.run_id)
        failure = None
        try:
            return spec.train(workload, source, store, checkpoints, device, progress)
        except Exception as error:  # recorded, and the sweep goes on
            failure = (classify(error), describe(error), _where(error))
        # Out of the except block: the failed step's tensors (held by the traceback) are gone.
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        kind, message, where = failure
        if kind == "oom" and spec.micro_batch > 1:
            smaller = micro_batch_for(spec.batch_size, spec.micro_batch // 2)
            store.update_run(spec.run_id, note=f"out of memory at micro-batch {spec.micro_batch}; "
                                              f"retried at {smaller}")
            spec = replace(spec, micro_batch=smaller)
            continue
        store.update_run(spec.run_id, status=kind, error=f"{message} ({where})" if where else message,
                         finished=time.time())
        return store.run(spec.run_id)


def _where(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""



def execute(context: WorkerContext, spec: RunSpec) -> dict:
    """One run in a worker process: rebuild the workload and data, train, record in the store."""
    with Store(context.store) as store:
        return _train_into(context, spec, store, Path(context.checkpoints))


def _train_into(context: WorkerContext, spec: RunSpec, store: Store, checkpoints: Path) -> dict:
    from batchfit.specs import load_workload

    if context.threads:
        torch.set_num_threads(context.threads)
    device = torch.device(context.device)
    if device.type == "cuda":
        torch.cuda.set_device(device if device.index is not None else torch.device("cuda", 0))
    workload = load_workload(context.model, seq_len=context.seq_len)
    tokens = open_tokens(Path(context.token_cache)) if context.token_cache else None
    source = BatchSource(workload, seed=context.seed, tokens=tokens, eval_samples=context.eval_samples)
    return guarded_run(workload, source, spec, store, checkpoints, device)


def execute_remote(context: WorkerContext, spec: RunSpec) -> dict:
    """One run in a Ray task, maybe on another machine: train into a store (and checkpoints) of
    the task's own, in a temporary folder there, and return the run's row and curve for the
    driver to write back. A run interrupted here starts again from its beginning on --resume."""
    with tempfile.TemporaryDirectory(prefix="batchfit-run-") as folder:
        with Store(Path(folder) / "run.db") as store:
            store.db.execute("INSERT INTO runs (id, batch_size, lr, status, steps) VALUES (?, ?, ?, 'running', ?)",
                             (spec.run_id, spec.batch_size, spec.lr, spec.steps))
            row = _train_into(context, spec, store, Path(folder) / "checkpoints")
            return {"row": row, "points": store.points(spec.run_id)}


def _ignore_sigint() -> None:
    """Worker processes: Ctrl-C in a terminal reaches the whole process group; the driver
    decides what stops (and ends the workers), so a worker prints no traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def local_devices(device: str, gpu_count: int | None = None) -> list[str]:
    """The devices the local executor hands out: 'cuda' means every GPU here (``gpu_count``,
    default torch's count), cuda:0 .. cuda:N-1; any other device is the one device."""
    if device == "cuda":
        count = torch.cuda.device_count() if gpu_count is None else gpu_count
        return [f"cuda:{i}" for i in range(max(1, count))]
    return [device]


class DevicePool:
    """Free devices for runs: a run takes the device that runs the fewest runs now (a free one
    whenever there is one; the first listed on a tie) and gives it back when it ends. With more
    workers than devices, the extra runs share the least busy device."""

    def __init__(self, devices: list[str]) -> None:
        if not devices:
            raise ValueError("a device pool needs at least one device")
        self.busy = {device: 0 for device in devices}

    def take(self) -> str:
        device = min(self.busy, key=lambda d: self.busy[d])
        self.busy[device] += 1
        return device

    def give(self, device: str) -> None:
        self.busy[device] -= 1


def _describe_run(spec: RunSpec) -> str:
    return (f"batch {spec.batch_size}, lr {spec.lr:g}, {spec.steps:,} steps"
            + (f" as {spec.accumulation_steps} x {spec.micro_batch}" if spec.accumulation_steps > 1 else ""))


def _ended(row: dict, seconds: float) -> str:
    if row["status"] == "done":
        return f"done in {seconds:.1f} s, best val {row['best_val_loss']:.4f}"
    return f"{row['status']}: {row['error']}"


def _skipped(k: int, total: int, spec: RunSpec) -> str:
    return (f"run {k}/{total}: batch {spec.batch_size}, lr {spec.lr:g} is done or being trained by another sweep: "
            "skipped")


class WorkMeter:
    """Steps done over every run of this call, and the time left at the rate of the work (samples)
    done so far. Read from the store, which a run updates at each of its evaluations (in this
    process or a worker's): a resumed run's earlier steps count as done, not as speed."""

    FINISHED = ("done", "oom", "error")

    def __init__(self, specs: list[RunSpec], store: Store) -> None:
        self.specs, self.store = {spec.run_id: spec for spec in specs}, store
        self.first = self._work(self._done())
        self.total_work = sum(spec.steps * spec.batch_size for spec in specs)
        self.started = time.perf_counter()

    def _done(self) -> dict[int, int]:
        """Steps done per run; a run that ended (an OOM or an error too) has none left to do."""
        done = {}
        for run_id, spec in self.specs.items():
            row = self.store.run(run_id)
            done[run_id] = spec.steps if row["status"] in self.FINISHED else min(row["steps_done"] or 0, spec.steps)
        return done

    def _work(self, done: dict[int, int]) -> int:
        return sum(steps * self.specs[run_id].batch_size for run_id, steps in done.items())

    def line(self) -> str:
        """'[1,204/3,072 steps, ETA 4 min 10 s]'."""
        done = self._done()
        eta = time_left(time.perf_counter() - self.started, self._work(done) - self.first,
                        self.total_work - self.first)
        total = sum(s.steps for s in self.specs.values())
        return f"[{sum(done.values()):,}/{total:,} steps{', ' + eta if eta else ''}]"


def run_in_process(workload: Workload, tokens: TokenData | None, context: WorkerContext, specs: list[RunSpec],
                   progress: Callable[[str], None]) -> None:
    """--workers 1: every run here, one after another, with progress per evaluation."""
    source = BatchSource(workload, seed=context.seed, tokens=tokens, eval_samples=context.eval_samples)
    device = torch.device(context.device)
    owner = owner_id()
    with Store(context.store) as store:
        meter = WorkMeter(specs, store)
        for k, spec in enumerate(specs, 1):
            if not store.claim(spec.run_id, owner):
                progress(_skipped(k, len(specs), spec))
                continue
            progress(f"run {k}/{len(specs)}: {_describe_run(spec)} {meter.line()}")
            started = time.perf_counter()
            try:
                row = guarded_run(workload, source, spec, store, Path(context.checkpoints), device,
                                  lambda message: progress(f"run {k}/{len(specs)}: {message} {meter.line()}"))
            except BaseException:  # Ctrl-C: the run goes back to pending, to resume from its checkpoint
                store.release([spec.run_id], owner)
                progress("interrupted: the run in progress is pending again; --resume continues it")
                raise
            progress(f"run {k}/{len(specs)} ended: batch {spec.batch_size}, lr {spec.lr:g} "
                     f"{_ended(row, time.perf_counter() - started)} {meter.line()}")


def run_pool(specs: list[RunSpec], *, workers: int, devices: list[str], submit: Callable[[RunSpec, str], Future],
             store: Store, owner: str, progress: Callable[[str], None]) -> None:
    """Start a run whenever fewer than ``workers`` run: claim it in the store, give it a free
    device, ``submit(spec, device)``; when it ends, give the device back and say so. If this
    is interrupted, the runs in progress are given back as pending (end the workers first) and
    runs never started stay pending."""
    pool = DevicePool(devices)
    queue = list(enumerate(specs, 1))
    running: dict[Future, tuple[int, RunSpec, str, float]] = {}
    total = len(specs)
    meter = WorkMeter(specs, store)
    try:
        while queue or running:
            while queue and len(running) < workers:
                k, spec = queue.pop(0)
                if not store.claim(spec.run_id, owner):
                    progress(_skipped(k, total, spec))
                    continue
                device = pool.take()
                running[submit(spec, device)] = (k, spec, device, time.perf_counter())
                progress(f"run {k}/{total} started on {device}: {_describe_run(spec)}")
            if not running:
                break
            finished, _ = wait(running, timeout=PROGRESS_EVERY_S, return_when=FIRST_COMPLETED)
            if not finished:  # the workers' runs report to the store only: say what it holds
                progress(f"{len(running)} run(s) training {meter.line()}")
            for future in finished:
                k, spec, device, started = running.pop(future)
                pool.give(device)
                error = future.exception()
                if error is not None:  # the worker itself failed (guarded_run records a run's own errors)
                    store.update_run(spec.run_id, status="error", error=f"{type(error).__name__}: {error}",
                                     finished=time.time())
                    row = store.run(spec.run_id)
                else:
                    row = future.result()
                progress(f"run {k}/{total} ended ({total - len(queue) - len(running)}/{total}): batch "
                         f"{spec.batch_size}, lr {spec.lr:g} {_ended(row, time.perf_counter() - started)} "
                         f"{meter.line()}")
    finally:
        if running:
            store.release([spec.run_id for _, spec, _, _ in running.values()], owner)


def _end_workers(pool: ProcessPoolExecutor) -> None:
    """Stop the worker processes now (they ignore Ctrl-C), without waiting for their runs."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    for process in processes:
        process.terminate()
    for process in processes:
        process.join(timeout=10)
    pool.shutdown(wait=False, cancel_futures=True)


def run_local(context: WorkerContext, specs: list[RunSpec], workers: int, progress: Callable[[str], None],
              devices: list[str] | None = None) -> None:
    """--workers N: N spawned processes, each run on a free device of ``devices`` (default:
    every GPU here for 'cuda', else the one device)."""
    threads = context.threads or max(1, (os.cpu_count() or 1) // workers)
    context = replace(context, threads=threads)
    devices = devices or local_devices(context.device)
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"), initializer=_ignore_sigint)
    finished = False
    try:
        with Store(context.store) as store:
            owner = owner_id()
            try:
                run_pool(specs, workers=workers, devices=devices, store=store, owner=owner, progress=progress,
                         submit=lambda spec, device: pool.submit(execute, replace(context, device=device), spec))
                finished = True
            finally:
                if not finished:  # end the workers before their runs are given back
                    _end_workers(pool)
    finally:
        if finished:
            pool.shutdown(wait=True)
        else:
            progress("interrupted: the workers are stopped; runs not finished are pending, --resume finishes them")


def run_ray(context: WorkerContext, specs: list[RunSpec], workers: int, address: str | None,
            progress: Callable[[str], None]) -> None:
    """Ray tasks, one GPU each where the cluster has GPUs; ``ray.init()`` starts a local
    cluster of ``workers`` CPUs when no address is given. Each task returns its run and the
    driver writes it to the store (:func:`execute_remote`): the store never leaves this machine."""
    import ray

    started_here = not ray.is_initialized()
    if started_here:
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
    refs: dict = {}
    owner = owner_id()
    try:
        gpus = ray.cluster_resources().get("GPU", 0)
        task = ray.remote(num_cpus=1, num_gpus=1 if gpus else 0, max_retries=0)(execute_remote)
        threads = context.threads or max(1, (os.cpu_count() or 1) // workers)
        context = replace(context, threads=threads, device="cuda" if gpus else context.device)
        with Store(context.store) as store:
            meter = WorkMeter(specs, store)  # Ray's runs reach the store as they end: counted then
            for k, spec in enumerate(specs, 1):
                if store.claim(spec.run_id, owner):
                    refs[task.remote(context, spec)] = (k, spec, time.perf_counter())
                    progress(f"run {k}/{len(specs)} queued on Ray: {_describe_run(spec)}")
                else:
                    progress(_skipped(k, len(specs), spec))
            while refs:
                ready, _ = ray.wait(list(refs), num_returns=1)
                for ref in ready:
                    k, spec, started = refs.pop(ref)
                    try:
                        back = ray.get(ref)
                    except Exception as error:  # the task itself failed (guarded_run records a run's own errors)
                        store.update_run(spec.run_id, status="error", error=f"{type(error).__name__}: {error}",
                                         finished=time.time())
                    else:
                        store.write_back(back["row"], back["points"])
                    ended = _ended(store.run(spec.run_id), time.perf_counter() - started)
                    progress(f"run {k}/{len(specs)} ended ({len(specs) - len(refs)}/{len(specs)}): batch "
                             f"{spec.batch_size}, lr {spec.lr:g} {ended} {meter.line()}")
    finally:
        if refs:  # interrupted: stop the tasks; their runs are pending again
            for ref in refs:
                ray.cancel(ref, force=True)
            with Store(context.store) as store:
                store.release([spec.run_id for _, spec, _ in refs.values()], owner)
            progress("interrupted: the Ray tasks are cancelled; runs not finished are pending, --resume finishes them")
        if started_here:
            ray.shutdown()
