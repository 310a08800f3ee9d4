"""Throughput per batch size on this CPU, for two zoo models, with the spread over repeats.

Each repeat is a fresh `batchfit.bench.engine` row (model built anew, burn-in, timed steps); the
table gives the median step time of each repeat, their mean and spread. Run it on an idle
machine: timings are what this CPU does, not a GPU's. Writes
benchmarks/results/bench_cpu-<date>.json.

    python benchmarks/bench_cpu.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from _common import write_result
from batchfit import StepOptions, load_workload, parse_target
from batchfit.bench.engine import bench_row

CASES = [("gpt-tinystories-22m", 128, [1, 4, 16]), ("gpt2-124m", 64, [1, 2, 4])]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    target = parse_target("cpu")
    rows = []
    for model, seq_len, batch_sizes in CASES:
        workload = load_workload(model, seq_len=seq_len)
        for b in batch_sizes:
            medians = []
            for _ in range(args.repeats):
                row = bench_row(workload, StepOptions(), target, b, steps=args.steps, warmup=args.warmup)
                medians.append(row.step_time_s)
            mean = statistics.mean(medians)
            spread = statistics.stdev(medians) if len(medians) > 1 else 0.0
            tokens_per_s = b * seq_len / mean
            rows.append({"model": model, "seq_len": seq_len, "batch_size": b, "step_time_s_per_repeat": medians,
                         "step_time_s_mean": round(mean, 4), "step_time_s_stdev": round(spread, 4),
                         "tokens_per_s": round(tokens_per_s, 1), "samples_per_s": round(b / mean, 3)})
            print(f"{model:20s} seq {seq_len:4d} batch {b:3d}  step {mean:7.3f} s ± {spread:.3f}  "
                  f"{tokens_per_s:9.1f} tokens/s", flush=True)
    path = write_result("bench_cpu", {
        "what": "fp32 training-step throughput on CPU (burn-in, then timed steps; mean and stdev of "
                f"{args.repeats} repeats' medians)", "threads": torch.get_num_threads(),
        "steps": args.steps, "warmup": args.warmup, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
