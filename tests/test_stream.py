"""The allocation stream written from depths 2, 3, 4 is the whole model's, event for event.

Checked against batchfit's own whole-model trace (checks the writing, not the fidelity to a GPU)."""

from __future__ import annotations

import pytest
import torch

from batchfit import StepOptions, Workload, get_device, load_workload
from batchfit.trace import depth, stream
from batchfit.trace.point import TracedCurve, replay_reserved
from batchfit.trace.session import TraceSession


# Llama 3.2 1B with 10 of its 16 blocks (conftest.fewer_blocks): the same blocks, still written
# from depths 2, 3, 4 past them, and a whole trace 10/16 as long
@pytest.mark.parametrize("spec,options", [
    pytest.param("hf:llama-3.2-1b", StepOptions(precision="bf16", checkpointing="full"), marks=pytest.mark.slow),
    pytest.param("hf:llama-3.2-1b", StepOptions(precision="bf16-mixed", optimizer="sgd-momentum"),
                 marks=pytest.mark.slow),
])
def test_the_written_stream_is_the_whole_models(spec, options, fewer_blocks):
    workload = load_workload(fewer_blocks(spec, 10), seq_len=32)
    seen = depth.Depth()
    streams = {}
    for d in depth.DEPTHS:
        with TraceSession(depth.at_depth(workload, d, seen), options) as session:
            session.trace(2, fresh=True)
            streams[d] = stream.without_cut(session.fresh_stream, seen.cuts[d])
    with TraceSession(workload, options) as session:
        session.trace(2, fresh=True)
        whole = session.fresh_stream
    written = stream.extend(streams, seen.blocks)
    assert written is not None and len(written) == len(whole)
    assert stream._canonical(written) == stream._canonical(whole)  # the same mallocs, the same frees, in order
    device = get_device("h100-80gb")
    assert replay_reserved(written, device) == replay_reserved(whole, device)


def _tiny_llama(blocks: int) -> Workload:
    def build():
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=blocks, num_attention_heads=2, num_key_value_heads=2,
                                            max_position_embeddings=32, attn_implementation="sdpa"))

    return Workload(name=f"llama-{blocks}l", build_model=build,
                    make_batch=lambda b, d: torch.randint(0, 256, (b, 16), device=d),
                    loss_fn=lambda m, x: m(input_ids=x, labels=x).loss, tokens_per_sample=16)


@pytest.mark.parametrize("options", [
    StepOptions(lora="r=8"),
    pytest.param(StepOptions(quantize="nf4-dq", lora="r=8", optimizer="paged-adamw-8bit", precision="bf16-mixed",
                             checkpointing="full"), marks=pytest.mark.slow),  # issue 21's QLoRA
], ids=["lora", "qlora"])
def test_an_adapters_only_stream_is_written_from_the_depths(options):
    """Only the adapters train: the optimizer's foreach ops run over the blocks' adapters alone,
    so a loop up the blocks meets one back down with nothing between (one insertion of both at
    their junction) and runs that look alike abut. Written, the stream is the whole model's."""
    if options.quantize != "none":
        pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    with TracedCurve(_tiny_llama(10), options, get_device("rtx4090-24gb"), keep_streams=True) as traced:
        assert traced.by_depth
        point = traced.reserved(2)
        assert traced.whole_reserved == []  # written from the depths, not traced whole
        written = traced._extended_stream(2)
    with TraceSession(_tiny_llama(10), options) as session:
        session.trace(2, fresh=True)
        whole = session.fresh_stream
    assert written is not None and stream._canonical(written) == stream._canonical(whole)
    assert point.peak_reserved_bytes == replay_reserved(whole, get_device("rtx4090-24gb"))[0]


@pytest.mark.slow
def test_reserved_by_depth_equals_reserved_traced_whole(fewer_blocks):
    workload = load_workload(fewer_blocks("hf:llama-3.2-1b", 10), seq_len=32)  # 10 of its 16 blocks
    options = StepOptions(precision="bf16-mixed", checkpointing="full")
    device = get_device("t4-16gb")
    found = []
    for by_depth in (True, False):
        with TracedCurve(workload, options, device, by_depth=by_depth, keep_streams=True) as traced:
            found.append([(p.peak_reserved_bytes, p.reserved_ratio) for p in map(traced.reserved, (4,))])
            assert traced.whole_reserved == ([] if by_depth else [4])
    assert found[0] == found[1]


def test_an_irregular_stream_falls_back_to_the_whole_model(monkeypatch):
    """Where the rules do not rewrite the depths' streams (``extend`` answers None) the reserved
    peak comes from a whole-model trace, and the result says so. GPT-2's stream, refused until
    the stream writer learnt split insertions and abutting runs, is written now: by depth or
    whole, the same reserved peak."""
    workload = load_workload("gpt2-124m", seq_len=32)
    peaks = []
    for refused in (False, True):
        if refused:
            monkeypatch.setattr(stream, "extend", lambda streams, blocks: None)
        with TracedCurve(workload, StepOptions(), get_device("t4-16gb"), keep_streams=True) as traced:
            assert traced.by_depth
            peaks.append(traced.reserved(2).peak_reserved_bytes)
            assert traced.whole_reserved == ([2] if refused else [])
    assert peaks[0] == peaks[1] > 0


