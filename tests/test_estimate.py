"""batchfit.estimate end to end on CPU: the answer is traced, and the edges are answers.

Checked against batchfit's own traces of the sizes around each answer (checks the search and its
edges, not the fidelity to a GPU: tests/test_memory.py and the profiler truths do that)."""

from __future__ import annotations

import dataclasses

import pytest

from batchfit import estimate, get_device, load_workload
from batchfit.devices import GiB, custom_device
from batchfit.errors import OptionError
from batchfit.workload import StepOptions
from cpu_truth import one_block_tinystories


@pytest.fixture(scope="module")
def tiny_on_4090():
    return estimate(load_workload("gpt-tinystories-22m", seq_len=128), device=get_device("rtx4090-24gb"))


def _fails(point, limit_bytes: int) -> bool:
    """Does not fit under a reserved limit: the allocator model ran out, or reserved (or, where
    allocated alone already exceeds the limit, allocated) passes it."""
    return point.reserved_oom is not None or max(point.peak_bytes, point.peak_reserved_bytes or 0) > limit_bytes


def test_max_batch_is_traced_and_the_next_size_is_not_fitting(tiny_on_4090):
    """Default limit: reserved memory, replayed through the allocator model."""
    r = tiny_on_4090
    assert r.limit == "reserved"
    for best, limit in ((r.max_batch_size, r.capacity_bytes), (r.max_batch_size_at_target, r.target_bytes)):
        assert best > 0
        point = r.point(best)
        assert point.peak_bytes <= point.peak_reserved_bytes <= limit and point.reserved_oom is None
        assert _fails(r.point(best + 1), limit)


def test_allocated_limit_is_the_allocated_peak(tiny_on_4090):
    r = estimate(load_workload("gpt-tinystories-22m", seq_len=128), device=get_device("rtx4090-24gb"),
                 limit="allocated")
    best = r.max_batch_size
    assert r.point(best).peak_bytes <= r.capacity_bytes < r.point(best + 1).peak_bytes
    assert r.point(best).peak_reserved_bytes is None  # nothing replayed: allocated decides
    reserved = tiny_on_4090  # the same model and GPU, the default limit (reserved)
    assert reserved.limit == "reserved" and reserved.max_batch_size <= best  # reserved >= allocated: never larger


def test_json_has_the_documented_keys(tiny_on_4090):
    j = tiny_on_4090.to_json()
    for key in ("params", "trainable_params", "points", "fit", "max_batch_size", "device",
                "max_batch_size_at_target", "headroom_bytes", "source"):
        assert key in j
    # by hand from the zoo's config (d 512, 4 Llama blocks, FFN 1344, vocab 10000, untied, RoPE):
    # embedding + head, each block's q/k/v/o, SwiGLU's three matrices and two RMSNorms, final norm
    d, ff, vocab, layers = 512, 1344, 10_000, 4
    assert j["params"] == 2 * vocab * d + layers * (4 * d * d + 3 * d * ff + 2 * d) + d == 22_696_448  # seed 002's
    point = j["points"][0]
    assert {"batch_size", "peak_bytes", "breakdown", "phase"} <= set(point)
    assert sum(point["breakdown"].values()) == point["peak_bytes"]


def test_multiple_of_is_respected():
    r = estimate(one_block_tinystories(seq_len=128), device=get_device("t4-16gb"), multiple_of=8)  # the search's rule
    assert r.max_batch_size % 8 == 0 and all(p.batch_size % 8 == 0 for p in r.points)
    assert _fails(r.point(r.max_batch_size + 8), r.capacity_bytes)


def test_batch_one_not_fitting_is_an_answer_with_suggestions(mlp):
    device = custom_device(int(0.6 * GiB))
    r = estimate(mlp, device=device)
    assert r.max_batch_size == 0
    # By hand: Linear(1024, 4096) + Linear(4096, 1024) in fp32 is P = 33,574,912 bytes (each
    # tensor a multiple of 512). AdamW's foreach step peaks holding parameters, gradients, two
    # states and one parameter-sized temporary, plus the loss (4 bytes in a 512-byte block);
    # the cuBLAS workspace comes on top. That does not fit 0.6 GiB less the 512 MiB context.
    P = (1024 * 4096 + 4096 + 4096 * 1024 + 1024) * 4
    one = r.points[0]
    assert (one.breakdown["parameters"], one.breakdown["gradients"], one.breakdown["optimizer_state"],
            one.breakdown["temporaries"]) == (P, P, 2 * P, P) and P == 33_574_912
    assert one.peak_bytes == 5 * P + 512 + device.workspace_bytes > r.capacity_bytes
    changes = {s.option: s for s in r.suggestions}
    assert changes["--precision bf16"].source == "traced"
    assert changes["--precision bf16"].peak_bytes < r.points[0].peak_bytes
    assert any(s.fits for s in r.suggestions)
    assert [p.batch_size for p in r.points] == [1]  # batch 2 cannot fit either: not traced
    assert r.to_json()["max_batch_size"] == 0
    # nothing that saves nothing: the MLP has no block stack, so no checkpointing row at all
    assert all(s.saving_bytes > 0 for s in r.suggestions) and "--checkpointing full" not in changes


