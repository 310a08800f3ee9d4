"""A fresh stream at another batch size written from the line through traced ones (``trace/stream_line.py``).

By hand: streams whose malloc sizes are 10 b + 4 and 8 b bytes are written at b = 4 as 44 and 32 bytes,
only once a third traced size matched the line, and only between the traced sizes. On the real tracer: a
plan probe's replay written from the line is the traced replay at that size, byte for byte (the tiny
twelve-block Llama under fsdp and fsdp+cp2), and a plan that writes its probes answers what one that traces
every probe answers.

Checked by hand, and against batchfit's own traced streams (checks the writing, not the fidelity to a GPU).
"""

from __future__ import annotations

import pytest

from batchfit.devices import DEFAULT_CONTEXT_BYTES, custom_device, get_device
from batchfit.trace.stream_line import StreamLine, rounds_by_batch
from batchfit.workload import StepOptions
from tiny import deep_workload


def stream(b: int, *, extra: bool = False):
    events = [("malloc", 0, 100), ("malloc", 1, 10 * b + 4), ("free", 1, 0), ("malloc", 2, 8 * b)]
    return events + ([("malloc", 3, 16)] if extra else []), (1,), {}


def test_the_line_writes_a_size_only_once_a_third_matched_it_and_only_between():
    line = StreamLine()
    line.add(1, stream(1))
    line.add(5, stream(5))
    assert line.at(3) is None and line.checked == ()  # two sizes: nothing checked the line yet
    line.add(2, stream(2))
    assert line.checked == (1, 5, 2)
    events, starts, sides = line.at(4)
    assert events == [("malloc", 0, 100), ("malloc", 1, 44), ("free", 1, 0), ("malloc", 2, 32)]
    assert (starts, sides) == ((1,), {})
    assert line.at(6) is None and line.at(0) is None  # outside the traced sizes
    assert line.summary() == {"written": [4], "through": [1, 5], "checked_at": [2]}


