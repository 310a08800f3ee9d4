"""A call's allocations written instead of run (trace/written.py): the same bytes, events and peaks as running it.

The truth is the tracer itself with the call run every time: the written trace must be equal to it in every
figure of every point and in the allocation stream, event for event (the allocator model replays that)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import batchfit.zoo.grpo as grpo
from batchfit.trace import forked
from batchfit.trace.memory import MemoryTracker
from batchfit.trace.stream import _canonical
from batchfit.workload import shape_only_call


def _calls(call, sizes, key="call"):
    """Run ``call(rows)`` through ``shape_only_call`` at each size under one tracker: (its mallocs'
    requested bytes per size, how each size was had)."""
    tracker = MemoryTracker(round_bytes=1)
    made = {}
    with FakeTensorMode(), tracker:
        for rows in sizes:
            start = len(tracker.events)
            out = shape_only_call(key, rows, torch.device("cpu"), lambda: call(rows))
            made[rows] = [n for kind, _, n in tracker.events[start:] if kind == "malloc"]
            assert out.shape[0] == rows
            del out
    return made, tracker.written


def _affine(rows):
    scratch = torch.empty(rows, 100)  # 400 B a row
    kept = torch.empty(rows, 3, dtype=torch.int64)  # 24 B a row: what the call returns
    del scratch
    return kept


def test_a_recorded_call_is_written_again_and_on_its_line_once_a_third_size_matched():
    made, calls = _calls(_affine, [8, 16, 40, 24, 16, 48])
    assert made == {8: [3200, 192], 16: [6400, 384], 40: [16000, 960], 24: [9600, 576], 48: [19200, 1152]}
    assert calls.summary() == {"traced": [8, 16, 40, 48], "repeated": [16], "line": [24], "checked_at": [40, 48]}
    assert calls.line_holds == {"call": True}


def test_a_call_not_on_a_line_runs_at_every_new_size():
    def squared(rows):
        return torch.empty(rows, rows)  # rows^2 x 4 B: 8 -> 256, 16 -> 1024, 24 -> 2304 (the line says 1792)

    made, calls = _calls(squared, [8, 16, 24, 20])
    assert made[20] == [1600]
    assert calls.summary()["line"] == [] and calls.line_holds == {"call": False}


def test_a_call_that_leaves_more_alive_than_its_result_is_never_written():
    held = []

    def keeps(rows):
        held.append(torch.empty(rows, 2))  # alive after the call: a cache a written call could not hold
        return torch.empty(rows, 1)

    made, calls = _calls(keeps, [8, 8, 16, 32, 24])
    assert calls.summary() == {"traced": [8, 16, 24, 32], "repeated": [], "line": [], "checked_at": []}


def _grpo_points(monkeypatch, workload, *, write: bool, sizes, options, ahead: bool = False):
    from batchfit.devices import get_device
    from batchfit.trace.point import TracedCurve
    from batchfit.workload import StepOptions

    if not write:
        monkeypatch.setattr(grpo, "shape_only_call", lambda key, rows, device, run: run())
    with TracedCurve(workload, StepOptions(**options), get_device("rtx4090-24gb"), keep_streams=True) as curve:
        if ahead:  # the second size in a forked copy of the session, meanwhile (search.trace_first_sizes)
            curve.trace_ahead(sizes[1])
        points = {b: (dataclasses.asdict(curve.point(b, fresh=True)), _canonical(curve._whole_streams[b]))
                  for b in sizes}
        written = curve._full.tracker.written
    monkeypatch.undo()
    return points, written.summary() if written else None


def _same_written_as_run(monkeypatch, workload, options, sizes=(8, 16, 40, 24), ahead=False):
    written, summary = _grpo_points(monkeypatch, workload, write=True, sizes=sizes, options=options, ahead=ahead)
    run, _ = _grpo_points(monkeypatch, workload, write=False, sizes=sizes, options=options)
    assert summary == {"traced": [8, 16, 40], "repeated": [8, 16, 40], "line": [24], "checked_at": [40]}
    for b in sizes:
        assert written[b] == run[b], b


def test_a_small_grpo_step_written_is_the_step_run(monkeypatch):
    """The zoo's GRPO step on a 2-layer GPT-2 shape (6 new tokens): every traced figure and every allocation
    event of a fresh process at four sizes, with the generation written (and the second size traced in a
    forked copy of the session meanwhile, as estimate does), equal those with it run each time."""
    from batchfit.options import Rollout
    from batchfit.zoo.transformer import TransformerConfig

    rollout = Rollout(prompt_len=8, new_tokens=6, group_size=2)
    cfg = TransformerConfig(seq_len=14, vocab_size=256, d_model=32, n_layers=2, n_heads=4, d_ff=64)
    workload = grpo.grpo_step(grpo._zoo_policy(cfg), rollout, cfg.vocab_size, name="small", description="small")
    _same_written_as_run(monkeypatch, workload, {}, ahead=forked.can_fork())


@pytest.mark.slow
def test_a_tiny_llamas_grpo_step_written_is_the_step_run(monkeypatch, tmp_path):
    """TRL's GRPO step on a 2-layer Llama (transformers' DynamicCache, 6 new tokens)."""
    import transformers

    from batchfit.options import Rollout
    from batchfit.zoo.hf_grpo import hf_grpo_workload

    transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=256, max_position_embeddings=128
                             ).save_pretrained(tmp_path)
    workload = hf_grpo_workload(str(tmp_path), Rollout(prompt_len=8, new_tokens=6, group_size=2))
    _same_written_as_run(monkeypatch, workload, {})


@pytest.mark.slow
def test_seed_003s_grpo_step_written_is_the_step_run(monkeypatch):
    """Seed 003's GRPO step (GPT-2 small, 4 new tokens). bf16, and every causal family of the support matrix
    in fp32 and bf16: benchmarks/written_families.py."""
    from batchfit.specs import load_workload

    _same_written_as_run(monkeypatch, load_workload("grpo-gpt2-124m", seq_len=4), {})


@pytest.mark.slow
def test_how_the_loop_was_had_is_read_back_from_the_trace_cache():
    # estimate asked again reads its sizes from the cache: its JSON and report must still say which sizes'
    # loops were written, and from which line (the same as the run that traced them)
    from batchfit.devices import get_device
    from batchfit.specs import load_workload
    from batchfit.trace.point import TracedCurve
    from batchfit.workload import StepOptions

    workload, device = load_workload("grpo-gpt2-124m", seq_len=2), get_device("rtx4090-24gb")
    sizes = [8, 16, 40, 24]
    with TracedCurve(workload, StepOptions(), device, keep_streams=True, cache=True) as first:
        for b in sizes:
            first.point(b)
        traced = first.written_generation
    with TracedCurve(workload, StepOptions(), device, keep_streams=True, cache=True) as again:
        for b in sizes:
            again.point(b)
        assert again._first is None  # read, nothing built
        assert again.written_generation == traced == {
            "traced": [8, 16, 40], "repeated": [8, 16, 40], "line": [24], "checked_at": [40]}
