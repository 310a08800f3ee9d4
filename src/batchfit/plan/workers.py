"""Strategies traced side by side: one process per strategy, as many at once as CPU cores.

Each strategy is its own tracing session on its own fake process group, and tracing is
plain Python on one core, so a plan of four strategies on a 2-core machine takes about half
as long traced two at a time. The processes are forked from this one (the model spec, the
imports and the workload's closures come along without pickling); each sends its progress
lines back through a queue and its result (a ``StrategyPlan``) when done. Fork is Linux's
default and safe here; elsewhere, or with one core, strategies run one after another.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import sys
from collections.abc import Callable, Sequence
from typing import Any

_JOB: tuple[Callable, Sequence, Any] | None = None
"""(function, jobs, progress queue) for the forked workers: set before the pool forks."""


def default_processes(jobs: int) -> int:
    """One process per CPU core this process may use, at most one per job."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, jobs))


def _run_index(index: int):
    one, jobs, progress = _JOB
    return one(jobs[index], progress.put)


def run(one: Callable[[Any, Callable[[str], None]], Any], jobs: Sequence, say: Callable[[str], None], *,
        processes: int | None = None) -> list:
    """``[one(job, say) for job in jobs]``, in that order, ``processes`` at a time (default:
    :func:`default_processes`). The first error raised by a job is raised here, and the other
    jobs are stopped."""
    global _JOB
    processes = default_processes(len(jobs)) if processes is None else max(1, min(processes, len(jobs)))
    if processes == 1 or sys.platform != "linux":
        return [one(job, say) for job in jobs]
    context = multiprocessing.get_context("fork")
    progress = context.Queue()
    _JOB = (one, jobs, progress)
    say(f"tracing {len(jobs)} strategies, {processes} at a time (one process each)")
    pool = context.Pool(processes)
    try:
        pending = [pool.apply_async(_run_index, (i,)) for i in range(len(jobs))]
        while not all(result.ready() for result in pending):
            try:
                say(progress.get(timeout=0.2))
            except queue.Empty:
                pass
            for result in pending:
                if result.ready() and not result.successful():
                    result.get()  # raises the job's error
        while not progress.empty():
            say(progress.get())
        return [result.get() for result in pending]
    finally:
        pool.terminate()
        pool.join()
        _JOB = None
