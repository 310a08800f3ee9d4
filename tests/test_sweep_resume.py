"""A sweep killed with SIGKILL after a checkpoint, then --resume: the same numbers as a sweep
that was never interrupted (CPU, one thread), and runs that are done are not repeated.

Checked against the same sweep run for real on the CPU without an interruption."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from batchfit import load_workload
from batchfit.sweep import SweepConfig, plan_sweep, read_result, run_sweep
from tiny import write_corpus, write_tiny

SRC = str(Path(__file__).resolve().parents[1] / "src")


def sweep_cli(tmp_path: Path, spec: str, corpus: Path, store: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "batchfit.cli.app", "sweep", spec, "--data", str(corpus), "--tokenizer", "bytes",
            "--batch-sizes", "2,4", "--tokens", "3200", "--lrs", "3e-3", "--eval-every", "10%", "--eval-samples", "8",
            "--store", str(store), "--cache-dir", str(tmp_path / "cache"), "--device", "cpu",
            "--out", str(tmp_path / f"report-{store.stem}"), *extra]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def numbers(store: Path) -> list[tuple]:
    result = read_result(store)
    return [(r["batch_size"], r["status"], r["steps"], r["tokens"], r["final_train_loss"], r["final_val_loss"],
             r["best_val_loss"], [(p["step"], p["loss"]) for p in r["curve"]["val"]],
             [(p["step"], p["loss"]) for p in r["curve"]["train"]]) for r in result.runs]


def test_resume_after_kill_gives_the_numbers_of_an_uninterrupted_sweep(tmp_path):
    spec, corpus = write_tiny(tmp_path), write_corpus(tmp_path / "stories.txt")
    store = tmp_path / "killed.db"
    process = sweep_cli(tmp_path, spec, corpus, store)
    checkpoint = tmp_path / "killed.db.checkpoints" / "run-1.pt"
    deadline = time.monotonic() + 120
    while not checkpoint.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the sweep ended before it could be killed"
    killed = {r["batch_size"]: r for r in read_result(store).runs}
    assert killed[2]["status"] == "running" and 0 < killed[2]["steps_done"] < 100  # killed mid-run

    resumed = sweep_cli(tmp_path, spec, corpus, store, "--resume")
    output, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, output
    assert "resuming at step" in output

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 in the killed and resumed processes
    config = dict(model=spec, batch_sizes=[2, 4], tokens=3200, data=str(corpus), tokenizer="bytes", lrs=[3e-3],
                  eval_every="10%", eval_samples=8, cache_dir=tmp_path / "cache", device="cpu")
    try:
        reference = tmp_path / "reference.db"
        run_sweep(plan_sweep(SweepConfig(**config, store=reference), load_workload(spec)))
        assert numbers(store) == numbers(reference)  # exactly: every loss, every curve point
        assert [n[2] for n in numbers(store)] == [100, 50]

        # a finished store: --resume repeats nothing
        before = {r["id"]: r["finished"] for r in read_result(store).runs}
        said = []
        run_sweep(plan_sweep(SweepConfig(**config, store=store, resume=True), load_workload(spec)), said.append)
        assert said == ["every run is done already"]
        assert {r["id"]: r["finished"] for r in read_result(store).runs} == before
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("resume", [False, True])
def test_a_store_of_another_sweep_is_refused_and_left_alone(tmp_path, resume):
    spec, corpus = write_tiny(tmp_path), write_corpus(tmp_path / "stories.txt")
    store = tmp_path / "s.db"
    base = dict(model=spec, batch_sizes=[4], tokens=256, data=str(corpus), tokenizer="bytes", eval_samples=4,
                store=store, cache_dir=tmp_path / "cache", device="cpu")
    run_sweep(plan_sweep(SweepConfig(**base), load_workload(spec)))
    content = store.read_bytes()
    from batchfit.errors import OptionError

    with pytest.raises(OptionError, match="holds a different sweep \\(it differs in tokens\\)"):
        plan_sweep(SweepConfig(**{**base, "tokens": 512, "resume": resume}), load_workload(spec))
    if not resume:
        with pytest.raises(OptionError, match="already holds this sweep: add `resume`"):
            plan_sweep(SweepConfig(**base), load_workload(spec))
    assert store.read_bytes() == content
