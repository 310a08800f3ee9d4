"""Issue 21's QLoRA figure: Llama-3.1-8B in nf4 with double quantization, LoRA r16 on every linear
layer, paged 8-bit AdamW, bf16-mixed, on one RTX 4090 (24 GB): the largest per-device batch, and
the gradient accumulation for a global batch of 64 (estimate has no --global-batch: plan's rule,
``plan/engine.py: _choose_micro``, is applied to estimate's answer: the largest batch under the
90% target that divides 64). Each limit (reserved: the default; allocated) is one CLI run, timed.

    python benchmarks/qlora_8b.py [--limits reserved,allocated]

Writes benchmarks/results/qlora-8b-<date>.json.
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


def run(limit: str) -> dict:
    src = str(Path(__file__).resolve().parents[1] / "src")
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
    micro = max((m for m in range(1, at_target + 1) if GLOBAL_BATCH % m == 0), default=0)
    return {"limit": limit, "wall_s": round(wall, 1),
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
    args = parser.parse_args()
    rows = []
    print("batchfit " + " ".join(COMMAND))
    for limit in args.limits.split(","):
        row = run(limit)
        rows.append(row)
        print(f"--limit {limit}: max batch {row['max_batch_size']} ({row['max_batch_size_at_target']} at 90%), "
              f"global 64 = {row['micro_batch_for_global_64']} x {row['accumulation_steps_for_global_64']} "
              f"accumulation; paged {row['paged_bytes']:,} B; {row['wall_s']} s wall, {row['cpu_s']} s CPU",
              flush=True)
    path = write_result("qlora-8b", {"estimate_command": "batchfit " + " ".join(COMMAND), "global_batch": GLOBAL_BATCH,
                                     "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
