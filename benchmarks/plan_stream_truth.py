"""Rank 0's full-depth allocation stream written from depths 2-4 against the whole model's trace.

Llama-3.1-8B (32 blocks, seq 8192, bf16-mixed, full checkpointing) on 8 GPUs under ``fsdp``
(local batch 2) and ``fsdp+tp4`` (local batch 8): the stream ``trace/stream.py`` writes from the
depths 2, 3, 4 (``plan.deep.DeepSession._extended``, what ``plan --limit reserved`` replays) and
the stream of the whole model traced in a fresh sharded session, compared event for event, with
their step starts and their replays through the allocator model. The test suite checks a
10-block tiny Llama (``tests/test_stream.py``); this is the same check at the README's size.

    python benchmarks/plan_stream_truth.py
"""

from __future__ import annotations

import time

from _common import write_result
from batchfit import StepOptions, get_device, load_workload
from batchfit.plan.deep import DeepSession
from batchfit.plan.reserved import replay_steps
from batchfit.plan.sharded import parse_strategy
from batchfit.trace import stream

CASES = (("fsdp", 2), ("fsdp+tp4", 8))


def main() -> None:
    workload = load_workload("hf:llama-3.1-8b", seq_len=8192)
    device = get_device("h100-80gb")
    options = StepOptions(precision="bf16-mixed", checkpointing="full")
    rows = []
    for strategy, local_batch in CASES:
        started = time.perf_counter()
        with DeepSession(workload, options, device, parse_strategy(strategy, 8)) as deep:
            found = deep._extended(local_batch)
            whole, whole_starts, whole_streams = deep._fresh(workload, local_batch)
        seconds = time.perf_counter() - started
        row = {"strategy": strategy, "gpus": 8, "local_batch": local_batch, "written": found is not None,
               "whole_events": len(whole), "seconds": round(seconds, 1)}
        if found is not None:
            written, starts, written_streams = found
            mine = replay_steps(written, starts, device, written_streams)
            truth = replay_steps(whole, whole_starts, device, whole_streams)
            row |= {"written_events": len(written),
                    "same_stream": stream._canonical(stream.tag_streams(written, written_streams))
                    == stream._canonical(stream.tag_streams(whole, whole_streams)),
                    "same_step_starts": starts == whole_starts, "same_replay": mine == truth,
                    "peak_reserved_bytes_written": mine.peak_reserved_bytes,
                    "peak_reserved_bytes_whole": truth.peak_reserved_bytes}
        rows.append(row)
        print(row)
    path = write_result("plan_stream_truth", {"model": "hf:llama-3.1-8b", "seq_len": 8192,
                                              "options": "bf16-mixed, --checkpointing full", "cases": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
