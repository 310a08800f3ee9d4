"""On a real GPU: the caching allocator's own record of one training step, for comparison with a trace.

Runs two warm-up steps of a zoo model, then records the third with
``torch.cuda.memory._record_memory_history`` and writes each event (alloc / free, bytes, the
innermost Python frames that asked) to benchmarks/results/memory_timeline_gpu-<model>-b<N>-<date>.json.
Compare with the traced stream of the same step (``TraceSession.trace``) to find where a traced
peak differs from the GPU's.

    python benchmarks/memory_timeline_gpu.py gpt-tinystories-22m 32 [--precision fp32]
"""

from __future__ import annotations

import argparse

import torch

from _common import write_result
from batchfit import StepOptions
from batchfit.train.step import TrainingStep
from batchfit.zoo import ZOO


def frames(entry: dict, keep: int = 4) -> list[str]:
    out = []
    for frame in entry.get("frames", []):
        name = frame.get("filename", "")
        if "torch/" in name and "batchfit" not in name and "zoo" not in name:
            continue
        out.append(f"{name.rsplit('/', 2)[-1]}:{frame.get('line')}:{frame.get('name')}")
        if len(out) == keep:
            break
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("batch_size", type=int)
    parser.add_argument("--precision", default="fp32")
    args = parser.parse_args()
    step = TrainingStep(ZOO[args.model](), StepOptions(precision=args.precision), torch.device("cuda"))
    for _ in range(2):
        step.run(args.batch_size)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    step.run(args.batch_size)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = [{"action": e["action"], "bytes": e["size"], "addr": e["addr"], "frames": frames(e)}
              for trace in snapshot["device_traces"] for e in trace
              if e["action"] in ("alloc", "free_completed")]
    live, peak, peak_at = base, base, -1
    for i, e in enumerate(events):
        live += e["bytes"] if e["action"] == "alloc" else -e["bytes"]
        if live > peak:
            peak, peak_at = live, i
    path = write_result(f"memory_timeline_gpu-{args.model}-b{args.batch_size}-{args.precision}", {
        "model": args.model, "batch_size": args.batch_size, "precision": args.precision,
        "allocated_before_step_bytes": base, "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
        "peak_from_events_bytes": peak, "peak_event_index": peak_at, "events": events})
    print(f"{args.model} b{args.batch_size} {args.precision}: peak {torch.cuda.max_memory_allocated():,} B "
          f"({peak:,} from {len(events)} events, at event {peak_at}); wrote {path}")


if __name__ == "__main__":
    main()
