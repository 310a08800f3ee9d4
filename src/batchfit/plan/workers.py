"""Strategies traced side by side: one process per strategy, as many at once as CPU cores.

Each strategy is its own tracing session on its own fake process group, and tracing is
plain Python on one core, so a plan of four strategies on a 2-core machine takes about half
as long traced two at a time. The processes are forked from this one (the model spec, the
imports and the workload's closures come along without pickling); each sends its progress
lines back through a pipe and its result (a ``StrategyPlan``) when done. Where a process
cannot be forked (``trace.forked.can_fork``: not Linux, one core, ``BATCHFIT_PROCESSES=1``,
CUDA initialized here), strategies run one after another.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from batchfit.trace.forked import can_fork, sendable

_JOB: tuple[Callable, Sequence, Any] | None = None
"""(function, jobs, progress queue) for the forked workers: set before the pool forks."""


def default_processes(jobs: int) -> int:
    """One process per CPU core this process may use, at most one per job."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, jobs))


TRACES_PER_SESSION = 5
"""What a session is taken to trace before any session has finished: the guided search's usual
predicted size, its neighbour and a correction, and a reserved replay or two (``search.guided``)."""

_TRACE = re.compile(r": local batch \d+")
"""A session's progress line when it starts tracing (or replaying) one size."""


class Steps:
    """How many of the strategy sessions are done and a rough time left, added to each progress line.

    The time left counts traces: each session's sizes started so far (its ``... local batch N`` lines),
    the sessions done give how many a session takes (``TRACES_PER_SESSION`` before any is done),
    and the wall time per finished trace and the sessions running at once turn the traces left
    into seconds. Sessions that run side by side finish together, so counting sessions alone
    gave no figure until the end."""

    def __init__(self, total: int, processes: int = 1) -> None:
        self.total, self.done, self.processes, self._started = total, 0, processes, time.perf_counter()
        self._traces: dict[int, int] = {}
        """Sizes started by each running session (by job index)."""
        self._done_traces: list[int] = []

    def finished(self, job: int) -> None:
        """Session ``job`` is done: its trace count tells how many a session takes."""
        self.done += 1
        self._done_traces.append(self._traces.pop(job, 0))

    def _seconds_left(self) -> tuple[float, bool] | None:
        """(seconds, whether only a floor): a session already past the traces a session is taken to
        need is counted with its one in flight only, so the figure is then the least left, not a guess."""
        running = len(self._traces)
        finished = sum(self._done_traces) + sum(self._traces.values()) - running  # one in flight per session
        if finished < 1:
            return None
        per_session = (sum(self._done_traces) / len(self._done_traces)) if self._done_traces else TRACES_PER_SESSION
        waiting = max(0, self.total - self.done - running)  # auto's rounds can end with sessions set aside unrun
        left = sum(max(per_session - n, 1) for n in self._traces.values()) + waiting * per_session
        per_trace = (time.perf_counter() - self._started) * min(self.processes, self.total) / finished  # process-s
        floor = any(n >= per_session for n in self._traces.values())
        return per_trace * left / max(1, min(self.processes, self.total - self.done)), floor

    def tag(self, message: str, job: int = 0) -> str:
        """``message [2/5 sessions done, about 90 s left]`` for a line of session ``job``: a rough
        figure (strategies differ), and none before the first trace has finished."""
        if _TRACE.search(message):
            self._traces[job] = self._traces.get(job, 0) + 1
        if self.total < 2:
            return message
        estimate = self._seconds_left()
        left = "" if estimate is None else f", {'at least' if estimate[1] else 'about'} {estimate[0]:.0f} s left"
        return f"{message} [{self.done}/{self.total} sessions done{left}]"


def _run_index(index: int):
    one, jobs, progress = _JOB
    try:
        return one(jobs[index], lambda message: progress.put((index, message)))
    except BaseException as error:  # noqa: BLE001 - sent back whole, or as a TraceError saying what it was
        portable = sendable(error, f"tracing {jobs[index]}")
        if portable is error:
            raise
        raise portable from None


def run(one: Callable[[Any, Callable[[str], None]], Any], jobs: Sequence, say: Callable[[str], None], *,
        processes: int | None = None, costly: Callable[[Any], bool] | None = None) -> list:
    """``[one(job, say) for job in jobs]``, in that order, ``processes`` at a time (default:
    :func:`default_processes`). The first error raised by a job (in job order) is raised here,
    and the other jobs are stopped; a worker that dies (killed for memory, say) is an error too.
    The jobs ``costly`` says are start first (their results still come back in job order): a long
    job started last would leave the other cores idle while it runs alone."""
    global _JOB
    processes = default_processes(len(jobs)) if processes is None else max(1, min(processes, len(jobs)))
    steps = Steps(len(jobs), processes)
    order = sorted(range(len(jobs)), key=lambda i: not costly(jobs[i])) if costly else list(range(len(jobs)))
    if processes == 1 or not can_fork():  # not Linux, one core, BATCHFIT_PROCESSES=1, or CUDA initialized
        out = {}
        for index in order:
            out[index] = one(jobs[index], lambda message, index=index: say(steps.tag(message, index)))
            steps.finished(index)
        return [out[index] for index in range(len(jobs))]
    context = multiprocessing.get_context("fork")
    progress = context.SimpleQueue()  # put() writes before the job goes on: no line arrives after its result
    _JOB = (one, jobs, progress)
    say(f"tracing {len(jobs)} strategy sessions, {processes} at a time (one process each)")
    pool = ProcessPoolExecutor(processes, mp_context=context)
    try:
        submitted = {i: pool.submit(_run_index, i) for i in order}  # the pool starts them in this order
        pending = [submitted[i] for i in range(len(jobs))]
        counted: set[int] = set()
        while not all(future.done() for future in pending):
            if progress.empty():
                time.sleep(0.05)
            else:
                say(steps.tag(*reversed(progress.get())))
            for index in [i for i, future in enumerate(pending) if future.done() and i not in counted]:
                counted.add(index)
                steps.finished(index)
            failed = next((f for f in pending if f.done() and f.exception() is not None), None)
            if failed is not None:
                break
        while not progress.empty():
            say(steps.tag(*reversed(progress.get())))
        for future in pending:
            if future.done() and future.exception() is not None:
                error = future.exception()
                if isinstance(error, BrokenProcessPool):
                    from batchfit.errors import TraceError

                    raise TraceError("a tracing process died (out of host memory, or killed): run with "
                                     "`processes` 1 to trace one strategy at a time") from error
                raise error
        return [future.result() for future in pending]
    finally:
        for process in list(getattr(pool, "_processes", {}).values()):  # stop what still runs
            process.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
        _JOB = None
