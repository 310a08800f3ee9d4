"""Trace sessions that live in a forked process and trace while this one does.

A deep model is traced at depths 2, 3 and 4 (``trace/depth.py``): three independent sessions
whose fake-tensor dispatch is plain Python on one core. On a machine with two cores or more
the shallow ones (2 and 3) live in a child forked from this process, which traces them at a
batch size while this process traces depth 4: about 40% less time, the same bytes (each
session is the same code on the same model, whichever process runs it).

The child is forked after the model spec is loaded (imports, closures and the first session
come along without pickling). It answers one request at a time over a pipe: trace these
sessions at this batch size, send back their TracePoints and fresh allocation streams
(folded: ``TraceSession.fresh_folded``).
The fork context is asked for by name (Linux only); elsewhere, with one core, or where CUDA
is initialized, the caller keeps every session here. The child touches no thread of the
parent's (the CLI's progress bar), though Python 3.12+ warns about forking beside one.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import sys
import traceback
from collections.abc import Callable
from typing import Any

from batchfit.errors import TraceError


def can_fork() -> bool:
    """Linux with at least two cores this process may use, unless ``BATCHFIT_PROCESSES=1``, or
    CUDA is initialized here (a forked child cannot use it: Lightning or HF Trainer asking for an
    estimate from a training process that already holds a GPU)."""
    if sys.platform != "linux" or os.environ.get("BATCHFIT_PROCESSES", "").strip() == "1":
        return False
    import torch

    return cores() >= 2 and not torch.cuda.is_initialized()


def cores() -> int:
    """The CPU cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


_cores: tuple[Any, int] | None = None
"""(shared count of busy processes, cores) where plan's ``Sessions`` runs sessions in processes of their own
(:func:`share_cores`); None elsewhere: a forked child then always works beside its parent."""


def share_cores(busy, cores: int) -> None:
    """Processes forked after this count ``busy`` (a ``multiprocessing.Value``: the sessions running, plus the
    forked children working beside them) against ``cores``; ``busy`` None forgets it."""
    global _cores
    _cores = None if busy is None else (busy, cores)


def claim_core() -> bool:
    """Whether a forked child may work beside this process now: a core is idle (one fewer, until
    :func:`release_core`). Where every core traces a session already, a child that works meanwhile only
    slows both (auto's 70B plan: 15% more CPU time for the same wall time), so its parent waits for it instead."""
    if _cores is None:
        return True
    busy, cores = _cores
    with busy.get_lock():
        if busy.value >= cores:
            return False
        busy.value += 1
        return True


def release_core() -> None:
    if _cores is not None:
        with _cores[0].get_lock():
            _cores[0].value -= 1


def sendable(error: BaseException, doing: str) -> BaseException:
    """``error`` if it can cross a process boundary, else a TraceError with its type and text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - an error that does not pickle: its type and text can
        text = "".join(traceback.format_exception_only(type(error), error)).strip()
        return TraceError(f"{doing} failed: {text}")


def _end_with_parent(parent: int) -> None:
    """Have the kernel stop this process when its parent dies (Linux's PR_SET_PDEATHSIG): a parent stopped by
    a signal (plan's ``Sessions`` terminates a session set aside) runs no clean-up that would stop its child,
    which would trace on, on a core meant for others, and find no one to answer."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # died before the request took: nothing will signal
        os._exit(0)


def _serve(connection, parents_end, build: Callable[[], tuple[Any, Any]], parent: int) -> None:
    """The child of a :class:`ForkedWorker`: build its object, then call the method each request names.
    Each answer carries its request's number, so the parent never takes one answer for another."""
    parents_end.close()  # the parent's death then ends recv() below: no orphan left waiting
    _end_with_parent(parent)
    try:
        served, built = build()
        connection.send((0, "ok", built))
    except BaseException as error:  # noqa: BLE001 - sent back, raised in the parent
        connection.send((0, "error", sendable(error, "building the model in the tracing process")))
        return
    while True:
        try:
            request = connection.recv()
        except (EOFError, KeyboardInterrupt):
            return
        if request is None:
            getattr(served, "close", lambda: None)()
            return
        number, method, args, doing = request
        try:
            answer = (number, "ok", getattr(served, method)(*args))
        except BaseException as error:  # noqa: BLE001 - sent back, raised in the parent
            answer = (number, "error", sendable(error, doing))
        try:
            connection.send(answer)
        except OSError:  # the parent is gone: no one to answer
            return


def _died() -> TraceError:
    return TraceError("the tracing process died (out of host memory, or killed): set "
                      "BATCHFIT_PROCESSES=1 to trace every depth in this process")


class ForkedWorker:
    """An object built by ``build`` in a forked child (``build() -> (the object, anything picklable the caller
    needs from building it)``), whose methods the child runs one request at a time while this process goes on."""

    def __init__(self, build: Callable[[], tuple[Any, Any]]) -> None:
        context = multiprocessing.get_context("fork")
        self._connection, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, self._connection, build, os.getpid()),
                                        daemon=True)
        self._process.start()
        child.close()
        self._asked = 0
        """The number of the last request; the build is request 0."""
        self._answered = -1

    def start(self, method: str, *args, doing: str = "tracing in the forked process") -> None:
        """Ask the child to run ``method(*args)`` on its object; :meth:`result` waits for the value. An earlier
        request whose answer was never taken (an error here, Ctrl-C) is skipped."""
        self._asked += 1
        try:
            self._connection.send((self._asked, method, args, doing))
        except OSError as error:  # a broken pipe: the child is gone
            raise _died() from error

    def result(self) -> Any:
        """The answer to the last request (answers to earlier ones still in the pipe are dropped); the first
        call, before any request, what ``build`` gave beside its object."""
        while True:
            try:
                number, status, value = self._connection.recv()
            except (EOFError, OSError) as error:
                raise _died() from error
            self._answered = number
            if number == self._asked:
                break
        if status == "error":
            raise value
        return value

    def close(self) -> None:
        """Stop the child: at once when it is still working (an error here ended the step)."""
        if self._process.is_alive():
            if self._answered < self._asked:
                self._process.terminate()
            else:
                try:
                    self._connection.send(None)
                except OSError:
                    self._process.terminate()
            self._process.join(timeout=5)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        self._connection.close()


