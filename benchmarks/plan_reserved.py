"""plan and estimate agree on one GPU under the reserved limit (issue 20, item 7).

    batchfit plan gpt2-124m --gpu h100-80gb --gpus 1 --strategies ddp [--limit allocated]
    batchfit estimate gpt2-124m --gpu h100-80gb [--limit allocated]

Runs each as a user would (a fresh process), under both limits, and prints the max (local)
batch, the micro-batch / the size under the 90% target, the reserved peak there and the
seconds each took. Before plan had --limit, it answered for allocated memory only: max local
67, micro-batch 60, where estimate says 58 is the largest that can be reserved (52 at 90%).
Writes benchmarks/results/plan_reserved-<date>.json.

    python benchmarks/plan_reserved.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import write_result

MODEL = ["gpt2-124m", "--gpu", "h100-80gb"]


def run(command: list[str], folder: str) -> tuple[dict, float]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "batchfit.cli.app", *command, "--out", folder,
                           "--json", f"{folder}/out.json"], capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(Path(folder, "out.json").read_text()), seconds


def main() -> None:
    rows = []
    for limit in ("reserved", "allocated"):
        with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
            planned, plan_s = run(["plan", *MODEL, "--gpus", "1", "--strategies", "ddp", "--limit", limit], a)
            estimated, estimate_s = run(["estimate", *MODEL, "--limit", limit], b)
        ddp = planned["strategies"][0]
        rows.append({"limit": limit, "plan_max_local_batch": ddp["max_local_batch"],
                     "plan_micro_batch": ddp["micro_batch"],
                     "plan_peak_reserved_bytes_at_micro": ddp["peak_reserved_bytes_at_micro"],
                     "plan_peak_step": ddp["peak_step"], "plan_whole_reserved": ddp["whole_reserved"],
                     "estimate_max_batch_size": estimated["max_batch_size"],
                     "estimate_max_batch_size_at_target": estimated["max_batch_size_at_target"],
                     "plan_s": round(plan_s, 1), "estimate_s": round(estimate_s, 1),
                     "agree": (ddp["max_local_batch"], ddp["micro_batch"]) ==
                              (estimated["max_batch_size"], estimated["max_batch_size_at_target"])})
    print(f"{'limit':10} {'plan max':>8} {'micro':>6} {'est. max':>8} {'at 90%':>6} {'agree':>5} "
          f"{'plan s':>7} {'est. s':>7}  peak in")
    for r in rows:
        print(f"{r['limit']:10} {r['plan_max_local_batch']:8d} {r['plan_micro_batch']:6d} "
              f"{r['estimate_max_batch_size']:8d} {r['estimate_max_batch_size_at_target']:6d} "
              f"{'yes' if r['agree'] else 'NO':>5} {r['plan_s']:7.1f} {r['estimate_s']:7.1f}  {r['plan_peak_step']}")
    path = write_result("plan_reserved", {"commands": ["batchfit plan " + " ".join(MODEL)
                                                       + " --gpus 1 --strategies ddp",
                                                       "batchfit estimate " + " ".join(MODEL)], "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
