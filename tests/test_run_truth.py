"""Truth for ``estimate --data --batching`` (issue 32): the run, not the step.

A REAL multi-step training loop on this CPU over a dataset with a long-tailed length
distribution, pad-longest batches in the data's order, each step's allocated peak measured by
the torch profiler (tests/cpu_truth.py), against the per-step peaks the trace predicts with CPU
semantics (``estimator.run.step_peaks``) and the step the run logic names as the peak
(``batching.peak_step``: it asks about the deciding steps only).

The data: 24 samples whose lengths are drawn from a lognormal (numpy's default_rng(32),
mean 3.0, sigma 0.7 of the log: median e^3 = 20 tokens), clipped to 4..96 tokens, batch 4:
6 steps of 4 rows, each padded to its longest sample.

Checked against torch's own code running for real (a multi-step CPU loop under the profiler) over batchfit's own
pad-longest batches (checks the run's counting, not a collator's fidelity).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from batchfit.devices import custom_device
from batchfit.estimator.batching import (
    Batching,
    Shape,
    peak_step,
    step_shapes,
    token_rows,
)
from batchfit.estimator.engine import estimate
from batchfit.estimator.request import EstimateRequest, RunRequest
from batchfit.estimator.run import Lengths, estimate_run, step_peaks
from batchfit.train.step import TrainingStep
from batchfit.workload import StepOptions
from batchfit.zoo.transformer import TransformerConfig
from cpu_truth import profiled_step_peak, same_kernels_on_any_x86, tiny_llama_workload

MAX_LEN, BATCH = 96, 4


def tiny(seq_len: int | None):
    return tiny_llama_workload(TransformerConfig(vocab_size=512, seq_len=seq_len or MAX_LEN, d_model=64, n_layers=2,
                                                 n_heads=4, d_ff=128, llama=True, tied_embeddings=False))


def long_tailed_lengths() -> list[int]:
    rng = np.random.default_rng(32)
    return [int(n) for n in np.clip(rng.lognormal(mean=3.0, sigma=0.7, size=24), 4, MAX_LEN)]


def test_the_data_is_long_tailed_and_its_longest_batch_is_not_the_first():
    lengths = long_tailed_lengths()
    shapes = step_shapes(lengths, Batching("pad-longest"), BATCH, MAX_LEN)
    assert np.median(lengths) < max(lengths) / 2  # a tail: the longest is more than twice the median
    assert max(range(len(shapes)), key=lambda i: shapes[i].length) != 0
    assert len({s.length for s in shapes}) == len(shapes)  # every step its own length: one longest


@pytest.mark.slow  # 15 s here each: six profiled steps
@pytest.mark.parametrize("recipe", [{}, {"precision": "bf16-mixed"}, {"checkpointing": "full"}],
                         ids=["fp32", "bf16-mixed", "full"])
def test_each_steps_traced_peak_is_the_real_loops_within_one_percent(tmp_path, recipe):
    """Measured 2026-11-28: every step within 60 B of the profiler (0.002%) in each recipe, e.g. step 1
    (4 x 65 tokens) traced 6,387,704 B, measured 6,387,764 B in fp32 (5,452,280 / 5,452,340 B in
    bf16-mixed, 3,846,792 / 3,846,852 B with full checkpointing); the peak at step 1 in both."""
    lengths = long_tailed_lengths()
    shapes = step_shapes(lengths, Batching("pad-longest"), BATCH, MAX_LEN)
    options = StepOptions(**recipe)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        predicted = step_peaks(Lengths(tiny, MAX_LEN), shapes, options, cuda_semantics=False)
        real = Lengths(tiny, MAX_LEN)
        torch.manual_seed(0)
        measured = []
        with same_kernels_on_any_x86():
            step = TrainingStep(real.varying([s.length for s in shapes]), options, torch.device("cpu"))
            real.length = shapes[0].length
            step.run(shapes[0].rows)  # the optimizer state, made as in the trace's warm-up step
            for shape in shapes:  # the loop: one step per batch, in the data's order, the same optimizer
                real.length = shape.length
                measured.append(profiled_step_peak(step, shape.rows, tmp_path, warmup=0))
    for i, (p, m) in enumerate(zip(predicted, measured)):
        assert p == pytest.approx(m, rel=0.01), f"step {i} ({shapes[i]}): traced {p:,} B, measured {m:,} B"
    # why only the deciding steps are traced: at 4 rows the peak grows with the tokens per row,
    # in the real loop as in the trace
    by_length = sorted(range(len(shapes)), key=lambda i: shapes[i].length)
    assert [measured[i] for i in by_length] == sorted(measured)
    assert [predicted[i] for i in by_length] == sorted(predicted)
    # the run logic names the peak step from the deciding steps alone; the loop agrees
    named = peak_step(shapes, lambda shape: predicted[shapes.index(shape)])
    assert named == int(np.argmax(measured))
    assert predicted[named] == max(predicted)


def test_the_one_shape_answer_fits_but_a_late_long_batch_does_not():
    """40 samples of 12 tokens and one of 96 at sample 37 (step 9 at batch 4): at the first
    batch's length the estimate fits a batch that the run's step 9 cannot hold."""
    lengths = [12] * 41
    lengths[37] = MAX_LEN
    device = custom_device((512 + 64 + 5) * 2**20)  # 5 MiB past the CUDA context and cuBLAS
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        answer = estimate(tiny(12), device=device, limit="allocated").max_batch_size
        result = estimate_run(tiny, lengths, RunRequest(data="late.jsonl", batching=Batching("pad-longest")),
                              EstimateRequest(limit="allocated", batch_sizes=[answer]), device=device)
    assert result.run.max_batch_size < answer <= len(lengths)
    shapes = step_shapes(lengths, Batching("pad-longest"), answer, MAX_LEN)
    late = next(i for i, s in enumerate(shapes) if s.length == MAX_LEN)
    run = result.run.runs[answer]
    assert run.verdict == "does not fit" and run.first_oom_step == late and run.peak_step == late
    assert run.longest_sample == 37  # the sample to look at
    assert run.first_oom_shape == Shape(min(answer, len(lengths) - late * answer), MAX_LEN)
    point = next(p for p in result.to_json()["points"] if p["batch_size"] == answer)  # and the JSON
    assert {k: point["run"][k] for k in ("peak_step", "verdict", "first_oom_step")} == {
        "peak_step": late, "verdict": "does not fit", "first_oom_step": late}
    assert point["run"]["peak_bytes"] == run.peak_bytes and "peak_reserved_bytes" in point["run"]
    # the terminal and report.md say it: the run's answer, and for the one-shape answer which step and why
    from batchfit.report.run_markdown import run_lines, run_markdown

    assert run_lines(result)[1].startswith(f"the run: batch {result.run.max_batch_size} fits every step of the data")
    rows = run.first_oom_shape.rows
    assert (f"| {answer} | {len(shapes)} | does not fit | {late} | {rows} x {MAX_LEN} | " in run_markdown(result)
            and f"| {late} ({rows} x {MAX_LEN}) |" in run_markdown(result))


def test_the_allocator_replay_runs_out_at_the_first_step_past_the_device():
    """The replay of the run's steps (estimator/churn.py): each step's peak allocated in the replay
    is that step's own trace (plus the cuBLAS workspace, which the replay's allocator holds from the
    start) from step 1 on (step 0 also makes the optimizer state); on a device between two steps'
    peaks the default allocator cannot place a block first at the first step over it, in the data's
    order (expandable segments map 20 MiB pages: on this 69 MiB device they run out in the cuBLAS
    workspaces, before step 0)."""
    from batchfit.devices import DEFAULT_CONTEXT_BYTES
    from batchfit.estimator.churn import Churn, replay, step_streams
    from batchfit.trace.allocator import AllocatorConfig

    lengths = long_tailed_lengths()
    shapes = step_shapes(lengths, Batching("pad-longest"), BATCH, MAX_LEN)[:3]  # 4 x 37, 65, 25 tokens
    options, config = StepOptions(), AllocatorConfig()
    roomy = custom_device(2**30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        own = step_peaks(Lengths(tiny, MAX_LEN), shapes, options)
        events, marks = step_streams(Lengths(tiny, MAX_LEN), shapes, options)
    steps = replay(events, marks, shapes, roomy, config, "default").steps
    assert len(steps) == len(shapes)
    assert [s.peak_allocated_bytes for s in steps[1:]] == [p + roomy.workspace_bytes for p in own[1:]]
    assert [s.reserved_bytes for s in steps] == sorted(s.reserved_bytes for s in steps)  # room: the cache only grows
    # a device whose usable bytes fall between the longest step's peak and the largest before it
    longest = max(range(1, len(shapes)), key=lambda i: own[i])
    usable = (max(own[:longest]) + own[longest]) // 2 + roomy.workspace_bytes
    tight = custom_device(usable + DEFAULT_CONTEXT_BYTES)
    run = Churn(BATCH, replay(events, marks, shapes, tight, config, "default"),
                replay(events, marks, shapes, tight, AllocatorConfig(expandable_segments=True), "expandable"))
    assert run.verdict == f"does not fit, first at step {longest}"
    assert len(run.default.steps) == longest and "Tried to allocate" in run.default.oom
    assert run.expandable.first_oom_step == 0


@pytest.mark.slow  # 9 s here: about 12 traces of growing rows, and two estimates to check the answer
def test_a_token_budget_answers_whether_it_fits_and_the_largest_that_does():
    """tokens:N on the long-tailed data: the worst row at N=96 fits a device of 5 MiB past the
    context and cuBLAS; the longest single row that fits is found (doubling, then bisection to
    1/64), and an estimate at that length on its own agrees (fits; 1/32 longer does not)."""
    lengths = long_tailed_lengths()
    device = custom_device((512 + 64 + 5) * 2**20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = estimate_run(tiny, lengths, RunRequest(data="tail.jsonl", batching=Batching("tokens", MAX_LEN),
                                                          replay_steps=2), EstimateRequest(limit="allocated"),
                              device=device)
        run = result.run
        assert run.runs[1].verdict == "fits" and run.fits_up_to > MAX_LEN
        assert estimate(tiny(run.fits_up_to), device=device, limit="allocated", max_batch=1).max_batch_size == 1
        over = run.fits_up_to + run.fits_up_to // 32
        assert estimate(tiny(over), device=device, limit="allocated", max_batch=1).max_batch_size == 0
    assert run.largest_budget >= run.fits_up_to
    assert max(token_rows(lengths, run.largest_budget)) <= run.fits_up_to
    from batchfit.report.run_markdown import run_lines

    assert any(line.startswith("allocator replay of ") for line in run_lines(result))  # the terminal says it too


def test_the_worst_order_replay_is_reported_beside_the_datas():
    """--replay-order worst on the long-tailed data's first 3 steps at batch 4 (4 x 37, 65, 25 tokens): the
    JSON and the terminal carry the data order's replay and the worse of the ascending and alternating ones."""
    from batchfit.estimator.churn import ORDERS
    from batchfit.report.run_markdown import run_lines, run_markdown

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = estimate_run(tiny, long_tailed_lengths()[:12],
                              RunRequest(data="tail.jsonl", batching=Batching("pad-longest"), replay_steps=3,
                                         replay_order="worst"),
                              EstimateRequest(limit="allocated", batch_sizes=[BATCH], max_batch=BATCH),
                              device=custom_device(2**30))
    worst = result.run.churn_worst
    assert worst.order in ORDERS and len(worst.default.steps) == 3 and worst.verdict == "fits"
    assert sorted(s.length for s in worst.default.steps) == [25, 37, 65]
    assert result.to_json()["run"]["churn_worst_order"]["order"] == worst.order
    assert any(line.startswith(f"allocator replay of 3 steps at batch {BATCH} in {worst.order} order: fits")
               for line in run_lines(result))
    assert f"{worst.order} order (the worst of those tried)" in run_markdown(result)
