"""Depths 2 and 3 traced in a forked process while this one traces depth 4 (trace/forked.py):
the same bytes as all three here, errors come back as errors, a dead process is one."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys

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
            results[parallel] = ([(p.to_json(), p.peak_by_part, p.breakdown_by_part, p.reserved_ratio) for p in points],
                                 traced.params, traced.trainable_params, traced._streams, traced.full_traces)
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


def test_a_dead_tracing_process_is_an_error_that_says_what_to_do():
    with TracedCurve(twelve_blocks(), StepOptions(), get_device("h100-80gb")) as traced:
        os.kill(traced._forked._process.pid, signal.SIGKILL)
        traced._forked._process.join()
        with pytest.raises(TraceError, match="tracing process died.*BATCHFIT_PROCESSES=1"):
            traced.point(1)


def test_batchfit_processes_1_keeps_every_depth_here(monkeypatch):
    monkeypatch.setenv("BATCHFIT_PROCESSES", "1")
    with TracedCurve(twelve_blocks(), StepOptions(), get_device("h100-80gb")) as traced:
        assert traced._forked is None and len(traced._shallow) == 3
