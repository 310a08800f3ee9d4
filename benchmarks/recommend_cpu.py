"""`recommend` against the full sweep it replaces, on the setups of ``recommend_sweeps.py``.

Each setup's full sweep (every batch size trained on the whole budget) is read from
``benchmarks/results/recommend_sweeps-*.json`` (trained there once, and here only when missing);
``recommend`` then runs with its defaults (branches at 10% and 25% of the budget, windows of 4%
or of 2 steps of the largest branched batch, the last 75% of each window cooled, two data
windows at the last point; the plan cut to 20% of the sweep's tokens, or the sweep itself where
branching cannot cost less) and writes, per setup: the sweep's best batch, recommend's answer
and interval, their ratio, recommend's tokens (trained and validated) as a share of the
sweep's (counted by the same rule, validated at batchfit sweep's default --eval-every 10%), and
whether the setup was used to choose recommend's settings (``role``: tuning or held-out).

    nice -n 10 python benchmarks/recommend_cpu.py                    # every setup, ~10 min on 2 cores
    nice -n 10 python benchmarks/recommend_cpu.py --setups source    # one

Writes benchmarks/results/recommend_cpu-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from _common import RESULTS, write_result
from batchfit import load_workload
from batchfit.recommend import RecommendConfig, plan_recommend, run_recommend
from batchfit.runs.data import tokenize
from recommend_sweeps import SETUPS, Setup, corpus, model_spec, run_setup_sweep, stored_sweeps


def setup(folder: Path, name: str, spec: Setup, sweep: dict, options: dict) -> dict:
    model = model_spec(folder, spec.model)
    workload = load_workload(model)
    token_data = tokenize(str(corpus(folder, spec.data)), tokenizer="bytes", vocab_size=256, cache_dir=folder / "cache")
    started = time.perf_counter()
    config = RecommendConfig(batch_sizes=list(spec.batch_sizes), tokens=spec.tokens, lrs=[spec.lr],
                             lr_scaling=spec.lr_scaling, eval_samples=sweep["sweep_options"]["eval_samples"], **options)
    plan = plan_recommend(config, workload, token_data)
    rec = run_recommend(plan, workload, token_data)
    rec_seconds = time.perf_counter() - started
    answer, sweep_best = rec.recommended_batch_size, sweep["best_batch_size"]
    ratio = max(answer, sweep_best) / min(answer, sweep_best)
    print(f"{name} ({spec.role}): sweep best {sweep_best}, recommend {answer} (interval {rec.interval}, {rec.mode}), "
          f"ratio {ratio:g}, cost {rec.cost_share:.1%} of the sweep's tokens", flush=True)
    return {"setup": name, "role": spec.role, "model": spec.model, "data": spec.data, "lr": spec.lr,
            "lr_scaling": spec.lr_scaling, "batch_sizes": list(spec.batch_sizes), "tokens_per_run": spec.tokens,
            "sweep_file": sweep["file"], "sweep_best_batch_size": sweep_best,
            "sweep_best_val_loss": {b: r["best_val_loss"] for b, r in sweep["runs"].items()},
            "recommended_batch_size": answer, "recommended_interval": list(rec.interval),
            "critical_batch_size": rec.critical_batch_size, "recommended_lr": rec.lr, "mode": rec.mode,
            "branched": rec.branched, "window": rec.window, "branch_points": rec.points,
            "ratio": ratio, "within_2x": ratio <= 2, "recommend_cost_tokens": rec.total_cost,
            "sweep_tokens": rec.sweep_equivalent, "cost_share_of_sweep": rec.cost_share,
            "within_20_percent": rec.cost_share <= 0.2,
            "met": ratio <= 2 and (rec.cost_share <= 0.2 or rec.mode == "sweep"), "options": options,
            "recommend_extrapolated_val": {str(b): v for b, v in rec.extrapolated.items()},
            "branches": rec.branches, "parent_val": rec.parent["val"], "notes": rec.notes,
            "recommend_seconds": rec_seconds}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setups", default=",".join(SETUPS), help="any of: " + ", ".join(SETUPS))
    parser.add_argument("--cooldown", type=float, default=None, help="recommend's --cooldown (default its own)")
    parser.add_argument("--window", type=float, default=None, help="recommend's --window (default its own)")
    parser.add_argument("--branch-at", default=None, help="recommend's --branch-at as shares, e.g. 0.03,0.1,0.25")
    parser.add_argument("--max-share", type=float, default=None, help="recommend's --max-share (default its own)")
    parser.add_argument("--name", default="recommend_cpu", help="the result file's name")
    parser.add_argument("--train-missing", action="store_true", help="train a setup's sweep here when none is stored")
    args = parser.parse_args()
    torch.set_num_threads(1)
    points = tuple(float(p) for p in args.branch_at.split(",")) if args.branch_at else None
    options = {k: v for k, v in (("cooldown", args.cooldown), ("window", args.window), ("branch_points", points),
                                 ("max_share", args.max_share)) if v is not None}
    path = None
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name in args.setups.split(","):
            sweep = stored_sweeps().get(name)
            if sweep is None and not args.train_missing:
                print(f"{name}: no stored sweep (python benchmarks/recommend_sweeps.py --setups {name}); skipped")
                continue
            sweep = sweep or {**run_setup_sweep(folder, name, SETUPS[name]), "file": "(this run)"}
            row = setup(folder, name, SETUPS[name], sweep, options)
            path = save(args.name, {**row, "command": " ".join(["python", *sys.argv])})
    print(f"wrote {path}")


def save(name: str, row: dict) -> Path:
    """Today's file with this setup's row replaced (the others kept): setups run one at a time add up."""
    today = RESULTS / f"{name}-{datetime.date.today().isoformat()}.json"
    rows = [r for r in json.loads(today.read_text())["setups"] if r["setup"] != row["setup"]] if today.exists() else []
    rows = sorted([*rows, row], key=lambda r: list(SETUPS).index(r["setup"]))
    return write_result(name, {"setups": rows, "goal": "within 2x of the sweep's best at <= 20% of the sweep's tokens, "
                                                       "or the sweep itself where branching cannot cost less",
                               "met": all(r["met"] for r in rows)})

if __name__ == "__main__":
    main()
