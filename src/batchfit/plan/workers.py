"""Strategies traced side by side: one process per strategy session, as many at once as CPU cores.

Each strategy is its own tracing session on its own fake process group, and tracing is
plain Python on one core, so a plan of four strategies on a 2-core machine takes about half
as long traced two at a time. Each session is a process forked from this one when it starts
(the model spec, the imports and the workload's closures come along without pickling, and no
session inherits another's state); it sends its progress lines and then its result (a
``StrategyPlan``) back through a pipe of its own, so a session stopped halfway (one started
ahead that its round does not take, ``plan/by_bound.py``) leaves the others' pipes whole.
:class:`Sessions` starts them one at a time and collects them by rounds; :func:`run` is one round
of every job. Where a process cannot be forked (``trace.forked.can_fork``: not Linux, one core,
``BATCHFIT_PROCESSES=1``, CUDA initialized here), sessions run here one after another.
"""

from __future__ import annotations

import multiprocessing
import re
import time
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.connection import wait
from typing import Any

from batchfit.errors import TraceError
from batchfit.trace import forked
from batchfit.trace.forked import can_fork, sendable


def default_processes(jobs: int) -> int:
    """One process per CPU core this process may use, at most one per job."""
    return max(1, min(forked.cores(), jobs))


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

    def count(self, message: str, job: int = 0) -> None:
        """A line of session ``job``: one size more started if it says so (also a line said before this
        count began, by a session started ahead of its round)."""
        if _TRACE.search(message):
            self._traces[job] = self._traces.get(job, 0) + 1

    def tag(self, message: str, job: int = 0) -> str:
        """``message [2/5 sessions done, about 90 s left]`` for a line of session ``job``: a rough
        figure (strategies differ), and none before the first trace has finished."""
        self.count(message, job)
        if self.total < 2:
            return message
        estimate = self._seconds_left()
        left = "" if estimate is None else f", {'at least' if estimate[1] else 'about'} {estimate[0]:.0f} s left"
        return f"{message} [{self.done}/{self.total} sessions done{left}]"




DIED = ("a tracing process died (out of host memory, or killed): run with `processes` 1 to trace one strategy "
        "at a time")


def _session(one: Callable, job: Any, writer) -> None:
    """A forked process: ``one(job, say)``; its lines, then its result or its error, sent back through ``writer``."""
    try:
        outcome = ("done", one(job, lambda message: writer.send(("say", message))))
    except BaseException as error:  # noqa: BLE001 - sent back whole, or as a TraceError saying what it was
        outcome = ("error", sendable(error, f"tracing {job}"))
    try:
        writer.send(outcome)
    except Exception as error:  # noqa: BLE001 - a result that does not pickle: its error does
        writer.send(("error", sendable(error, f"sending back the result of {job}")))
    writer.close()


