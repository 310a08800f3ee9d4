"""The local executor with two worker processes and a local Ray cluster both fill the store."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from batchfit import load_workload
from batchfit.sweep import SweepConfig, plan_sweep, run_sweep
from tests.test_sweep_helpers import write_corpus, write_tiny

SRC = str(Path(__file__).resolve().parents[1] / "src")


def config(tmp_path, executor):
    spec = write_tiny(tmp_path)
    corpus = write_corpus(tmp_path / "stories.txt")
    return SweepConfig(model=spec, batch_sizes=[2, 4, 8], tokens=256, data=str(corpus), tokenizer="bytes",
                       lrs=[3e-3], eval_samples=4, store=tmp_path / "sweep.db", cache_dir=tmp_path / "cache",
                       device="cpu", executor=executor, workers=2)


def check_filled(result):
    assert [(r["batch_size"], r["status"], r["steps"], r["tokens"]) for r in result.runs] == \
        [(2, "done", 8, 256), (4, "done", 4, 256), (8, "done", 2, 256)]
    assert len({r["worker"] for r in result.runs}) >= 1
    assert all(len(r["curve"]["val"]) >= 2 for r in result.runs)


def test_local_executor_with_two_workers_fills_the_store(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cfg = config(tmp_path, "local")
    said = []
    result = run_sweep(plan_sweep(cfg, load_workload(cfg.model)), said.append)
    check_filled(result)
    assert said[-1].startswith("runs 3/3")


def test_local_ray_cluster_fills_the_store(tmp_path, monkeypatch):
    pytest.importorskip("ray")
    # Ray's workers are new processes: they find batchfit (and the test's workload file) on this path.
    monkeypatch.setenv("PYTHONPATH", SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    cfg = config(tmp_path, "ray")
    result = run_sweep(plan_sweep(cfg, load_workload(cfg.model)))
    check_filled(result)
