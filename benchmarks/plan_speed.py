"""How long `batchfit plan` takes for the README's first example on this machine.

    batchfit plan hf:llama-3.1-8b --gpu h100-80gb --gpus 8 --seq-len 8192 --precision bf16-mixed \
      --checkpointing full --strategies ddp,fsdp,fsdp+tp2,fsdp+tp4 --global-batch 512 --tokens chinchilla

Times the whole command as a user runs it (a fresh process: imports, every sharded trace, the
report; goal: under 60 s on a 2-core CPU), and prints the plan's table with the seconds and
the number of traced steps. Writes benchmarks/results/plan_speed-<date>.json.

    python benchmarks/plan_speed.py [--name plan_speed] [--keep-json FILE]

``--keep-json`` keeps the plan's JSON (to compare two checkouts' figures, timing fields aside).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import write_result

COMMAND = ["hf:llama-3.1-8b", "--gpu", "h100-80gb", "--gpus", "8", "--seq-len", "8192", "--precision", "bf16-mixed",
           "--checkpointing", "full", "--strategies", "ddp,fsdp,fsdp+tp2,fsdp+tp4", "--global-batch", "512",
           "--tokens", "chinchilla"]
GOAL_S = 60


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", default="plan_speed")
    parser.add_argument("--keep-json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        load_before = os.getloadavg()
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "batchfit.cli.app", "plan", *COMMAND, "--out", folder,
                               "--json", f"{folder}/plan.json"], capture_output=True, text=True)
        seconds = time.perf_counter() - started
        load_after = os.getloadavg()
        if done.returncode:
            sys.exit(f"batchfit plan failed ({done.returncode}):\n{done.stderr[-3000:]}")
        data = json.loads(Path(folder, "plan.json").read_text())
        if args.keep_json:
            shutil.copy(Path(folder, "plan.json"), args.keep_json)
    rows = [{k: s[k] for k in ("strategy", "dp", "tp", "max_local_batch", "max_global_batch", "micro_batch",
                               "accumulation_steps", "peak_bytes_at_micro", "step_time_s", "tokens_per_s", "days")}
            | {"traced_local_batches": [p["local_batch"] for p in s["points"]],
               "whole_reserved": s.get("whole_reserved")} for s in data["strategies"]]
    print(f"batchfit plan {' '.join(COMMAND)}")
    print(f"{seconds:.1f} s for the whole command (goal {GOAL_S} s), {data['traces']} sharded traces "
          f"({data['trace_seconds']:.1f} s tracing; load average {load_before[0]:.2f} -> {load_after[0]:.2f} "
          f"on {os.cpu_count()} cores)")
    print(f"{'strategy':10} {'max local':>9} {'max global':>10} {'micro x acc':>11} {'GiB':>6} {'step s':>7} "
          f"{'tokens/s':>9} {'days':>6}")
    for r in rows:
        print(f"{r['strategy']:10} {r['max_local_batch']:9d} {r['max_global_batch']:10d} "
              f"{r['micro_batch']:>5} x {r['accumulation_steps']:<3} "
              f"{(r['peak_bytes_at_micro'] or 0) / 2**30:6.1f} {r['step_time_s'] or 0:7.2f} "
              f"{r['tokens_per_s'] or 0:9,.0f} {r['days'] or 0:6.1f}")
    path = write_result(args.name, {
        "plan_command": "batchfit plan " + " ".join(COMMAND), "command_s": round(seconds, 1), "goal_s": GOAL_S,
        "load_average_1min": {"before": round(load_before[0], 2), "after": round(load_after[0], 2)},
        "traces": data["traces"], "trace_seconds": data["trace_seconds"], "params": data["params"],
        "strategies": rows, "recommended": data["recommended"],
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