class Sessions:
    """The sessions of ``jobs``, each ``one(job, say)``, started one at a time, ``processes`` at once
    (default: :func:`default_processes`), and collected by rounds (:meth:`run`).

    A round may start sessions ahead of their round on the processes it leaves idle (``ahead``). A session
    is the same whenever it starts (forked from this process, it depends on its job only), so the round
    that takes it uses what it traced, never tracing it again; one that no round will take is stopped
    (:meth:`drop`), and one still running when a round needs its process is stopped then, so a session
    started ahead never delays one a round takes. Use it as a context manager: what still runs at the end
    is stopped. ``label(job)`` names a job in the lines about starting it ahead. Where no process can be
    forked (``can_fork``) or ``processes`` is 1, each round runs here, one job after another, and nothing
    starts ahead."""

    def __init__(self, one: Callable[[Any, Callable[[str], None]], Any], jobs: Sequence, say: Callable[[str], None],
                 *, processes: int | None = None, costly: Callable[[Any], bool] | None = None,
                 label: Callable[[Any], str] = str) -> None:
        self.one, self.jobs, self.say, self.label = one, list(jobs), say, label
        self.processes = default_processes(len(self.jobs)) if processes is None else max(1, min(processes, len(jobs)))
        self.forked = self.processes > 1 and can_fork()  # not Linux, one core, BATCHFIT_PROCESSES=1, CUDA initialized
        self._costly = costly or (lambda job: False)
        self._context = multiprocessing.get_context("fork") if self.forked else None
        self._running: dict[int, tuple[Any, Any]] = {}
        """(process, its pipe's reading end) of each session running, by job index."""
        self._outcomes: dict[int, tuple[str, Any]] = {}
        """('done', result) or ('error', error) of each session finished and not yet collected."""
        self._ahead: dict[int, tuple[float, list[str]]] = {}
        """Sessions started ahead of their round, in the order started: when, and the lines they said."""
        self._round: tuple[set[int], Steps] | None = None
        self._exiting: list = []
        """Processes that sent their outcome, reaped once they have exited."""
        self._busy = self._context.Value("i", 0) if self.forked else None
        """Sessions running, plus their forked children working beside them (``forked.claim_core``)."""
        if self.forked:
            forked.share_cores(self._busy, forked.cores())

    def __enter__(self) -> Sessions:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def idle(self) -> int:
        """Processes free to start a session on now (none where sessions run here)."""
        return self.processes - len(self._running) if self.forked else 0

    def run(self, indices: Iterable[int], ahead: Callable[[dict[int, Any]], list[int]] | None = None) -> list:
        """``[one(jobs[i], say) for i in indices]``, the ones ``costly`` says started first (a long job started
        last would leave the other cores idle while it runs alone); a session started ahead is waited for,
        not started again. The first error of these sessions (in ``indices`` order, of those finished when
        one fails) is raised here; a process that dies (killed for memory, say) is an error too.
        ``ahead(done)``: while a process is idle, the sessions the next round would take, the likeliest first,
        given ``done`` (this round's results so far, by index, in ``indices`` order); they are started ahead."""
        indices = list(indices)
        steps = Steps(len(indices), min(self.processes, len(indices)))
        order = sorted(indices, key=lambda i: not self._costly(self.jobs[i]))
        if not self.forked:
            out = {}
            for i in order:
                out[i] = self.one(self.jobs[i], lambda message, i=i: self.say(steps.tag(message, i)))
                steps.finished(i)
            return [out[i] for i in indices]
        if len(indices) > 1:
            self.say(f"tracing {len(indices)} strategy sessions, {steps.processes} at a time (one process each)")
        for i in (i for i in indices if i in self._ahead):
            started, lines = self._ahead.pop(i)
            for line in lines:  # its sizes so far count for the time left
                steps.count(line, i)
            state = "done" if i in self._outcomes else f"tracing for {time.perf_counter() - started:.0f} s"
            self.say(f"{self.label(self.jobs[i])}: this round takes it, started ahead ({state})")
        waiting = [i for i in order if i not in self._running and i not in self._outcomes]
        for i in reversed([i for i in self._ahead if i in self._running]):  # the last started first
            if self.idle >= len(waiting):
                break
            self.drop(i)
            self.say(f"{self.label(self.jobs[i])}: its session started ahead is stopped (this round needs its "
                     "process; traced again if a round takes it)")
        self._round, counted, asked = (set(indices), steps), set(), None
        try:
            while True:
                for i in [i for i in indices if i in self._outcomes and i not in counted]:
                    counted.add(i)
                    steps.finished(i)
                failed = next((i for i in indices if self._outcomes.get(i, ("",))[0] == "error"), None)
                if failed is not None:
                    raise self._outcomes.pop(failed)[1]
                if len(counted) == len(indices):
                    return [self._outcomes.pop(i)[1] for i in indices]
                while waiting and self.idle:
                    self._start(waiting.pop(0))
                if ahead is not None and self.idle:
                    if asked is None or asked[0] != len(counted):  # what is known changed: ask again
                        asked = (len(counted), ahead({i: self._outcomes[i][1] for i in indices if i in counted}))
                    for i in asked[1]:
                        if self.idle and i not in self._running and i not in self._outcomes and i not in indices:
                            self._start(i)
                            self._ahead[i] = (time.perf_counter(), [])
                            self.say(f"{self.label(self.jobs[i])}: started ahead of its round on an idle process "
                                     "(used as it is if a round takes it)")
                self._take()
        finally:
            self._round = None

    def drop(self, index: int) -> bool:
        """Forget session ``index``, started ahead and not to be collected: stop it if it still runs (an error
        it raised is not raised). Whether it had been started."""
        held = index in self._running or index in self._outcomes
        if index in self._running:
            self._count(-1)
            process, reader = self._running.pop(index)
            process.terminate()
            process.join()
            reader.close()
        self._outcomes.pop(index, None)
        self._ahead.pop(index, None)
        return held

    def close(self) -> None:
        """Stop every session still running."""
        for index in list(self._running):
            self.drop(index)
        for process in self._exiting:
            process.terminate()
            process.join()
        self._exiting.clear()
        if self._busy is not None:
            forked.share_cores(None, 0)

    def _count(self, sessions: int) -> None:
        with self._busy.get_lock():
            self._busy.value += sessions

    def _start(self, index: int) -> None:
        reader, writer = self._context.Pipe(duplex=False)
        process = self._context.Process(target=_session, args=(self.one, self.jobs[index], writer), daemon=False)
        process.start()  # not daemonic: a session may fork its own (trace/forked.py)
        writer.close()  # the child's copy is then the only one: its death is the end of the pipe here
        self._running[index] = (process, reader)
        self._count(+1)

    def _take(self) -> None:
        """Wait for lines or outcomes from the sessions running, and take them."""
        readers = {reader: index for index, (_, reader) in self._running.items()}
        for reader in wait(list(readers)):
            index = readers[reader]
            try:
                kind, payload = reader.recv()
            except (EOFError, OSError):
                kind, payload = "error", TraceError(DIED)
            if kind == "say":
                self._hear(index, payload)
                continue
            self._outcomes[index] = (kind, payload)
            self._count(-1)
            process, _ = self._running.pop(index)
            reader.close()
            self._exiting.append(process)
        self._exiting = [process for process in self._exiting if process.is_alive()]  # is_alive() reaps

    def _hear(self, index: int, message: str) -> None:
        if self._round is not None and index in self._round[0]:
            self.say(self._round[1].tag(message, index))
        else:  # started ahead of its round: its sizes count once a round takes it
            self._ahead.get(index, (0.0, []))[1].append(message)
            self.say(f"{message} [started ahead]")


def run(one: Callable[[Any, Callable[[str], None]], Any], jobs: Sequence, say: Callable[[str], None], *,
        processes: int | None = None, costly: Callable[[Any], bool] | None = None) -> list:
    """``[one(job, say) for job in jobs]``, in that order, ``processes`` at a time (default:
    :func:`default_processes`): one round of :class:`Sessions` (its ``run`` says how errors come back)."""
    with Sessions(one, jobs, say, processes=processes, costly=costly) as sessions:
        return sessions.run(range(len(jobs)))
