"""Depths 2 and 3 traced in a forked process while this one traces depth 4 (trace/forked.py):
the same bytes as all three here, errors come back as errors, a dead process is one.

Checked against batchfit's own traces in this process (checks the fork, not the fidelity to a GPU)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchfit import StepOptions, get_device
from batchfit.errors import TraceError
from batchfit.trace.point import TracedCurve
from batchfit.zoo import language_model_workload
from batchfit.zoo.transformer import Transformer, TransformerConfig

pytestmark = pytest.mark.skipif(sys.platform != "linux" or len(os.sched_getaffinity(0)) < 2,
                                reason="the shallow depths are forked on Linux with two cores or more")

CONFIG = TransformerConfig(vocab_size=512, seq_len=64, d_model=64, n_layers=12, n_heads=4, d_ff=256,
                           llama=True, tied_embeddings=False)


def twelve_blocks(fail_above: int | None = None):
    workload = language_model_workload(name="twelve-blocks", build_model=lambda: Transformer(CONFIG),
                                       vocab_size=CONFIG.vocab_size, seq_len=CONFIG.seq_len, description="")
    if fail_above is None:
        return workload
    loss_fn = workload.loss_fn

    def failing(model, batch):
        if batch[0].shape[0] > fail_above:
            raise ValueError(f"no batch above {fail_above}")
        return loss_fn(model, batch)

    return dataclasses.replace(workload, loss_fn=failing)


def test_forked_depths_give_the_same_points_streams_and_reserved_peaks():
    device = get_device("h100-80gb")
    results = {}
    for parallel in (True, False):
        with TracedCurve(twelve_blocks(), StepOptions(), device, keep_streams=True, parallel=parallel) as traced:
            assert (traced._forked is not None) == parallel and traced.by_depth and traced.blocks == 12
            points = [traced.reserved(b) for b in (1, 3)]
            assert traced.full_traces == [] and traced.whole_reserved == []  # nothing fell back to a whole trace
            results[parallel] = ([(p.to_json(), p.peak_by_part, p.breakdown_by_part, p.reserved_ratio) for p in points],
                                 traced.params, traced.trainable_params, traced._streams, traced._seen.cuts)
            if parallel:
                child = traced._forked._process
        assert not child.is_alive()  # closed with the curve
    assert results[True] == results[False]
    assert results[True][0][0][0]["peak_reserved_bytes"] > 0  # the streams were extended and replayed


def test_an_error_in_the_forked_process_is_raised_here_and_tracing_goes_on():
    with TracedCurve(twelve_blocks(fail_above=2), StepOptions(), get_device("h100-80gb")) as traced:
        assert traced._forked is not None
        with pytest.raises(TraceError, match="at batch size 3.*ValueError: no batch above 2"):
            traced.point(3)
        assert traced.point(2).peak_bytes > traced.point(1).peak_bytes


def test_an_answer_never_taken_does_not_answer_the_next_request():
    # Ctrl-C while waiting, or an error in this process's own trace, leaves the child's answer
    # in the pipe: the next size must get its own answer, not that one
    device = get_device("h100-80gb")
    with TracedCurve(twelve_blocks(), StepOptions(), device, parallel=False) as alone:
        expected = alone.point(2).to_json()
    with TracedCurve(twelve_blocks(), StepOptions(), device) as traced:
        traced._forked.start(5, fresh=False)  # never read
        assert traced.point(2).to_json() == expected and traced.full_traces == []


def test_a_dead_tracing_process_is_an_error_that_says_what_to_do():
    with TracedCurve(twelve_blocks(), StepOptions(), get_device("h100-80gb")) as traced:
        os.kill(traced._forked._process.pid, signal.SIGKILL)
        traced._forked._process.join()
        with pytest.raises(TraceError, match="tracing process died.*BATCHFIT_PROCESSES=1"):
            traced.point(1)
    with TracedCurve(twelve_blocks(), StepOptions(), get_device("h100-80gb")) as traced:
        traced._forked.start(1, fresh=False)  # dies while tracing
        os.kill(traced._forked._process.pid, signal.SIGKILL)
        with pytest.raises(TraceError, match="tracing process died"):
            traced._forked.results()


def test_the_tracing_process_ends_when_this_one_is_killed(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_forked import twelve_blocks\n"
        "from batchfit import StepOptions, get_device\n"
        "from batchfit.trace.point import TracedCurve\n"
        "traced = TracedCurve(twelve_blocks(), StepOptions(), get_device('h100-80gb'))\n"
        "print(traced._forked._process.pid, flush=True)\n"
        "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.kill()  # SIGKILL: no atexit, no daemon clean-up
    parent.wait()
    _gone(child, "the forked tracing process outlived its parent")  # its recv() ends at once; reaped by init


def _gone(child: int, failure: str) -> None:
    """Wait up to 10 s for process ``child`` to end (or be a zombie); else kill it and fail with ``failure``."""
    for _ in range(100):
        if not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]:
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    pytest.fail(failure)


def _slow_worker():
    class Slow:
        def wait(self, seconds: float) -> float:
            time.sleep(seconds)
            return seconds

    return Slow(), None


def test_a_busy_child_ends_when_its_parent_is_terminated(tmp_path):
    """plan's Sessions stops a session set aside with SIGTERM (no clean-up runs): the session's own forked child,
    busy with a request, must not trace on with no one to answer (the kernel ends it: PR_SET_PDEATHSIG)."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_forked import _slow_worker\n"
        "from batchfit.trace.forked import ForkedWorker\n"
        "worker = ForkedWorker(_slow_worker)\n"
        "worker.result()\n"
        "worker.start('wait', 60)\n"
        "print(worker._process.pid, flush=True)\n"
        "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    child = int(parent.stdout.readline())
    parent.terminate()
    parent.wait()
    _gone(child, "the busy forked process outlived its terminated parent")
    assert "Traceback" not in parent.stderr.read()


def test_batchfit_processes_1_keeps_every_depth_here(monkeypatch):
    monkeypatch.setenv("BATCHFIT_PROCESSES", "1")
    with TracedCurve(twelve_blocks(), StepOptions(), get_device("h100-80gb")) as traced:
        assert traced._forked is None and len(traced._shallow) == 3


def test_no_fork_where_cuda_is_initialized(monkeypatch):
    # a training process (Lightning, HF Trainer) holding a GPU: a forked child could not use CUDA
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with TracedCurve(twelve_blocks(), StepOptions(), get_device("h100-80gb")) as traced:
        assert traced._forked is None and len(traced._shallow) == 3


def test_a_child_works_beside_its_parent_only_on_an_idle_core():
    """plan's Sessions counts its sessions running: a deep session's forked child works beside it only while a core
    is idle (else the parent waits for its answer), and gives the core back."""
    import multiprocessing

    from batchfit.trace import forked

    busy = multiprocessing.get_context("fork").Value("i", 1)  # one session running on two cores
    forked.share_cores(busy, 2)
    try:
        assert forked.claim_core() and busy.value == 2
        assert not forked.claim_core() and busy.value == 2  # both cores busy: the parent will wait
        forked.release_core()
        assert busy.value == 1
    finally:
        forked.share_cores(None, 0)
    assert forked.claim_core()  # no Sessions (estimate, a plan in one process): always beside
