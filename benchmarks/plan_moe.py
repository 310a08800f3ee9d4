"""A Qwen3-MoE-30B-A3B-shaped config (hf:qwen3-moe-30b-a3b: 48 layers, 128 experts, top-8)
planned on 64 H100s, under each stated routing, timed as a user runs it (goal: under 5 minutes
on this 2-core CPU), the routing assumption in the table.

    batchfit plan hf:qwen3-moe-30b-a3b --gpu h100-80gb --nodes 8 --gpus-per-node 8 --strategies fsdp \
      --seq-len 4096 --batch-sizes 1 --precision bf16-mixed --checkpointing full --routing balanced

Expert parallelism (ep8+fsdp, issue 23) is not a strategy yet: the experts are sharded by FSDP2
as any parameter, each rank runs every expert on its own tokens. The depth extrapolation applies
(the MoE blocks are identical, the routing answers each block the same). Writes
benchmarks/results/plan_moe-<date>.json.

    python benchmarks/plan_moe.py [--only balanced,worst]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import write_result

ARGS = ["hf:qwen3-moe-30b-a3b", "--gpu", "h100-80gb", "--nodes", "8", "--gpus-per-node", "8",
        "--strategies", "fsdp", "--seq-len", "4096", "--batch-sizes", "1", "--precision", "bf16-mixed",
        "--checkpointing", "full"]
ROUTINGS = ("balanced", "worst")
GOAL_S = 300
LIMIT_S = 900
"""Stopped there (the machine is shared: a run past it is reported as such, not waited for)."""
SRC = Path(__file__).resolve().parent.parent / "src"


def run(routing: str) -> dict:
    args = [*ARGS, "--routing", routing]
    with tempfile.TemporaryDirectory() as folder:
        load_before = os.getloadavg()
        started = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, "-m", "batchfit.cli.app", "plan", *args, "--out", folder,
                                   "--json", f"{folder}/plan.json"], capture_output=True, text=True,
                                  timeout=LIMIT_S, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                      filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))})
        except subprocess.TimeoutExpired:
            return {"command": "batchfit plan " + " ".join(args), "routing": routing, "failed": "timeout",
                    "wall_s": LIMIT_S, "load_average_1min": {"before": round(load_before[0], 2),
                                                             "after": round(os.getloadavg()[0], 2)}}
        seconds = time.perf_counter() - started
        if done.returncode:
            return {"command": "batchfit plan " + " ".join(args), "failed": done.returncode,
                    "routing": routing, "stderr": done.stderr[-2000:], "wall_s": round(seconds, 1)}
        data = json.loads(Path(folder, "plan.json").read_text())
    (row,) = data["strategies"]
    points = {p["local_batch"]: p["peak_bytes"] for p in row["points"]}
    return {
        "command": "batchfit plan " + " ".join(args), "routing": routing, "wall_s": round(seconds, 1),
        "goal_s": GOAL_S, "load_average_1min": {"before": round(load_before[0], 2),
                                                "after": round(os.getloadavg()[0], 2)},
        "strategy": row["strategy"], "gpus": row["gpus"],
        "peak_gib_per_rank_by_local_batch": {b: round(v / 2**30, 2) for b, v in sorted(points.items())},
        "max_local_batch": row["max_local_batch"],
        "approximations": data["approximations"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default=",".join(ROUTINGS))
    chosen = parser.parse_args().only.split(",")
    rows = []
    for routing in chosen:
        rows.append(run(routing))
        print(json.dumps(rows[-1], indent=1)[:1500], flush=True)
    print("\n| routing | GPUs | strategy | GiB per rank at local batch 1 | max local batch | wall s |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        if "failed" in row:
            print(f"| {row['routing'] if 'routing' in row else '?'} | failed | | | | {row['wall_s']} |")
            continue
        gib = ", ".join(str(v) for v in row["peak_gib_per_rank_by_local_batch"].values())
        print(f"| {row['routing']} | {row['gpus']} | {row['strategy']} | {gib} | {row['max_local_batch']} | {row['wall_s']} |")
    print("written:", write_result("plan_moe", {"runs": rows}))


if __name__ == "__main__":
    main()