def test_sharding_shards_every_per_parameter_category(mlp):
    """The optimizer-step peak holds parameters, gradients, state and the foreach temporaries,
    all per parameter: sharding over N GPUs divides all four (issue: temporaries were left whole)."""
    r = estimate(mlp, device=custom_device(int(0.6 * GiB)))
    smallest = r.points[0]
    assert smallest.phase == "optimizer"
    shard = next(s for s in r.suggestions if "shard over" in s.change)
    gpus = int(shard.option.split()[0])
    parts = smallest.breakdown
    per_param = parts["parameters"] + parts["gradients"] + parts["optimizer_state"] + parts["temporaries"]
    assert shard.saving_bytes == int(per_param * (1 - 1 / gpus))
    assert "temporaries" in shard.source


@pytest.mark.parametrize("kwargs", [{"target_util": 0}, {"target_util": 1.5}, {"multiple_of": 0},
                                    {"batch_sizes": [0, 8]}])
def test_bad_options_say_what_to_type(mlp, kwargs):
    with pytest.raises(OptionError):
        estimate(mlp, device=get_device("t4-16gb"), **kwargs)


def test_step_options_validate():
    with pytest.raises(OptionError, match="bf16-mixed"):
        StepOptions(precision="bfloat16")
    with pytest.raises(OptionError, match="none, full, selective or every:N"):
        StepOptions(checkpointing="some")


def test_a_model_built_outside_build_model_is_an_error_not_zero_bytes():
    """build_model=lambda: model hands the tracer real tensors it never saw being made."""
    import torch
    from torch import nn

    from batchfit.errors import ModelSpecError
    from batchfit.workload import Workload

    model = nn.Linear(64, 64)
    work = Workload(name="prebuilt", build_model=lambda: model,
                    make_batch=lambda b, device: torch.randn(b, 64, device=device),
                    loss_fn=lambda m, x: m(x).sum())
    with pytest.raises(ModelSpecError, match="construct the model inside build_model"):
        estimate(work, device=get_device("t4-16gb"))


def test_recurrent_layers_are_named_as_a_known_limit():
    """LSTM/GRU trace the CPU kernels, not cuDNN's: the result says so (issue 8 item 18)."""
    import torch
    from torch import nn

    from batchfit.workload import Workload

    work = Workload(name="lstm", build_model=lambda: nn.LSTM(32, 64, batch_first=True),
                    make_batch=lambda b, device: torch.randn(b, 16, 32, device=device),
                    loss_fn=lambda m, x: m(x)[0].sum())
    result = estimate(work, device=get_device("t4-16gb"), max_batch=64)
    assert len(result.known_limits) == 1 and "LSTM" in result.known_limits[0] and "cuDNN" in result.known_limits[0]
    assert result.to_json()["known_limits"] == result.known_limits
    assert estimate(load_workload("gpt-tinystories-22m", seq_len=16), device=get_device("t4-16gb"),
                    max_batch=8).known_limits == []


def test_multiple_of_with_a_known_size_off_the_grid_ends():
    """`estimate --multiple-of 8 --batch-sizes 8,21` with 21 too large used to loop forever.

    The device's usable memory is set halfway between the peaks of batch 16 and 21, traced
    here first (plus the cuBLAS workspace, which estimate adds): 16 fits and 21 does not."""
    import threading

    from batchfit.trace.session import TraceSession

    with TraceSession(load_workload("gpt-tinystories-22m", seq_len=64), StepOptions()) as session:
        peak16, peak21 = (session.trace(b).snapshot.peak_bytes for b in (16, 21))
    template = custom_device(8 * GiB)
    workspace = template.workspace_bytes
    device = custom_device(template.context_bytes + workspace + (peak16 + peak21) // 2)
    results = []
    worker = threading.Thread(target=lambda: results.append(estimate(
        load_workload("gpt-tinystories-22m", seq_len=64), device=device, batch_sizes=[8, 21], multiple_of=8,
        limit="allocated", suggest=False)), daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert results, "estimate did not end"
    assert results[0].max_batch_size == 16
    assert results[0].point(16).peak_bytes == peak16 + workspace  # the very step traced above


def test_every_point_says_whether_it_fits_as_the_answer_does(tiny_on_4090):
    # The terminal's and the report's "fits" column: a size above the answer that fits as
    # allocated but was not replayed does not fit either (a smaller one could not reserve).
    from batchfit.report.markdown import estimate_markdown

    r = tiny_on_4090
    verdicts = {p.batch_size: r.fits(p) for p in r.points}
    assert all((verdict == "yes") == (b <= r.max_batch_size) for b, verdict in verdicts.items()), verdicts
    assert [p["fits"] for p in r.to_json()["points"]] == [verdicts[p.batch_size] for p in r.points]
    refused = [p for p in r.points if p.reserved_oom]
    assert refused  # the allocator model ran out just above the answer
    markdown = estimate_markdown(r)
    assert all(f"- batch {p.batch_size}: {p.reserved_oom}" in markdown for p in refused)
    # a size between, fitting as allocated and never replayed (as gpt2-124m's 60 and 61 on an H100)
    between = dataclasses.replace(refused[0], batch_size=refused[0].batch_size + 1, reserved_oom=None)
    assert between.peak_reserved_bytes is None and between.peak_bytes <= r.capacity_bytes
    assert r.fits(between) == "no (a smaller batch cannot reserve)"
    # an answer capped by --max-batch says nothing about the sizes above it
    assert dataclasses.replace(r, capped=True).fits(between) == "not searched (above --max-batch)"
    # nothing fits because the smallest size cannot be reserved: said so, not "it needs less than usable"
    nothing = dataclasses.replace(r, points=[refused[0]], max_batch_size=0)
    assert nothing.why_smallest_does_not_fit().endswith(f"but the caching allocator cannot reserve them "
                                                        f"({refused[0].reserved_oom})")
    assert "cannot reserve them" in estimate_markdown(nothing)
