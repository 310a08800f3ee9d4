"""How far the full sweep's own answer moves with the seed: the target `recommend` is judged against.

``recommend_cpu.py`` holds recommend within 2x of each setup's sweep, trained once (seed 0). A
sweep is itself one draw: the seed sets the initial model and the data order, and neighbouring
batch sizes often end within 1-3% of each other. Here the sweeps of some setups are trained again
at other seeds (same settings, ``batchfit sweep``'s defaults as in ``recommend_sweeps.py``), and
each seed's best batch size is written beside seed 0's, with every batch size's best validation
loss; ``spread`` is the largest best batch over the smallest, over the seeds.

    nice -n 10 python benchmarks/sweep_seeds.py --setups source,tiny-budget --seeds 1,2

Writes benchmarks/results/sweep_seeds-<date>.json (after each sweep: a stopped run keeps the rest).
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
from pathlib import Path

import torch

from _common import RESULTS, write_result
from recommend_sweeps import SETUPS, run_setup_sweep, stored_sweeps


def summary(name: str, by_seed: dict[int, dict]) -> dict:
    best = {seed: sweep["best_batch_size"] for seed, sweep in sorted(by_seed.items())}
    return {"setup": name, "role": SETUPS[name].role, "best_batch_size_by_seed": best,
            "spread": max(best.values()) / min(best.values()),
            "best_val_loss_by_seed": {seed: {b: r["best_val_loss"] for b, r in sweep["runs"].items()}
                                      for seed, sweep in sorted(by_seed.items())}}


def earlier() -> dict[str, dict]:
    """Today's file's setups (a run for other setups adds to it)."""
    today = RESULTS / f"sweep_seeds-{datetime.date.today().isoformat()}.json"
    return {r["setup"]: r for r in json.loads(today.read_text())["setups"]} if today.exists() else {}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setups", default="source,tiny-budget,fixed", help="any of: " + ", ".join(SETUPS))
    parser.add_argument("--seeds", default="1,2", help="seeds beside the stored seed 0")
    args = parser.parse_args()
    torch.set_num_threads(1)
    stored = stored_sweeps()
    results: dict[str, dict[int, dict]] = {}
    kept = earlier()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name in args.setups.split(","):
            results[name] = {0: stored[name]}
            for seed in (int(s) for s in args.seeds.split(",")):
                results[name][seed] = run_setup_sweep(folder, name, SETUPS[name], seed=seed)
                rows = {**kept, **{n: summary(n, s) for n, s in results.items()}}
                path = write_result("sweep_seeds", {"setups": [rows[n] for n in SETUPS if n in rows]})
                print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
