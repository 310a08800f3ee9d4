"""How long one reserved peak of the GRPO step takes once its depths are traced: the stream
written at full depth (``trace/stream.py``: the diff of two depths' streams, then the rules)
and its replay through the allocator model (``trace/allocator.py``).

Issue 34: ``batchfit estimate grpo-gpt2-124m --gpu rtx4090-24gb`` took 4,546 s, most of it
here. The profile put it in the diff: difflib's longest-match search visits every pair of equal
events per call, and a generation loop's stream has few distinct events (n^3 in all). The
allocator replay itself is linear (about 15 us an event). ``before`` runs the extension with
difflib's own SequenceMatcher (what stream.extend used before trace/matching.py), ``after``
with FastMatcher; both must write the same stream, event for event, and replay to the same
reserved peak. ``before`` is timed only up to --before-max-tokens new tokens (at 144 one diff
takes half an hour).

    python benchmarks/replay_speed.py                       # 16, 32 and 144 new tokens, batch 8
    python benchmarks/replay_speed.py --tokens 16 --before-max-tokens 16
"""

from __future__ import annotations

import argparse
import difflib
import os
import time

from _common import write_result
from batchfit.devices import get_device
from batchfit.trace import matching, repeats, stream
from batchfit.trace.point import TracedCurve, replay_reserved
from batchfit.workload import StepOptions
from batchfit.zoo.grpo import grpo_workload


def _difflib_matcher(a, b):
    return difflib.SequenceMatcher(None, a, b, autojunk=False)


def _extend(streams: dict, blocks: int, matcher) -> tuple[list, float]:
    saved = stream.FastMatcher
    stream.FastMatcher = matcher
    try:
        started = time.perf_counter()
        events = repeats.unfold(stream.extend(streams, blocks))
        return events, time.perf_counter() - started
    finally:
        stream.FastMatcher = saved


def measure(new_tokens: int, batch_size: int, before: bool) -> dict:
    device = get_device("rtx4090-24gb")
    started = time.perf_counter()
    with TracedCurve(grpo_workload(new_tokens), StepOptions(), device, keep_streams=True, parallel=False) as curve:
        curve.point(batch_size, fresh=True)
        traced_s = time.perf_counter() - started
        streams = {d: stream.without_cut(events, curve._seen.cuts.get(d))
                   for d, events in curve._streams[batch_size].items()}
        blocks = curve.blocks
    row = {"new_tokens": new_tokens, "batch_size": batch_size, "load_average_1m": os.getloadavg()[0],
           "trace_depths_s": round(traced_s, 1),
           "events_by_depth": {d: len(e) for d, e in streams.items()}}
    events, row["extend_after_s"] = _extend(streams, blocks, matching.FastMatcher)
    row["events_full_depth"] = len(events)
    started = time.perf_counter()
    peak, oom, _ = replay_reserved(events, device)
    row["replay_s"] = time.perf_counter() - started
    row["peak_reserved_bytes"], row["reserved_oom"] = peak, oom
    if before:
        old_events, row["extend_before_s"] = _extend(streams, blocks, _difflib_matcher)
        row["same_stream"] = stream._canonical(old_events) == stream._canonical(events)
        row["same_peak"] = replay_reserved(old_events, device)[0] == peak
    for key in [k for k in row if k.endswith("_s")]:
        row[key] = round(row[key], 2)
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="16,32,144", help="new tokens per prompt, comma-separated")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--before-max-tokens", type=int, default=32)
    args = parser.parse_args()
    rows = [measure(int(t), args.batch_size, int(t) <= args.before_max_tokens) for t in args.tokens.split(",")]
    path = write_result("replay_speed", {"workload": "grpo-gpt2-124m", "gpu": "rtx4090-24gb", "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