def test_streams_that_are_not_runs_of_blocks_are_refused():
    def blocks(n: int, size: int) -> list:
        events, ident = [], 0
        for _ in range(n):
            ident += 1
            events += [("malloc", ident, size), ("free", ident, 0)]
        return events

    regular = {d: blocks(d, 512) for d in (2, 3, 4)}
    assert stream._canonical(stream.extend(regular, 32)) == stream._canonical(blocks(32, 512))
    bent = {2: blocks(2, 512), 3: blocks(3, 512), 4: blocks(4, 1024)}  # a block that changes with depth
    assert stream.extend(bent, 32) is None


def test_a_run_freeing_what_a_shorter_run_and_the_stream_around_it_allocated():
    """FSDP2's shape (see the next test): the backward allocates one gradient shard per block,
    the last ``edge`` blocks to run differently (outside the run), and zero_grad frees them in
    block order, so its first ``edge`` copies free fixed allocations. Two such copies at an end
    are written; three are not (nothing checks the backward run's rule then)."""
    def stream_of(d: int, edge: int) -> list:
        events, grads = [], {}
        for k in reversed(range(d)):  # backward: the last block first
            if k < edge:
                events += [("malloc", 1000 + k, 4), ("free", 1000 + k, 0)]
            grads[k] = k + 1
            events.append(("malloc", k + 1, 16))
        return events + [("free", grads[k], 0) for k in range(d)]

    written = stream.extend({d: stream_of(d, 2) for d in (2, 3, 4)}, 32)
    assert written is not None and stream._canonical(written) == stream._canonical(stream_of(32, 2))
    assert stream.extend({d: stream_of(d, 3) for d in (2, 3, 4)}, 32) is None


def test_without_cut_drops_the_cut_blocks_allocations():
    events = [("malloc", 1, 8), ("malloc", 2, 8), ("malloc", 3, 8), ("free", 2, 0), ("free", 3, 0),
              ("free", 1, 0)]
    assert stream.without_cut(events, (3, 5)) == [("malloc", 1, 8), ("free", 1, 0)]


@pytest.mark.slow
@pytest.mark.parametrize("strategy,gpus", [("fsdp", 2)])
def test_fsdp_rank_zeros_stream_is_written_from_the_depths(strategy, gpus):
    """FSDP2's backward run holds two blocks fewer than the depth (zero_grad then frees the last
    two backward blocks' gradient shards from outside any run, and at depth 2 the run is
    empty): rank 0's stream is still written from depths 2-4, equal to the whole model's."""
    from batchfit.plan.deep import DeepSession
    from batchfit.plan.reserved import replay_steps
    from batchfit.plan.sharded import parse_strategy
    from batchfit.zoo import language_model_workload
    from batchfit.zoo.transformer import Transformer, TransformerConfig

    cfg = TransformerConfig(vocab_size=256, seq_len=16, d_model=32, n_layers=10, n_heads=2, n_kv_heads=1, d_ff=64,
                            llama=True, tied_embeddings=False)
    workload = language_model_workload(name="tiny-llama-10", build_model=lambda: Transformer(cfg),
                                       vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, description="10 tiny blocks")
    device = get_device("h100-80gb")
    with DeepSession(workload, StepOptions(precision="bf16-mixed"), device, parse_strategy(strategy, gpus)) as deep:
        written, starts, written_streams = deep._extended(2)
        whole, whole_starts, whole_streams = deep._fresh(workload, 2)
    # each malloc on the stream it was made on, too (FSDP2's all-gather and reduce-scatter streams)
    assert sorted(set(written_streams.values())) == sorted(set(whole_streams.values())) == [1, 2]
    assert stream._canonical(stream.tag_streams(written, written_streams)) == \
        stream._canonical(stream.tag_streams(whole, whole_streams)) and starts == whole_starts
    assert replay_steps(written, starts, device, written_streams) == \
        replay_steps(whole, whole_starts, device, whole_streams)


def test_a_side_streams_malloc_rides_through_extension_in_its_size():
    """``tag_streams`` writes a side-stream malloc's size as a token of its own (not the default
    stream's malloc of the same bytes); ``untag_streams`` reads sizes and streams back."""
    events = [("malloc", 1, 8), ("malloc", 2, 8), ("free", 1, 0), ("malloc", 3, 4096), ("free", 2, 0)]
    tagged = stream.tag_streams(events, {2: 1, 3: 2})
    assert tagged == [("malloc", 1, 8), ("malloc", 2, -(8 * 64 + 1)), ("free", 1, 0),
                      ("malloc", 3, -(4096 * 64 + 2)), ("free", 2, 0)]
    assert stream.untag_streams(tagged) == (events, {2: 1, 3: 2})
    assert stream.tag_streams(events, {}) is events
