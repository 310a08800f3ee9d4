"""A traced step of N accumulated micro-batches runs two and writes the rest as repeats of the
second: its peak, breakdowns and allocation stream (so its reserved peak) are those of the
step traced with all N micro-batches run, exactly (MemoryTracker.repeat_micro_batch).

Checked against batchfit's own trace of every micro-batch run (checks the counting, not the fidelity to a GPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from batchfit import StepOptions, Workload, get_device
from batchfit.trace import depth, repeats, stream
from batchfit.trace.point import replay_reserved
from batchfit.trace.session import TraceSession


def _tiny_llama() -> Workload:
    def build():
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                            max_position_embeddings=32, attn_implementation="sdpa"))

    return Workload(name="llama-2l", build_model=build,
                    make_batch=lambda b, d: torch.randint(0, 256, (b, 16), device=d),
                    loss_fn=lambda m, x: m(input_ids=x, labels=x).loss, tokens_per_sample=16)


def _traced(options: StepOptions, *, repeat: bool):
    with TraceSession(_tiny_llama(), options) as session:
        session.tracker.repeats_micro_batches = repeat
        point = session.trace(2, fresh=True)
        return point.snapshot, session.fresh_stream, session.tracker.micro_batches_run


@pytest.mark.parametrize("precision,checkpointing,accumulation", [
    ("fp32", "none", 4), pytest.param("fp32", "full", 4, marks=pytest.mark.slow),
    pytest.param("bf16-mixed", "none", 4, marks=pytest.mark.slow), ("bf16-mixed", "full", 4),
    pytest.param("fp32", "full", 8, marks=pytest.mark.slow),
    pytest.param("bf16-mixed", "none", 8, marks=pytest.mark.slow),
])
def test_repeated_micro_batches_are_the_full_trace(precision, checkpointing, accumulation):
    options = StepOptions(precision=precision, checkpointing=checkpointing, accumulation_steps=accumulation)
    short, short_stream, ran = _traced(options, repeat=True)
    full, full_stream, full_ran = _traced(options, repeat=False)
    assert ran == 2 * 2 and full_ran == 2 * accumulation  # warm-up step and measured step: two micro-batches each
    assert short == full  # peak, phase, breakdowns by phase and part, largest tensors
    assert stream._canonical(short_stream) == stream._canonical(full_stream)
    device = get_device("h100-80gb")
    assert replay_reserved(short_stream, device) == replay_reserved(full_stream, device)


def test_a_step_without_accumulation_or_wrapped_runs_every_micro_batch():
    with TraceSession(_tiny_llama(), StepOptions(accumulation_steps=3, offload="activations")) as session:
        assert not session.tracker.repeats_micro_batches  # offload: host bytes add up per micro-batch
        session.trace(2)
        assert session.tracker.micro_batches_run == 2 * 3


class _Remembers(torch.nn.Module):
    """Keeps a tensor from every forward: each micro-batch leaves something new alive, so the
    second is not the pattern of the third, and the step must run them all."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(32, 32)
        self.kept: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        self.kept.append(y.detach().sum(0))
        return y.square().mean()


def test_micro_batches_that_leave_more_alive_each_time_all_run():
    workload = Workload(name="remembers", build_model=_Remembers,
                        make_batch=lambda b, d: torch.randn(b, 32, device=d), loss_fn=lambda m, x: m(x))
    options = StepOptions(accumulation_steps=4)
    with TraceSession(workload, options) as session:
        assert session.tracker.repeats_micro_batches
        peak = session.trace(8, fresh=True).snapshot
        assert session.tracker.micro_batches_run == 2 * 4  # the check refused: none written
    with TraceSession(workload, options) as session:
        session.tracker.repeats_micro_batches = False
        assert session.trace(8, fresh=True).snapshot == peak


def _llama(blocks: int) -> Workload:
    workload = _tiny_llama()

    def build():
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=blocks, num_attention_heads=2, num_key_value_heads=2,
                                            max_position_embeddings=32, attn_implementation="sdpa"))

    return dataclasses.replace(workload, name=f"llama-{blocks}l", build_model=build)


@pytest.mark.parametrize("precision,accumulation", [pytest.param("fp32", 4, marks=pytest.mark.slow),
                                                    pytest.param("bf16-mixed", 8, marks=pytest.mark.slow)])
def test_the_reserved_stream_is_extended_folded_then_written(precision, accumulation):
    """Depth extension runs on the two-micro-batch streams (the written ones folded into marks,
    trace/repeats.py), then writes micro-batches 3..N at full depth, as TracedCurve's
    ``_extended_stream`` does: the stream is the whole model's traced with every micro-batch
    run, event for event, and so is its reserved peak."""
    options = StepOptions(precision=precision, accumulation_steps=accumulation)
    seen, folded = depth.Depth(), {}
    for d in depth.DEPTHS:
        with TraceSession(depth.at_depth(_llama(depth.MIN_BLOCKS), d, seen), options) as session:
            session.trace(2, fresh=True)
            assert sum(kind == "repeat" for kind, _, _ in session.fresh_folded) == 2  # warm-up and measured step
            folded[d] = stream.without_cut(session.fresh_folded, seen.cuts[d])
    written = stream.extend(folded, 5)  # any depth: 5 keeps the whole trace below cheap
    assert written is not None
    written = repeats.unfold(written)
    with TraceSession(_llama(5), options) as session:
        session.tracker.repeats_micro_batches = False
        session.trace(2, fresh=True)
        whole = session.fresh_stream
    assert stream._canonical(written) == stream._canonical(whole)
    device = get_device("a100-40gb")
    assert replay_reserved(written, device) == replay_reserved(whole, device)


def test_fold_and_unfold_by_hand():
    """Micro-batch 1 allocates a (its loss, left alive), micro-batch 2 frees a and leaves b;
    two written copies each free what the one before left; the optimizer then frees the last."""
    events = [("malloc", 1, 8), ("malloc", 2, 4), ("free", 2, 0),  # micro-batch 1: 1 survives
              ("malloc", 3, 8), ("free", 1, 0), ("malloc", 4, 4), ("free", 4, 0),  # micro-batch 2: 3 survives
              ("malloc", 5, 8), ("free", 3, 0), ("malloc", 6, 4), ("free", 6, 0),  # copy 1
              ("malloc", 7, 8), ("free", 5, 0), ("malloc", 8, 4), ("free", 8, 0),  # copy 2
              ("free", 7, 0)]
    folded = repeats.fold(events, [(3, 7, 2)])
    assert folded == [("malloc", 1, 8), ("malloc", 2, 4), ("free", 2, 0), ("begin", -1, 0),
                      ("malloc", 3, 8), ("free", 1, 0), ("malloc", 4, 4), ("free", 4, 0), ("repeat", -1, 2),
                      ("free", 3, 0)]
    assert stream._canonical(repeats.unfold(folded)) == stream._canonical(events)
    with pytest.raises(repeats.NotFolded):  # what micro-batch 2 frees (8 B) is not what it leaves (4 B)
        repeats.unfold([("malloc", 1, 8), ("begin", -1, 0), ("malloc", 2, 4), ("free", 1, 0), ("repeat", -1, 1)])
