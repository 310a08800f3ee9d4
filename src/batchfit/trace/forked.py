"""Trace sessions that live in a forked process and trace while this one does.

A deep model is traced at depths 2, 3 and 4 (``trace/depth.py``): three independent sessions
whose fake-tensor dispatch is plain Python on one core. On a machine with two cores or more
the shallow ones (2 and 3) live in a child forked from this process, which traces them at a
batch size while this process traces depth 4: about half the time, the same bytes (each
session is the same code on the same model, whichever process runs it).

The child is forked after the model spec is loaded (imports, closures and the first session
come along without pickling). It answers one request at a time over a pipe: trace these
sessions at this batch size, send back their TracePoints and fresh allocation streams.
Fork is Linux's default; elsewhere, or with one core, the caller keeps every session here.
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
    """Linux with at least two cores this process may use, unless ``BATCHFIT_PROCESSES=1``."""
    if sys.platform != "linux" or os.environ.get("BATCHFIT_PROCESSES", "").strip() == "1":
        return False
    return len(os.sched_getaffinity(0)) >= 2


def sendable(error: BaseException, doing: str) -> BaseException:
    """``error`` if it can cross a process boundary, else a TraceError with its type and text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - an error that does not pickle: its type and text can
        text = "".join(traceback.format_exception_only(type(error), error)).strip()
        return TraceError(f"{doing} failed: {text}")


def _serve(connection, build: Callable[[], tuple[list, Any]]) -> None:
    """The child: build the sessions, then trace them at each batch size asked for."""
    try:
        sessions, built = build()
        connection.send(("ok", ([(s.params, s.trainable_params) for s in sessions], built)))
    except BaseException as error:  # noqa: BLE001 - sent back, raised in the parent
        connection.send(("error", sendable(error, "building the model in the tracing process")))
        return
    while True:
        try:
            request = connection.recv()
        except (EOFError, KeyboardInterrupt):
            return
        if request is None:
            return
        batch_size, fresh = request
        try:
            traced = [(s.trace(batch_size, fresh=fresh), s.fresh_stream if fresh else None) for s in sessions]
            connection.send(("ok", traced))
        except BaseException as error:  # noqa: BLE001 - sent back, raised in the parent
            connection.send(("error", sendable(error, f"tracing batch size {batch_size}")))


def _died() -> TraceError:
    return TraceError("the tracing process died (out of host memory, or killed): set "
                      "BATCHFIT_PROCESSES=1 to trace every depth in this process")


class ForkedSessions:
    """Sessions built by ``build`` in a forked child; ``build`` returns them and anything
    picklable the caller needs from building them (``built``)."""

    def __init__(self, build: Callable[[], tuple[list, Any]]) -> None:
        context = multiprocessing.get_context("fork")
        self._connection, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, build), daemon=True)
        self._process.start()
        child.close()
        self._waiting = True
        self.params: list[int] = []
        self.trainable_params: list[int] = []

    def built(self) -> Any:
        """Wait for the child to build its sessions (this process builds its own meanwhile):
        what ``build`` returned beside them; :attr:`params` and :attr:`trainable_params` are set."""
        counts, built = self.results()
        self.params = [p for p, _ in counts]
        self.trainable_params = [t for _, t in counts]
        return built

    def start(self, batch_size: int, *, fresh: bool) -> None:
        """Ask the child to trace its sessions at ``batch_size``; :meth:`results` waits for them."""
        try:
            self._connection.send((batch_size, fresh))
        except OSError as error:  # a broken pipe: the child is gone
            raise _died() from error
        self._waiting = True

    def results(self) -> list[tuple[Any, list | None]]:
        """(TracePoint, fresh stream or None) for each session, in the order ``build`` gave them."""
        self._waiting = False
        return self._receive()

    def discard(self) -> None:
        """Wait for the answer to the last request and drop it, whatever it is."""
        try:
            self.results()
        except BaseException:  # noqa: BLE001 - the caller raises its own error
            pass

    def _receive(self) -> Any:
        try:
            status, value = self._connection.recv()
        except (EOFError, OSError) as error:
            raise _died() from error
        if status == "error":
            raise value
        return value

    def close(self) -> None:
        """Stop the child: at once when it is still tracing (an error here ended the step)."""
        if not self._process.is_alive():
            self._connection.close()
            return
        if self._waiting:
            self._process.terminate()
        else:
            try:
                self._connection.send(None)
            except (BrokenPipeError, OSError):
                self._process.terminate()
        self._process.join(timeout=5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._connection.close()