class _Sessions:
    """In the child of :class:`ForkedSessions`: its trace sessions."""

    def __init__(self, sessions: list) -> None:
        self.sessions = sessions

    def trace(self, batch_size: int, fresh: bool) -> list[tuple[Any, list | None]]:
        return [(s.trace(batch_size, fresh=fresh), s.fresh_folded if fresh else None) for s in self.sessions]


def _sessions_built(build: Callable[[], tuple[list, Any]]) -> tuple[_Sessions, tuple[list, Any]]:
    sessions, built = build()
    return _Sessions(sessions), ([(s.params, s.trainable_params) for s in sessions], built)


class ForkedSessions(ForkedWorker):
    """Trace sessions built by ``build`` in a forked child; ``build`` returns them and anything
    picklable the caller needs from building them (:meth:`built`)."""

    def __init__(self, build: Callable[[], tuple[list, Any]]) -> None:
        super().__init__(lambda: _sessions_built(build))
        self.params: list[int] = []
        self.trainable_params: list[int] = []

    def built(self) -> Any:
        """Wait for the child to build its sessions (this process builds its own meanwhile):
        what ``build`` returned beside them; :attr:`params` and :attr:`trainable_params` are set."""
        counts, built = self.result()
        self.params = [p for p, _ in counts]
        self.trainable_params = [t for _, t in counts]
        return built

    def start(self, batch_size: int, *, fresh: bool) -> None:
        """Ask the child to trace its sessions at ``batch_size``; :meth:`results` waits for them."""
        super().start("trace", batch_size, fresh, doing=f"tracing batch size {batch_size}")

    def results(self) -> list[tuple[Any, list | None]]:
        """(TracePoint, fresh stream or None) for each session, in the order ``build`` gave them."""
        return self.result()


def _call(connection, parents_end, fn: Callable[[], Any]) -> None:
    """The child of a :class:`ForkedCall`: run ``fn`` once and send back its value or its error."""
    parents_end.close()
    try:
        connection.send(("ok", fn()))
    except BaseException as error:  # noqa: BLE001 - sent back, raised in the parent
        connection.send(("error", sendable(error, "tracing in the forked process")))


class ForkedCall:
    """``fn()`` run once in a forked child while this process goes on; :meth:`result` waits for its
    value (picklable). ``fn`` works on the child's copy of this process: what it changes stays there."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        context = multiprocessing.get_context("fork")
        self._connection, child = context.Pipe()
        self._process = context.Process(target=_call, args=(child, self._connection, fn), daemon=True)
        self._process.start()
        child.close()

    def result(self) -> Any:
        try:
            status, value = self._connection.recv()
        except (EOFError, OSError) as error:
            raise _died() from error
        finally:
            self.close()
        if status == "error":
            raise value
        return value

    def close(self) -> None:
        if self._process.is_alive():
            self._process.terminate()
        self._process.join(timeout=5)
        self._connection.close()
