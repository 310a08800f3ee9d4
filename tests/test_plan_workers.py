"""Strategies traced side by side (plan/workers.py): results in order, progress and errors come back."""

from __future__ import annotations

import os
import sys

import pytest

from batchfit.errors import OptionError
from batchfit.plan import workers

linux = pytest.mark.skipif(sys.platform != "linux", reason="processes are forked on Linux only")


@linux
def test_jobs_run_in_their_own_processes_and_come_back_in_order():
    said = []

    def one(job, say):
        say(f"job {job}")
        return job * job, os.getpid()

    done = workers.run(one, [3, 1, 2], said.append, processes=2)
    assert [square for square, _ in done] == [9, 1, 4]
    assert os.getpid() not in {pid for _, pid in done}  # not run here
    assert sorted(m.split(" [")[0] for m in said if m.startswith("job")) == ["job 1", "job 2", "job 3"]
    assert all(m.endswith("sessions done]") or "s left" in m for m in said if m.startswith("job"))  # steps done


@linux
def test_an_error_in_one_job_is_raised_here():
    def one(job, say):
        if job == 2:
            raise OptionError("strategy 2 cannot be traced: use another")
        return job

    with pytest.raises(OptionError, match="strategy 2 cannot be traced"):
        workers.run(one, [1, 2, 3], lambda m: None, processes=2)


def test_one_process_runs_here_in_order():
    assert workers.run(lambda job, say: (job, os.getpid()), [1, 2], print, processes=1) == \
        [(1, os.getpid()), (2, os.getpid())]
    assert workers.default_processes(1) == 1


@pytest.mark.slow
@linux
def test_a_plan_traced_two_strategies_at_a_time_is_the_plan_traced_one_by_one():
    from batchfit.devices import get_device
    from batchfit.plan.engine import plan
    from batchfit.plan.world import World
    from batchfit.zoo import language_model_workload
    from batchfit.zoo.transformer import Transformer, TransformerConfig

    cfg = TransformerConfig(vocab_size=512, seq_len=32, d_model=64, n_layers=2, n_heads=4, d_ff=128, llama=True)
    workload = language_model_workload(name="tiny", build_model=lambda: Transformer(cfg), vocab_size=512,
                                       seq_len=32, description="2 tiny blocks")
    said = []
    runs = [plan(workload, device=get_device("t4-16gb"), worlds=[World(2)], strategies="ddp,fsdp,fsdp+tp2",
                 max_batch=8, global_batch=32, processes=n, progress=said.append).to_json() for n in (2, 1)]
    for run in runs:
        run.pop("trace_seconds"), run.pop("created")
    assert runs[0] == runs[1]
    assert any("3 strategy sessions, 2 at a time" in m for m in said)


@linux
def test_a_worker_that_dies_or_an_error_that_cannot_travel_is_an_error_not_a_hang():
    from batchfit.errors import TraceError

    def dies(job, say):
        if job == 2:
            os._exit(3)  # as the kernel's out-of-memory killer would leave it
        return job

    with pytest.raises(TraceError, match="a tracing process died"):
        workers.run(dies, [1, 2, 3], lambda m: None, processes=2)

    class Stubborn(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a} {b}")

    def odd_error(job, say):
        raise Stubborn("no", "pickle")

    with pytest.raises(TraceError, match="Stubborn: no pickle"):
        workers.run(odd_error, [1, 2], lambda m: None, processes=2)


def test_no_fork_where_cuda_is_initialized(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    done = workers.run(lambda job, say: os.getpid(), [1, 2], lambda m: None, processes=2)
    assert done == [os.getpid(), os.getpid()]  # a forked child could not use CUDA: run here


def test_time_left_counts_traces_before_any_session_is_done(monkeypatch):
    """Two sessions side by side, none done: 4 sizes started (2 finished, one in flight in each) of
    the 5 + 5 a session is taken to trace; 10 s on 2 processes is 10 process-s per finished trace;
    6 traces left (the two in flight among them), 2 at a time: 30 s."""
    now = [0.0]
    monkeypatch.setattr(workers.time, "perf_counter", lambda: now[0])
    steps = workers.Steps(2, processes=2)
    assert steps.tag("ddp on 1 GPU: local batch 8", 0).endswith("[0/2 sessions done]")  # nothing finished yet
    steps.tag("ddp on 2 GPUs: local batch 8", 1)
    now[0] = 10.0
    steps.tag("ddp on 1 GPU: local batch 16", 0)
    assert steps.tag("ddp on 2 GPUs: local batch 16", 1).endswith("[0/2 sessions done, about 30 s left]")


def test_time_left_takes_a_sessions_trace_count_from_those_done(monkeypatch):
    """One process: a session done after 3 traces, then the next starts its first: 3 finished in
    30 s (10 s each); a session takes 3, so 2 left (the one in flight among them): 20 s."""
    now = [0.0]
    monkeypatch.setattr(workers.time, "perf_counter", lambda: now[0])
    steps = workers.Steps(2, processes=1)
    for size in (8, 16, 12):
        steps.tag(f"fsdp on 2 GPUs: local batch {size}", 0)
    steps.finished(0)
    now[0] = 30.0
    assert steps.tag("ddp on 2 GPUs: local batch 8", 1).endswith("[1/2 sessions done, about 20 s left]")


def test_time_left_is_a_floor_once_a_session_passes_the_traces_taken_for_one(monkeypatch):
    """Two sessions side by side, none done, each 6 sizes in (past the 5 a session is taken to trace):
    10 finished traces in 50 s on 2 processes (10 process-s each), one in flight each, 2 at a time: at
    least 10 s, said as a floor (a plan of many sizes said 'about 48 s left' for minutes)."""
    now = [0.0]
    monkeypatch.setattr(workers.time, "perf_counter", lambda: now[0])
    steps = workers.Steps(2, processes=2)
    for size in range(1, 6):
        steps.tag(f"fsdp on 1 GPU: local batch {size}", 0)
        steps.tag(f"ddp on 1 GPU: local batch {size}", 1)
    steps.tag("ddp on 1 GPU: local batch 6", 1)
    now[0] = 50.0
    assert steps.tag("fsdp on 1 GPU: local batch 6", 0).endswith("[0/2 sessions done, at least 10 s left]")


def test_costly_jobs_start_first_and_come_back_in_order():
    started = []

    def one(job, say):
        started.append(job)
        return job * 10

    assert workers.run(one, [1, 2, 3, 4], print, processes=1, costly=lambda job: job % 2 == 0) == [10, 20, 30, 40]
    assert started == [2, 4, 1, 3]
