"""Tracing at depths 2, 3, 4 and extrapolating gives the full trace's bytes, exactly."""

from __future__ import annotations

import pytest

from batchfit import StepOptions, get_device, load_workload
from batchfit.trace import depth
from batchfit.trace.point import TracedCurve


@pytest.mark.parametrize("spec,options", [
    ("gpt2-124m", StepOptions()),  # the optimizer step outgrows backward between depth 3 and 12
    ("hf:llama-3.2-1b", StepOptions(precision="bf16-mixed", checkpointing="full")),
])
def test_by_depth_equals_the_full_trace(spec, options):
    workload = load_workload(spec, seq_len=32)
    device = get_device("h100-80gb")
    results = []
    for by_depth in (True, False):
        with TracedCurve(workload, options, device, by_depth=by_depth) as traced:
            points = [traced.point(b) for b in (1, 3)]
            results.append(([(p.peak_bytes, p.phase, p.breakdown, p.peak_by_phase) for p in points],
                            traced.params, traced.trainable_params, traced.by_depth))
    (shallow, *counts_d, by_depth), (full, *counts_f, _) = results
    assert by_depth and shallow == full and counts_d == counts_f


def test_a_line_that_bends_is_not_extrapolated():
    assert depth.DEPTHS == (2, 3, 4)
    assert depth.line_at([20, 30, 40], 32) == 320  # 10 bytes a block
    assert depth.line_at([20, 30, 41], 32) is None  # not affine: trace the whole model


def test_few_blocks_are_traced_whole(mlp):
    with TracedCurve(mlp, StepOptions(), get_device("t4-16gb")) as traced:
        traced.point(4)
        assert not traced.by_depth and traced.full_traces == [4]
