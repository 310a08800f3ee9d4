"""torch's ring attention written instead of run again (``distributed/written_ring.py``): exactly what running it makes.

Truth: the same sessions traced with every ring call run (``written_ring.ENABLED`` False, what
``BATCHFIT_WRITE_RING=0`` sets): the ShardedPoint (peak, breakdowns, phases, parts, FLOPs, collectives),
the fresh allocation stream and its side streams, and every allocation's op, shape, dtype, module, phase
and category, event for event, at several local batches.
"""

from __future__ import annotations

import warnings

import pytest

from batchfit.devices import get_device
from batchfit.distributed import written_ring
from batchfit.plan.deep import DeepSession
from batchfit.plan.sharded import ShardedSession, parse_strategy
from batchfit.workload import StepOptions
from batchfit.zoo.transformer import TransformerConfig
from cpu_truth import tiny_llama_workload
from tiny import deep_workload

CFG = TransformerConfig(vocab_size=512, seq_len=64, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=256,
                        llama=True, tied_embeddings=False)
BATCHES = (1, 3, 2, 3)


def _allocations(tracker) -> list[tuple]:
    return [(r.seq, r.nbytes, r.phase, r.op, r.shape, r.dtype, r.module, r.category, r.freed_seq)
            for r in tracker._window]


def _sharded(workload, name, world, options, write: bool, monkeypatch) -> list:
    monkeypatch.setattr(written_ring, "ENABLED", write)
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ShardedSession(workload, options, get_device("h100-80gb"), parse_strategy(name, world)) as session:
            for batch in BATCHES:
                point = session.trace(batch)
                seen.append((point, list(session.tracker.events), _allocations(session.tracker),
                             session.tracker.calls, session.tracker.flops))
            seen.append((session.fresh_stream, session.fresh_streams, session.fresh_steps))
    return seen


@pytest.mark.parametrize("name,world", [("fsdp+cp2", 4), ("fsdp+cp4+tp2", 8)])
@pytest.mark.parametrize("checkpointing", ["full", "none"])
def test_written_ring_is_what_running_it_makes(name, world, checkpointing, monkeypatch):
    options = StepOptions(precision="bf16-mixed", checkpointing=checkpointing)
    written = _sharded(tiny_llama_workload(CFG), name, world, options, True, monkeypatch)
    run = _sharded(tiny_llama_workload(CFG), name, world, options, False, monkeypatch)
    assert len(written) == len(run)
    for w, r in zip(written, run):
        assert w == r


@pytest.mark.slow
@pytest.mark.parametrize("name,world,checkpointing", [
    ("fsdp+cp4+tp2", 8, "full"), ("fsdp+cp2", 4, "none"),
    pytest.param("fsdp+cp2", 4, "full", marks=pytest.mark.extended),  # CI's 30 minutes: the other two
    pytest.param("fsdp+cp4+tp2", 8, "none", marks=pytest.mark.extended)])  # (the fast tier has all four)
def test_written_ring_in_a_deep_session(name, world, checkpointing, monkeypatch):
    options = StepOptions(precision="bf16-mixed", checkpointing=checkpointing)

    def traced(write: bool) -> list:
        monkeypatch.setattr(written_ring, "ENABLED", write)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            session = DeepSession(deep_workload(), options, get_device("h100-80gb"), parse_strategy(name, world))
            try:
                points = [session.trace(batch) for batch in (1, 2, 1)]
                depths = [(s.fresh_stream, s.fresh_streams, s.fresh_steps, list(s.tracker.events))
                          for s in session._depths]
            finally:
                session.close()
        return [points, depths]

    assert traced(True) == traced(False)


def test_repeats_are_written(monkeypatch):
    """The switch works: with writing on, most ring calls of a step are written, not run."""
    monkeypatch.setattr(written_ring, "ENABLED", True)
    runs = []
    original = written_ring._record

    def counted(tracker, run, mesh):
        runs.append(1)
        return original(tracker, run, mesh)

    monkeypatch.setattr(written_ring, "_record", counted)
    monkeypatch.setattr(written_ring, "_known", type(written_ring._known)())
    options = StepOptions(precision="bf16-mixed", checkpointing="full")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):  # a second session (its own fake world and mesh) writes what the first recorded
            with ShardedSession(tiny_llama_workload(CFG), options, get_device("h100-80gb"),
                                parse_strategy("fsdp+cp2", 4)) as session:
                session.trace(2)
    known = written_ring._known
    # 2 layers x (forward, recomputed forward, backward) x 2 steps = 12 calls; one per phase kept
    assert all(call is not None for call in known.values()), known
    assert len(runs) == len(known) == 3


def test_a_session_writes_what_another_recorded(monkeypatch):
    """Recorded calls are shared by the process's trackers (a reserved probe's fresh sessions, the depths): a
    session opened after another, at the same and at other sizes, traces what it would with nothing written."""
    options = StepOptions(precision="bf16-mixed", checkpointing="full")
    monkeypatch.setattr(written_ring, "_known", type(written_ring._known)())
    first = _sharded(tiny_llama_workload(CFG), "fsdp+cp2", 4, options, True, monkeypatch)
    second = _sharded(tiny_llama_workload(CFG), "fsdp+cp2", 4, options, True, monkeypatch)
    run = _sharded(tiny_llama_workload(CFG), "fsdp+cp2", 4, options, False, monkeypatch)
    assert first == second == run
