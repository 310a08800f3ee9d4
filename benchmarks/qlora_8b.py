"""Issue 21's QLoRA figure: Llama-3.1-8B in nf4 with double quantization, LoRA r16 on every linear
layer, paged 8-bit AdamW, bf16-mixed, on one RTX 4090 (24 GB): the largest per-device batch, and
the gradient accumulation for a global batch of 64 (``--global-batch 64``: plan's rule,
``search.choose_micro``, the largest micro-batch under the 90% target that divides 64, traced
with the accumulation it runs with). Each limit (reserved: the default; allocated) is one CLI run, timed.

    python benchmarks/qlora_8b.py [--limits reserved,allocated] [--baseline OTHER/src --name qlora-8b-speed]

Writes benchmarks/results/<name, default qlora-8b>-<date>.json. With ``--baseline`` each limit is also
timed with another checkout's source first (e.g. the commit before a speed-up), so the before and
after figures are taken on the same machine, minutes apart; each row has the load average before it,
since the machine is shared (wall time is the CPU time over the share of a core the run got).
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

COMMAND = ["estimate", "hf:llama-3.1-8b", "--quantize", "nf4-dq", "--lora", "r=16", "--optimizer",
           "paged-adamw-8bit", "--precision", "bf16-mixed", "--gpu", "rtx4090-24gb", "--checkpointing", "full"]
GLOBAL_BATCH = 64
COMMAND += ["--global-batch", str(GLOBAL_BATCH)]


def run(limit: str, src: str) -> dict:
    load_before = os.getloadavg()[0]
    env = {**os.environ, "PYTHONPATH": src}
    with tempfile.TemporaryDirectory() as folder:
        json_path = Path(folder) / "estimate.json"
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "batchfit.cli.app", *COMMAND, "--limit", limit, "--json",
                               str(json_path), "--out", str(Path(folder) / "report")], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode:
            raise SystemExit(f"--limit {limit} failed: {done.stderr.strip().splitlines()[-2:]}")
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        result = json.loads(json_path.read_text())
    at_target = result["max_batch_size_at_target"]
    micro = result["micro_batch"] or 0
    commit = subprocess.run(["git", "-C", src, "describe", "--always", "--dirty"], capture_output=True,
                            text=True).stdout.strip()
    return {"limit": limit, "source_commit": commit, "load_average_1min_before": round(load_before, 2),
            "wall_s": round(wall, 1),
            "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1),
            "tokens_per_sample": result["tokens_per_sample"], "max_batch_size": result["max_batch_size"],
            "max_batch_size_at_target": at_target, "micro_batch_for_global_64": micro,
            "accumulation_steps_for_global_64": GLOBAL_BATCH // micro if micro else None,
            "peak_bytes_at_max": result["peak_bytes_at_max"],
            "peak_reserved_bytes_at_max": result["peak_reserved_bytes_at_max"],
            "paged_bytes": result["paged_bytes"], "params": result["params"],
            "trainable_params": result["trainable_params"], "whole_reserved": (result["traced_by_depth"] or {}).get(
                "whole_reserved"), "trace_seconds": result["trace_seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--limits", default="reserved,allocated")
    parser.add_argument("--baseline", help="another checkout's src folder, timed first")
    parser.add_argument("--name", default="qlora-8b")
    args = parser.parse_args()
    rows = []
    print("batchfit " + " ".join(COMMAND))
    here = str(Path(__file__).resolve().parents[1] / "src")
    for limit, src in [(limit, src) for src in filter(None, (args.baseline, here)) for limit in args.limits.split(",")]:
        row = run(limit, src)
        rows.append(row)
        print(f"--limit {limit}: max batch {row['max_batch_size']} ({row['max_batch_size_at_target']} at 90%), "
              f"global 64 = {row['micro_batch_for_global_64']} x {row['accumulation_steps_for_global_64']} "
              f"accumulation; paged {row['paged_bytes']:,} B; {row['wall_s']} s wall, {row['cpu_s']} s CPU "
              f"(load {row['load_average_1min_before']}; at {row['source_commit']}; traced whole for reserved: "
              f"{row['whole_reserved']})",
              flush=True)
    path = write_result(args.name, {"estimate_command": "batchfit " + " ".join(COMMAND), "global_batch": GLOBAL_BATCH,
                                     "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
