"""Ctrl-C on `batchfit sweep` (SIGINT to the whole process group, as a terminal sends it):
the workers stop, the runs in progress are pending again, runs not started stay pending, no
process prints a traceback, and --resume finishes the sweep."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.test_sweep_helpers import write_corpus, write_tiny

SRC = str(Path(__file__).resolve().parents[1] / "src")


def statuses(store: Path) -> dict[int, tuple[str, int]]:
    if not store.exists():
        return {}
    with sqlite3.connect(store, timeout=60) as db:
        try:
            rows = db.execute("SELECT id, status, steps_done FROM runs").fetchall()
        except sqlite3.OperationalError:  # the tables are being made
            return {}
    return {run_id: (status, steps_done or 0) for run_id, status, steps_done in rows}


def sweep(tmp_path: Path, spec: str, corpus: Path, workers: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "batchfit.cli.app", "sweep", spec, "--data", str(corpus), "--tokenizer", "bytes",
            "--batch-sizes", "2,4,8", "--lrs", "1e-3,3e-3", "--tokens", "1280", "--eval-samples", "4",
            "--workers", str(workers), "--store", str(tmp_path / "sweep.db"), "--cache-dir", str(tmp_path / "cache"),
            "--device", "cpu", "--out", str(tmp_path / "report"), *extra]
    # Its own process group (SIGINT to all of it, like a terminal), and SIGINT's default action: a
    # pytest started in the background of a non-interactive shell ignores SIGINT, and a child inherits
    # that (Python then installs no KeyboardInterrupt handler): the sweep would run through Ctrl-C.
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.mark.parametrize("workers", [pytest.param(2, marks=pytest.mark.slow), 1])
def test_ctrl_c_stops_the_sweep_and_leaves_the_runs_resumable(tmp_path, workers):
    spec, corpus = write_tiny(tmp_path), write_corpus(tmp_path / "stories.txt")
    store = tmp_path / "sweep.db"
    process = sweep(tmp_path, spec, corpus, workers)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None:
        now = statuses(store)
        if any(status == "running" and steps > 0 for status, steps in now.values()):
            break  # a run is training (6 runs: most are still pending)
        time.sleep(0.05)
    assert process.poll() is None, "the sweep ended before Ctrl-C"
    before = statuses(store)
    os.killpg(process.pid, signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert "interrupted" in stderr
    after = statuses(store)
    time.sleep(1.0)
    assert statuses(store) == after  # no worker is left writing
    done_before = sum(status == "done" for status, _ in before.values())
    done_after = sum(status == "done" for status, _ in after.values())
    # only the runs in progress at Ctrl-C could end (the bug: 4 more runs finished after it)
    assert done_after <= done_before + workers
    assert {status for status, _ in after.values()} <= {"done", "pending"}
    assert sum(status == "pending" for status, _ in after.values()) >= 6 - done_before - workers
    assert len(after) == 6

    resumed = sweep(tmp_path, spec, corpus, 1, "--resume")
    _, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr
    assert {status for status, _ in statuses(store).values()} == {"done"}
