"""The executors: the local one with two worker processes and a local Ray cluster fill the
store with the numbers of runs trained alone; the device pool hands out free devices; a run
is claimed by exactly one of two sweeps.

Checked against the same runs trained for real on the CPU, alone and in this process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from batchfit import load_workload
from batchfit.runs.budget import Budget, Schedule
from batchfit.runs.executors import DevicePool, local_devices, run_pool
from batchfit.runs.store import Store
from batchfit.sweep import SweepConfig, plan_sweep, run_sweep
from batchfit.sweep.run import RunSpec
from tiny import write_corpus, write_tiny

SRC = str(Path(__file__).resolve().parents[1] / "src")


def config(tmp_path, executor, workers=2, store="sweep.db"):
    spec = write_tiny(tmp_path)
    corpus = write_corpus(tmp_path / "stories.txt")
    return SweepConfig(model=spec, batch_sizes=[2, 4, 8], tokens=256, data=str(corpus), tokenizer="bytes",
                       lrs=[3e-3], eval_samples=4, store=tmp_path / store, cache_dir=tmp_path / "cache",
                       device="cpu", executor=executor, workers=workers)


def figures(result):
    return {r["batch_size"]: (r["status"], r["steps"], r["tokens"], r["initial_val_loss"], r["final_train_loss"],
                              r["final_val_loss"], r["best_val_loss"],
                              [(p["step"], p["loss"]) for p in r["curve"]["val"]],
                              [(p["step"], p["loss"]) for p in r["curve"]["train"]]) for r in result.runs}


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """The same sweep, every run trained alone in this process on one thread."""
    tmp_path = tmp_path_factory.mktemp("alone")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = config(tmp_path, "local", workers=1)
        return figures(run_sweep(plan_sweep(cfg, load_workload(cfg.model))))
    finally:
        torch.set_num_threads(threads)


def check_filled(result, alone):
    # 256 tokens at 16 tokens per sample: 8, 4 and 2 steps. Each step trains on at least 32
    # tokens, more than --eval-every (10% of 256 = 26), so every step is evaluated: steps + 1
    # validation points (with step 0) and steps training points per run.
    got = figures(result)
    assert {b: f[:3] for b, f in got.items()} == {2: ("done", 8, 256), 4: ("done", 4, 256), 8: ("done", 2, 256)}
    for b, steps in ((2, 8), (4, 4), (8, 2)):
        assert [s for s, _ in got[b][7]] == list(range(steps + 1))
        assert [s for s, _ in got[b][8]] == list(range(1, steps + 1))
    # ... and the numbers of the same runs trained alone (one thread there and in each worker)
    for b in (2, 4, 8):
        status, steps, tokens, initial, train, val, best, val_curve, train_curve = got[b]
        a = alone[b]
        assert (initial, train, val, best) == pytest.approx(a[3:7], rel=1e-5)
        assert [loss for _, loss in val_curve] == pytest.approx([loss for _, loss in a[7]], rel=1e-5)
        assert [loss for _, loss in train_curve] == pytest.approx([loss for _, loss in a[8]], rel=1e-5)
    workers = {r["worker"] for r in result.runs}
    assert f"pid {os.getpid()}" not in workers and 1 <= len(workers) <= 2  # worker processes, not this one
    assert all(r["owner"] is None or r["status"] == "done" for r in result.runs)


def test_local_executor_with_two_workers_fills_the_store(tmp_path, monkeypatch, alone):
    monkeypatch.setenv("PYTHONPATH", SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cfg = config(tmp_path, "local")
    said = []
    result = run_sweep(plan_sweep(cfg, load_workload(cfg.model)), said.append)
    check_filled(result, alone)
    # per-run progress: two runs start at once, the third when one of them has ended
    events = [m.split(":")[0] for m in said if m.startswith("run ")]
    assert events[:2] == ["run 1/3 started on cpu", "run 2/3 started on cpu"]
    assert events.index("run 3/3 started on cpu") > min(i for i, e in enumerate(events) if "ended" in e)
    assert sum("ended" in e for e in events) == 3


@pytest.mark.slow  # a local Ray cluster: 40-130 s on a 2-core machine (Ray's recommend branches are slow too)
def test_local_ray_cluster_fills_the_store_through_the_driver(tmp_path, monkeypatch, alone):
    pytest.importorskip("ray")
    # Ray's workers are new processes: they find batchfit (and the test's workload file) on this path.
    monkeypatch.setenv("PYTHONPATH", SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    cfg = config(tmp_path, "ray")
    result = run_sweep(plan_sweep(cfg, load_workload(cfg.model)))
    check_filled(result, alone)


def test_a_ray_task_never_opens_the_drivers_store(tmp_path, alone):
    # On a cluster the store is on the driver's disk: a task trains into a store of its own and
    # returns the run. Here the task's context names a store and checkpoints it cannot reach.

    from batchfit.runs.executors import WorkerContext, execute_remote

    cfg = config(tmp_path, "local", workers=1)
    plan = plan_sweep(cfg, load_workload(cfg.model))
    with Store(cfg.store) as store:
        run_id = store.add_run(4, 3e-3, plan.steps[4])
    spec = RunSpec(run_id=run_id, batch_size=4, lr=3e-3, micro_batch=4, budget=plan.budget, schedule=plan.schedule,
                   seed=0, eval_every=plan.eval_every, checkpoint_every=plan.checkpoint_every, eval_samples=4,
                   eval_batch=2)
    unreachable = tmp_path / "not-on-this-node"
    context = WorkerContext(model=cfg.model, seq_len=None, token_cache=str(plan.tokens.folder), seed=0,
                            eval_samples=4, store=str(unreachable / "sweep.db"), checkpoints=str(unreachable / "ck"),
                            device="cpu", threads=1)
    back = execute_remote(context, spec)
    assert not unreachable.exists()
    assert back["row"]["status"] == "done" and back["row"]["id"] == run_id
    with Store(cfg.store) as store:
        store.write_back(back["row"], back["points"])
        row, val = store.run(run_id), store.curve(run_id, "val")
    assert (row["status"], row["steps"], row["tokens"]) == ("done", 4, 256)
    assert [p["step"] for p in val] == [0, 1, 2, 3, 4]
    assert [p["loss"] for p in val] == pytest.approx([loss for _, loss in alone[4][7]], rel=1e-5)


# --- the device pool --------------------------------------------------------------------

def test_cuda_means_every_gpu_here():
    assert local_devices("cuda", gpu_count=3) == ["cuda:0", "cuda:1", "cuda:2"]
    assert local_devices("cuda:1", gpu_count=3) == ["cuda:1"]
    assert local_devices("cpu") == ["cpu"]


def test_a_run_takes_a_free_device_and_gives_it_back():
    pool = DevicePool(["cuda:0", "cuda:1"])
    assert [pool.take(), pool.take()] == ["cuda:0", "cuda:1"]
    pool.give("cuda:0")  # the run on cuda:0 ended first: the next run goes there, not to busy cuda:1
    assert pool.take() == "cuda:0"
    pool.give("cuda:1")
    assert pool.take() == "cuda:1"


def specs_in(store: Store, n: int) -> list[RunSpec]:
    budget = Budget(unit="samples", total=64, tokens_per_sample=None)
    schedule = Schedule(total=64, warmup=0, min_lr_ratio=0.1)
    return [RunSpec(run_id=store.add_run(b, 0.1, budget.steps(b)), batch_size=b, lr=0.1, micro_batch=b,
                    budget=budget, schedule=schedule, seed=0, eval_every=64, checkpoint_every=64)
            for b in (1, 2, 4, 8, 16, 32)[:n]]


def test_two_concurrent_runs_never_share_a_gpu_while_another_is_free(tmp_path):
    # The old executor sent run k to cuda:(k % workers % GPUs) when it was submitted: with runs
    # of unequal length, run 2 went to cuda:0 while run 0 still trained there and cuda:1 idled.
    lengths_s = [0.30, 0.05, 0.05, 0.30, 0.05, 0.05]
    lock, on = threading.Lock(), {"gpu:0": 0, "gpu:1": 0}
    most, used = {"gpu:0": 0, "gpu:1": 0}, []

    def fake_run(spec, device):
        with lock:
            on[device] += 1
            most[device] = max(most[device], on[device])
            used.append(device)
        time.sleep(lengths_s[spec.run_id - 1])
        with lock:
            on[device] -= 1
        return {"status": "done", "best_val_loss": 1.0, "error": None}

    with Store(tmp_path / "s.db") as store, ThreadPoolExecutor(max_workers=2) as threads:
        specs = specs_in(store, 6)
        run_pool(specs, workers=2, devices=["gpu:0", "gpu:1"], store=store, owner="here:1", progress=lambda m: None,
                 submit=lambda spec, device: threads.submit(fake_run, spec, device))
    assert most == {"gpu:0": 1, "gpu:1": 1}
    assert len(used) == 6 and set(used) == {"gpu:0", "gpu:1"}


# --- claims -----------------------------------------------------------------------------

def test_a_run_is_claimed_by_one_of_two_sweeps(tmp_path):
    path = tmp_path / "s.db"
    with Store(path) as a:
        ids = [s.run_id for s in specs_in(a, 6)]
    won: dict[str, list[int]] = {"a": [], "b": []}
    barrier = threading.Barrier(2)

    def claimer(name):
        with Store(path) as store:
            barrier.wait()
            for run_id in ids:
                if store.claim(run_id, f"host:{name}"):
                    won[name].append(run_id)

    workers = [threading.Thread(target=claimer, args=(n,)) for n in won]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert sorted(won["a"] + won["b"]) == ids  # every run claimed once, by exactly one
    with Store(path) as store:
        assert {r["id"]: r["owner"] for r in store.runs()} == {i: f"host:{'a' if i in won['a'] else 'b'}" for i in ids}
        assert not store.claim(ids[0], "host:c")  # running: nobody else takes it
        assert store.release(ids, "host:a") == len(won["a"])  # only the owner gives its runs back
        assert {r["status"] for r in store.runs() if r["id"] in won["a"]} <= {"pending"}


def test_runs_of_a_killed_sweep_are_pending_again(tmp_path):
    with Store(tmp_path / "s.db") as store:
        ids = [s.run_id for s in specs_in(store, 2)]
        assert store.claim(ids[0], "gone-host:1")  # another machine: it may still run
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout.strip()
        assert store.claim(ids[1], f"{socket.gethostname()}:{dead}")  # this machine, a process that is gone
        assert store.reclaim_stale() == [ids[1]]
        assert [r["status"] for r in store.runs()] == ["running", "pending"]
