"""Where runs execute: this process, local worker processes, or Ray tasks.

Every executor runs the same function, :func:`execute`, and every run writes to the same
SQLite store; the executors differ only in who calls it. A worker process (or Ray task)
rebuilds the workload from its MODEL spec and reads the tokens from the on-disk cache, so
nothing unpicklable crosses a process boundary. Ray is imported only inside
:func:`run_ray`: it is an optional extra (``pip install 'batchfit[ray]'``).

A run that fails is recorded and the sweep goes on: out of memory (``batchfit.train.oom``) is
retried with half the micro-batch from the run's last checkpoint (the gradient is the
same, accumulated), and is recorded as ``oom`` only when one sample does not fit; any other
error is recorded as ``error`` with its type, message and the line that raised it.
"""

from __future__ import annotations

import gc
import os
import time
import traceback
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, replace
from multiprocessing import get_context
from pathlib import Path

import torch

from batchfit.errors import OptionError
from batchfit.train.oom import classify, describe
from batchfit.sweep.data import BatchSource, TokenData, open_tokens
from batchfit.sweep.run import RunSpec, micro_batch_for, train_run
from batchfit.sweep.store import Store
from batchfit.workload import Workload

EXECUTORS: tuple[str, ...] = ("local", "ray")


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
    """'cpu', 'cuda', or 'cuda:N'; 'cuda' workers take cuda:<worker index % GPUs>."""
    threads: int | None = None


def check_executor(executor: str, workers: int) -> None:
    if executor not in EXECUTORS:
        raise OptionError(f"unknown --executor '{executor}': use local (worker processes here) or ray")
    if workers < 1:
        raise OptionError(f"--workers must be 1 or more, got {workers}")
    if executor == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise OptionError("--executor ray needs Ray: pip install 'batchfit[ray]'") from None


def guarded_run(workload: Workload, source: BatchSource, spec: RunSpec, store: Store, checkpoints: Path,
                device: torch.device, progress: Callable[[str], None] | None = None) -> dict:
    """:func:`train_run`, recording failures instead of raising them."""
    while True:
        if spec.micro_batch < 1:
            store.update_run(spec.run_id, status="oom", micro_batch=0,
                             error="one sample does not fit the GPU (estimated): nothing ran")
            return store.run(spec.run_id)
        failure = None
        try:
            return train_run(workload, source, spec, store, checkpoints, device, progress)
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


def execute(context: WorkerContext, spec: RunSpec, worker: int = 0) -> dict:
    """One run in a worker process or Ray task: rebuild the workload and data, train, record."""
    from batchfit.specs import load_workload

    if context.threads:
        torch.set_num_threads(context.threads)
    device = torch.device(context.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", worker % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    workload = load_workload(context.model, seq_len=context.seq_len)
    tokens = open_tokens(Path(context.token_cache)) if context.token_cache else None
    source = BatchSource(workload, seed=context.seed, tokens=tokens, eval_samples=context.eval_samples)
    with Store(context.store) as store:
        return guarded_run(workload, source, spec, store, Path(context.checkpoints), device)


def run_in_process(workload: Workload, tokens: TokenData | None, context: WorkerContext, specs: list[RunSpec],
                   progress: Callable[[str], None]) -> None:
    """--workers 1: every run here, one after another, with progress per evaluation."""
    source = BatchSource(workload, seed=context.seed, tokens=tokens, eval_samples=context.eval_samples)
    device = torch.device(context.device)
    with Store(context.store) as store:
        for k, spec in enumerate(specs, 1):
            progress(f"run {k}/{len(specs)}: batch {spec.batch_size}, lr {spec.lr:g}, {spec.steps:,} steps"
                     + (f" as {spec.accumulation_steps} x {spec.micro_batch}" if spec.accumulation_steps > 1 else ""))
            row = guarded_run(workload, source, spec, store, Path(context.checkpoints), device,
                              lambda message: progress(f"run {k}/{len(specs)}: {message}"))
            if row["status"] != "done":
                progress(f"run {k}/{len(specs)}: batch {spec.batch_size} {row['status']}: {row['error']}")


def run_local(context: WorkerContext, specs: list[RunSpec], workers: int, progress: Callable[[str], None]) -> None:
    """--workers N: N spawned processes (one per GPU when there are GPUs), a run per task."""
    threads = context.threads or max(1, (os.cpu_count() or 1) // workers)
    context = replace(context, threads=threads)
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        pending = {pool.submit(execute, context, spec, k % workers): spec for k, spec in enumerate(specs)}
        done_count = 0
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                spec = pending.pop(future)
                done_count += 1
                row = future.result()
                progress(f"runs {done_count}/{len(specs)}: batch {spec.batch_size}, lr {spec.lr:g} {row['status']}")


def run_ray(context: WorkerContext, specs: list[RunSpec], workers: int, address: str | None,
            progress: Callable[[str], None]) -> None:
    """Ray tasks, one GPU each where the cluster has GPUs; ``ray.init()`` starts a local
    cluster of ``workers`` CPUs when no address is given. The store is a file path: on a
    cluster of several machines it must be on a filesystem they share."""
    import ray

    started_here = not ray.is_initialized()
    if started_here:
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
    try:
        gpus = ray.cluster_resources().get("GPU", 0)
        task = ray.remote(num_cpus=1, num_gpus=1 if gpus else 0, max_retries=0)(execute)
        threads = context.threads or max(1, (os.cpu_count() or 1) // workers)
        context = replace(context, threads=threads, device="cuda" if gpus else context.device)
        refs = {task.remote(context, spec, 0): spec for spec in specs}
        done_count = 0
        while refs:
            ready, _ = ray.wait(list(refs), num_returns=1)
            for ref in ready:
                spec = refs.pop(ref)
                done_count += 1
                row = ray.get(ref)
                progress(f"runs {done_count}/{len(specs)}: batch {spec.batch_size}, lr {spec.lr:g} {row['status']}")
    finally:
        if started_here:
            ray.shutdown()