def test_a_count_rounded_from_the_batch_is_written_only_on_the_traced_sizes_lattice():
    # an MoE's tokens per expert, balanced with a remainder: ceil(99 x 2 b / 8) tokens of 128 bytes; at 2, 6
    # and 10 (49.5, 148.5, 247.5 routed over 8 experts) the first expert's 50, 149, 248 lie on one line
    def moe(b: int):
        return [("malloc", 0, 128 * -(-198 * b // 8))], (), {}

    plain, line = StreamLine(), StreamLine(lattice=True)
    for b in (2, 10, 6):
        plain.add(b, moe(b))
        line.add(b, moe(b))
    assert line.checked == (2, 10, 6)
    assert plain.at(4)[0] == [("malloc", 0, 12_736)]  # a plain line's 99.5 tokens: the step routes 99 (12,672 B)
    assert line.at(4) is None and line.at(8) is None and line.at(3) is None  # off 2, 6, 10 (differences 4, 8)
    odd = StreamLine(lattice=True)
    for b in (2, 10, 5):
        odd.add(b, moe(b))
    assert odd.checked == ()  # 5: 124 tokens (123.75 routed), not the line's 124.25
    assert rounds_by_batch(moe=True, expert_parallel=False, tokens_per_sample=4096)
    assert rounds_by_batch(moe=False, expert_parallel=False, tokens_per_sample=99)  # ceil(rows / 32): the norm's
    assert not rounds_by_batch(moe=False, expert_parallel=False, tokens_per_sample=8192, split=8)  # 1,024 a rank


def test_other_events_inside_the_line_leave_it_unchecked():
    # the fused-linear loss: 4 chunks at 4 and 8, 3 at 5 and 6 (train/losses.py: _chunk_size, 128-token rows)
    line = StreamLine()
    for b, chunks in ((4, 4), (8, 4), (5, 3), (6, 4)):
        line.add(b, ([("malloc", i, 10 * b) for i in range(chunks)], (), {}))
    assert line.checked == () and line.at(7) is None  # 5's three chunks: the line's events change between 4 and 8


def test_a_step_that_chooses_its_chunks_by_the_batch_is_refused_by_name():
    from batchfit.trace.stream_line import refusal

    assert refusal(StepOptions(loss="chunked:4")) is None and refusal(StepOptions()) is None
    assert "power of two" in refusal(StepOptions(loss="fused-linear"))
    line = StreamLine(refused=refusal(StepOptions(loss="fused-linear")))
    for b in (1, 5, 2):
        line.add(b, stream(b))
    assert line.checked == (1, 5, 2) and line.at(4) is None and line.summary()["written"] == []


def test_a_third_size_that_differs_leaves_the_line_unchecked():
    line = StreamLine()
    for b in (1, 5):
        line.add(b, stream(b))
    line.add(3, stream(3, extra=True))  # one more malloc at 3: not the line
    assert line.checked == () and line.at(4) is None
    off = StreamLine()
    for b, events in ((1, [("malloc", 0, 10)]), (3, [("malloc", 0, 15)]), (5, [("malloc", 0, 20)])):
        off.add(b, (events, (), {}))
    assert off.checked == (1, 5, 3) and off.at(2) is None  # 12.5 bytes at 2: not a whole number, not written


@pytest.mark.parametrize("strategy,gpus", [pytest.param("fsdp", 2, marks=pytest.mark.slow), ("fsdp+cp2", 4)])
def test_a_written_replay_is_the_traced_one(strategy, gpus):
    from batchfit.plan.deep import DeepSession
    from batchfit.plan.sharded import ShardedSession, parse_strategy

    h100, options = get_device("h100-80gb"), StepOptions(precision="bf16-mixed", checkpointing="full")
    s = parse_strategy(strategy, gpus)
    opened = []
    counting = lambda *a, **k: opened.append(1) or ShardedSession(*a, **k)  # noqa: E731
    with DeepSession(deep_workload(), options, h100, s, session=counting) as deep, \
            DeepSession(deep_workload(), options, h100, s) as other:
        deep.trace(1)
        deep.reserved(5)  # traced; the depth sessions' first trace (size 1) is the line's other end
        deep.reserved(4)  # traced: checks the line through 1 and 5
        before = len(opened)
        written = deep.reserved(3)
        assert len(opened) == before and written.written  # no session opened: written from the line
        other.trace(1)
        traced = other.reserved(3)
    assert deep.line.summary() == {"written": [3], "through": [1, 5], "checked_at": [4]}
    assert not traced.written and written.to_json() == traced.to_json()


@pytest.mark.slow  # two plans of the 12-block Llama, each size probed traced and written (about 45 s)
@pytest.mark.extended  # CI's 30 minutes: the written replays' own truths above run in CI
def test_a_plan_that_writes_its_probes_answers_what_tracing_them_answers(monkeypatch):
    from batchfit.plan.engine import plan
    from batchfit.plan.world import World
    from batchfit.report.plan_markdown import plan_markdown

    def run():
        # the CUDA context, cuBLAS's workspace and about 3 MB: local batches in the tens (43,840 B a sample)
        device = custom_device(DEFAULT_CONTEXT_BYTES + get_device("h100-80gb").workspace_bytes + 9 * 2**20)
        return plan(deep_workload(), device=device, worlds=[World(2)], strategies="fsdp",
                    options=StepOptions(precision="bf16-mixed", checkpointing="full"))

    result = run()
    written = result.plans[0]
    monkeypatch.setattr(StreamLine, "at", lambda self, size: None)
    traced = run().plans[0]
    assert written.reserved_written["written"] and not traced.reserved_written
    fields = ("max_local_batch", "micro_batch", "peak_bytes_at_micro", "peak_reserved_bytes_at_micro", "peak_step")
    assert {f: getattr(written, f) for f in fields} == {f: getattr(traced, f) for f in fields}
    by_size = {p.local_batch: p.reserved for p in traced.points if p.reserved}
    for only in written.replayed_only:  # each size replayed alone: what tracing it replayed
        assert only.reserved.to_json() == by_size[only.local_batch].to_json()
    report = plan_markdown(result)  # each size only replayed has its row, and the line is named
    assert all(f"| 2 | fsdp | {p.local_batch} | not traced |" in report for p in written.replayed_only)
    assert "written from the line through the streams traced at" in report
    row = result.to_json()["strategies"][0]
    assert row["reserved_written"] == written.reserved_written
    assert [p["local_batch"] for p in row["replayed_only"]] == [p.local_batch for p in written.replayed_only]
