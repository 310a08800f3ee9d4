"""`recommend` against the full sweep it replaces, on three small CPU setups.

The model is a zoo-style Llama GPT (d 64, 2 layers, 4 heads, FFN 128, byte vocabulary, seq 32;
about 0.1M parameters) on the synthetic story corpus of ``sweep_cpu.py``. Each setup runs the
whole sweep (every batch size trained on the full budget) and ``recommend`` (one parent run at
the smallest batch, branches at 10% and 25% of the budget, windows of 4% whose last 75% decays
the rate to the schedule's final one, two data windows at the last point), and writes: the
sweep's best batch, recommend's answer and interval, their ratio, and recommend's tokens
(trained and validated) as a share of the sweep's (counted by the same rule, validated at
batchfit sweep's default --eval-every 10%).

- fixed: one learning rate at every batch size (as seed 002: the best batch is interior);
- scaled: the rate scaled by sqrt(batch), i.e. a different rate per batch size;
- seed002: seed 002's shape scaled to this CPU: one fixed rate, batch 1-256, 425,984 tokens.

    python benchmarks/recommend_cpu.py                       # the three setups, ~10 min on 2 cores
    python benchmarks/recommend_cpu.py --setups seed002 --keep /tmp/rec   # one; sweeps kept for the next run

Writes benchmarks/results/recommend_cpu-<date>.json.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from _common import write_result
from batchfit import load_workload
from batchfit.recommend import RecommendConfig, plan_recommend, run_recommend
from batchfit.runs.data import tokenize
from batchfit.sweep import SweepConfig, plan_sweep, run_sweep
from sweep_cpu import story

MODEL = '''
from batchfit.zoo import language_model_workload
from batchfit.zoo.transformer import Transformer, TransformerConfig

def workload(seq_len=None):
    cfg = TransformerConfig(vocab_size=256, seq_len=seq_len or 32, d_model=64, n_layers=2, n_heads=4, d_ff=128,
                            llama=True)
    return language_model_workload(name="gpt-stories-0.1m", build_model=lambda: Transformer(cfg), vocab_size=256,
                                   seq_len=cfg.seq_len, description="Llama-style GPT: d 64, 2 layers, seq 32")
'''


SETUPS = {  # name: (batch sizes, tokens per run, lr at the smallest batch, lr scaling)
    "fixed": ([1, 2, 4, 8, 16, 32], 65536, 3e-3, "none"),
    "scaled": ([1, 2, 4, 8, 16, 32], 65536, 1e-3, "sqrt"),
    "seed002": ([1, 2, 4, 8, 16, 32, 64, 128, 256], 425984, 3e-3, "none"),
}


def setup(folder: Path, *, name: str, tokens: int, batch_sizes: list[int], lr: float, scaling: str,
          spec: str, corpus: Path, eval_samples: int, options: dict) -> dict:
    workload = load_workload(spec)
    started = time.perf_counter()
    store = folder / f"{name}-{tokens}-{'-'.join(map(str, batch_sizes))}-{lr:g}-{scaling}.db"
    sweep = SweepConfig(model=spec, batch_sizes=batch_sizes, tokens=tokens, data=str(corpus), tokenizer="bytes",
                        lrs=[lr], lr_scaling=scaling, eval_every="25%", eval_samples=eval_samples,
                        store=store, resume=store.exists(), cache_dir=folder / "cache", device="cpu")
    result = run_sweep(plan_sweep(sweep, workload))
    sweep_seconds = time.perf_counter() - started
    best = result.best_runs()
    sweep_best = result.best_batch_size()
    token_data = tokenize(str(corpus), tokenizer="bytes", vocab_size=256, cache_dir=folder / "cache")
    started = time.perf_counter()
    config = RecommendConfig(batch_sizes=batch_sizes, tokens=tokens, lrs=[lr], lr_scaling=scaling,
                             eval_samples=eval_samples, **options)
    plan = plan_recommend(config, workload, token_data)
    rec = run_recommend(plan, workload, token_data)
    rec_seconds = time.perf_counter() - started
    answer = rec.recommended_batch_size
    ratio = max(answer, sweep_best) / min(answer, sweep_best)
    print(f"{name}: sweep best {sweep_best}, recommend {answer} (interval {rec.interval}), ratio {ratio:g}, "
          f"cost {rec.cost_share:.1%} of the sweep's tokens")
    return {"setup": name, "lr": lr, "lr_scaling": scaling, "batch_sizes": batch_sizes, "tokens_per_run": tokens,
            "sweep_best_batch_size": sweep_best,
            "sweep_best_val_loss": {str(b): r["best_val_loss"] for b, r in best.items()},
            "recommended_batch_size": answer, "recommended_interval": list(rec.interval),
            "critical_batch_size": rec.critical_batch_size, "recommended_lr": rec.lr,
            "ratio": ratio, "within_2x": ratio <= 2, "recommend_cost_tokens": rec.total_cost,
            "sweep_tokens": rec.sweep_equivalent, "cost_share_of_sweep": rec.cost_share,
            "within_20_percent": rec.cost_share <= 0.2, "options": options,
            "recommend_extrapolated_val": {str(b): v for b, v in rec.extrapolated.items()},
            "recommend_window_val": {f"{r['batch_size']}@{r['point']}/w{r['seed']}": r["window_val"]
                                     for r in rec.branches},
            "priors": {p["source"].split(" (")[0]: {"batch_size": p["batch_size"], "lr": p["lr"],
                                                     "weight_decay": p.get("weight_decay")} for p in rec.priors},
            "sweep_seconds": sweep_seconds, "recommend_seconds": rec_seconds}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setups", default="fixed,scaled,seed002", help="any of: " + ", ".join(SETUPS))
    parser.add_argument("--eval-samples", type=int, default=64)
    parser.add_argument("--cooldown", type=float, default=None, help="recommend's --cooldown (default its own)")
    parser.add_argument("--window", type=float, default=None, help="recommend's --window (default its own)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="a folder kept between runs: the sweeps' stores resume there (done runs are not repeated)")
    parser.add_argument("--name", default="recommend_cpu", help="the result file's name")
    args = parser.parse_args()
    torch.set_num_threads(1)
    options = {k: v for k, v in (("cooldown", args.cooldown), ("window", args.window)) if v is not None}
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "gpt.py").write_text(MODEL)
        corpus = folder / "stories.txt"
        if not corpus.exists():
            rng = random.Random(0)
            corpus.write_text("\n".join(story(rng) for _ in range(12000)))
        spec = f"{folder / 'gpt.py'}:workload"
        setups = []
        for name in args.setups.split(","):
            sizes, tokens, lr, scaling = SETUPS[name]
            setups.append(setup(folder, name=name, tokens=tokens, batch_sizes=sizes, lr=lr, scaling=scaling, spec=spec,
                                corpus=corpus, eval_samples=args.eval_samples, options=options))
    path = write_result(args.name, {"setups": setups,
                                    "goal": "within 2x of the sweep's best at <= 20% of the sweep's tokens",
                                    "met": all(s["within_2x"] and s["within_20_percent"] for s in setups)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
