"""A Qwen3-MoE-30B-A3B-shaped config (hf:qwen3-moe-30b-a3b: 48 layers, 128 experts, top-8)
planned on 64 H100s with expert parallelism, under each stated routing, timed as a user runs it
(goal: under 5 minutes on this 2-core CPU), the routing assumption in the table.

    batchfit plan hf:qwen3-moe-30b-a3b --gpu h100-80gb --nodes 8 --gpus-per-node 8 --strategies ep8+fsdp \
      --seq-len 4096 --batch-sizes 1 --precision bf16-mixed --checkpointing full --routing balanced

ep8+fsdp (distributed/expert_parallel.py): each rank keeps 16 of the 128 experts per layer, FSDP2
shards them over the 8 ranks holding the same ones and everything else over all 64; tokens go to
their experts by all-to-all. The local experts run as one grouped GEMM (torchtitan's), so the trace
costs a few ops per layer, not HF's loop of ~12 per expert (which timed out at 900 s under plain
fsdp: plan_moe-2026-11-25.json's first run). The depth extrapolation applies (identical MoE blocks,
each answered by the same routing). Writes benchmarks/results/plan_moe-<date>.json.

    python benchmarks/plan_moe.py [--only balanced,worst] [--strategy ep8+fsdp]
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
        "--strategies", "ep8+fsdp", "--seq-len", "4096", "--batch-sizes", "1", "--precision", "bf16-mixed",
        "--checkpointing", "full"]
ROUTINGS = ("balanced", "capacity:1.25", "worst")
GOAL_S = 300
LIMIT_S = 900
"""Stopped there (the machine is shared: a run past it is reported as such, not waited for)."""
SRC = Path(__file__).resolve().parent.parent / "src"


def run(routing: str, strategy: str) -> dict:
    args = [*ARGS, "--routing", routing]
    args[args.index("--strategies") + 1] = strategy
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
        "max_local_batch": row["max_local_batch"], "micro_batch": row["micro_batch"],
        "gib_at_micro": round((row["peak_reserved_bytes_at_micro"] or row["peak_bytes_at_micro"]) / 2**30, 2),
        "limit": row["limit"], "params": data["params"], "tokens_per_s": row["tokens_per_s"],
        "communication_s": (row.get("time") or {}).get("communication_s"),
        "routing_lines": [a["what"] for a in data["approximations"] if "rout" in a["what"]],
        "approximations": data["approximations"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default=",".join(ROUTINGS))
    parser.add_argument("--strategy", default="ep8+fsdp")
    args = parser.parse_args()
    rows = []
    for routing in args.only.split(","):
        rows.append(run(routing, args.strategy))
        print(json.dumps(rows[-1], indent=1)[:1500], flush=True)
    print("\n| routing | GPUs | strategy | GiB per rank (allocated) by local batch | max local batch | micro-batch "
          "| GiB at micro | tokens/s | wall s |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    for row in rows:
        if "failed" in row:
            print(f"| {row['routing'] if 'routing' in row else '?'} | failed | | | | | | | {row['wall_s']} |")
            continue
        gib = ", ".join(f"{b}: {v}" for b, v in row["peak_gib_per_rank_by_local_batch"].items())
        print(f"| {row['routing']} | {row['gpus']} | {row['strategy']} | {gib} | {row['max_local_batch']} | "
              f"{row['micro_batch']} | {row['gib_at_micro']} ({row['limit']}) | {row['tokens_per_s']:,.0f} | "
              f"{row['wall_s']} |")
    print("written:", write_result("plan_moe", {"runs": _merged(rows)}))


def _merged(rows: list[dict]) -> list[dict]:
    """Today's earlier runs of other (strategy, routing) pairs kept beside these (--only runs a few)."""
    import datetime

    path = Path(__file__).resolve().parent / "results" / f"plan_moe-{datetime.date.today().isoformat()}.json"
    new = {(r.get("command", "").split("--strategies ")[-1].split()[0], r["routing"]) for r in rows}
    old = json.loads(path.read_text())["runs"] if path.exists() else []
    kept = [r for r in old if (r.get("command", "").split("--strategies ")[-1].split()[0], r.get("routing")) not in new]
    return kept + rows


if __name__ == "__main__":
    main()
