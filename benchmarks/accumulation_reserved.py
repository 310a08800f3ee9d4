"""The reserved limit under long gradient accumulation, as a user runs it:

    batchfit estimate hf:llama-3.2-1b --gpu h100-80gb --accumulation-steps 16 --precision bf16-mixed \
      --checkpointing full            (default --limit reserved)

Before trace/repeats.py this ran over ten minutes here (depth extension diffed streams holding
all 16 micro-batches); now the extension runs on the two-micro-batch streams and the copies
are written at full depth. Goal: under 60 s on this 2-core CPU. Each run is a fresh process,
timed whole; the machine is shared, so each row has the load average before it and the CPU
seconds (the wall time is those over the share of the cores the run got).

    python benchmarks/accumulation_reserved.py [--runs 1] [--accumulation 16]

Writes benchmarks/results/accumulation-reserved-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import write_result

COMMAND = ["estimate", "hf:llama-3.2-1b", "--gpu", "h100-80gb", "--precision", "bf16-mixed", "--checkpointing", "full"]
GOAL_S = 60


def run(accumulation: int) -> dict:
    load_before = os.getloadavg()[0]
    src = str(Path(__file__).resolve().parents[1] / "src")
    with tempfile.TemporaryDirectory() as folder:
        json_path = Path(folder) / "estimate.json"
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "batchfit.cli.app", *COMMAND, "--accumulation-steps",
                               str(accumulation), "--json", str(json_path), "--out", str(Path(folder) / "report")],
                              env={**os.environ, "PYTHONPATH": src}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        if done.returncode:
            raise SystemExit(f"failed: {done.stderr.strip().splitlines()[-2:]}")
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        result = json.loads(json_path.read_text())
    return {"accumulation_steps": accumulation, "load_average_1min_before": round(load_before, 2),
            "wall_s": round(wall, 1),
            "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1),
            "max_batch_size": result["max_batch_size"], "max_batch_size_at_target": result["max_batch_size_at_target"],
            "peak_bytes_at_max": result["peak_bytes_at_max"],
            "peak_reserved_bytes_at_max": result["peak_reserved_bytes_at_max"],
            "whole_reserved": (result["traced_by_depth"] or {}).get("whole_reserved"),
            "trace_seconds": result["trace_seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--accumulation", type=int, default=16)
    args = parser.parse_args()
    print("batchfit " + " ".join(COMMAND) + f" --accumulation-steps {args.accumulation}")
    rows = []
    for _ in range(args.runs):
        row = run(args.accumulation)
        rows.append(row)
        print(f"max batch {row['max_batch_size']} ({row['max_batch_size_at_target']} at 90%), reserved at max "
              f"{row['peak_reserved_bytes_at_max']:,} B; {row['wall_s']} s wall, {row['cpu_s']} s CPU (goal "
              f"{GOAL_S} s; load {row['load_average_1min_before']}; traced whole for reserved: "
              f"{row['whole_reserved']})", flush=True)
    path = write_result("accumulation-reserved", {"estimate_command": "batchfit " + " ".join(COMMAND)
                                                  + f" --accumulation-steps {args.accumulation}", "goal_s": GOAL_S,
                                                  "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
