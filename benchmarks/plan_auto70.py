"""Issue 34's large plan, timed as a user runs it: a whole process, cold (an empty trace cache), several runs.

    batchfit plan hf:llama-3.1-70b --gpu h100-80gb --gpus 64 --strategies auto --seq-len 8192 \
      --precision bf16-mixed --checkpointing full

Each run is a fresh process with its own empty ``BATCHFIT_CACHE``; wall time by the clock, CPU time (user,
sys) from the kernel's account of the finished child and its children (the strategy sessions and their
forked depths). ``--against DIR`` times another checkout's ``src`` too (its runs interleaved with these,
so both see the same machine), and checks that both give the same plan.json but for its timing fields.
Writes benchmarks/results/<name>-<date>.json (docs/accuracy.md's speed section reads it).

    python benchmarks/plan_auto70.py [--runs 3] [--against /path/to/other/checkout] [--strategies auto]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import write_result

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ["plan", "hf:llama-3.1-70b", "--gpu", "h100-80gb", "--gpus", "64", "--seq-len", "8192",
           "--precision", "bf16-mixed", "--checkpointing", "full"]
TIMING_FIELDS = ("created", "trace_seconds", "traces")


def _commit(source: Path) -> str:
    found = subprocess.run(["git", "-C", str(source), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return found.stdout.strip()


def _run(source: Path, strategies: str) -> dict:
    """One cold run of the command with ``source``'s code: its times and its plan.json without timing fields."""
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "PYTHONPATH": str(source / "src"), "BATCHFIT_CACHE": str(Path(folder) / "cache")}
        plan_json = Path(folder) / "plan.json"
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        load = os.getloadavg()[0]
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "batchfit.cli.app", *COMMAND, "--strategies", strategies,
                        "--json", str(plan_json), "--out", str(Path(folder) / "report")],
                       env=env, check=True, capture_output=True)
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        plan = json.loads(plan_json.read_text())
    for field in TIMING_FIELDS:
        plan.pop(field, None)
    rows = {r["strategy"]: (r.get("max_local_batch"), r.get("micro_batch"), r.get("tokens_per_s"), r.get("skipped"))
            for r in plan.get("strategies", [])}
    return {"wall_s": wall, "user_s": after.ru_utime - before.ru_utime, "sys_s": after.ru_stime - before.ru_stime,
            "load_average": round(load, 2), "plan": plan, "rows": rows}


def _figures(runs: list[dict]) -> dict:
    out = {}
    for key in ("wall_s", "user_s", "sys_s"):
        values = [r[key] for r in runs]
        out[key] = {"min": round(min(values), 2), "median": round(statistics.median(values), 2),
                    "max": round(max(values), 2)}
    cpu = [r["user_s"] + r["sys_s"] for r in runs]
    out["cpu_s"] = {"min": round(min(cpu), 2), "median": round(statistics.median(cpu), 2), "max": round(max(cpu), 2)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--against", type=Path, help="another checkout, timed in turn with this one")
    parser.add_argument("--strategies", default="auto")
    parser.add_argument("--name", default="plan_auto70")
    args = parser.parse_args()
    sources = [ROOT] + ([args.against.resolve()] if args.against else [])
    timed: dict[Path, list[dict]] = {source: [] for source in sources}
    for n in range(args.runs):
        for source in sources:
            timed[source].append(_run(source, args.strategies))
            last = timed[source][-1]
            print(f"{_commit(source)} run {n + 1}: {last['wall_s']:.1f} s wall, {last['user_s'] + last['sys_s']:.1f} "
                  f"CPU-s, load {last['load_average']}", flush=True)
    plans = [r["plan"] for runs in timed.values() for r in runs]
    same = all(p == plans[0] for p in plans)
    command = "batchfit " + " ".join(COMMAND) + f" --strategies {args.strategies}"
    figures = {
        "commit": _commit(ROOT),
        "what": "issue 34's 70B plan as a whole process, cold (an empty BATCHFIT_CACHE each run), runs of the "
                "checkouts interleaved; CPU time is the process's and its children's (sessions, forked depths)",
        "command": command,
        "same_plan_json": same,
        "runs": [{"command": command, "code": _commit(source), "cache": f"empty (cold); code {_commit(source)}",
                  "runs": len(runs),
                  "load_average": [r["load_average"] for r in runs], **_figures(runs),
                  "answer": {name: list(row) for name, row in runs[0]["rows"].items()}}
                 for source, runs in timed.items()],
    }
    print(f"plan.json the same in every run: {same}")
    print(f"wrote {write_result(args.name, figures)}")


if __name__ == "__main__":
    main()
