"""Seed 002, scaled down to a CPU: a batch-size sweep at a fixed token budget, and the
gradient noise scale's prediction beside its answer, with what each cost.

Seed 002 swept a 22.7M-parameter GPT over batch sizes 1..512 on TinyStories for 327.68M
tokens each (~23 GPU-hours). Here: a zoo-style Llama GPT of 0.43M parameters (d 96, 3
layers, BPE vocabulary 512, seq 64), a synthetic story corpus generated from a small grammar
(seeded, ~2 MB), batch sizes 1..64, 2^18 = 262,144 tokens per run (exact at every size),
two peak learning rates scaled by sqrt(batch / 8), two worker processes of one thread each.
Then `noise` tracks B_simple over 200 steps at batch sizes 4 and 32.

    python benchmarks/sweep_cpu.py                     # the full run, ~15-25 min on 2 cores
    python benchmarks/sweep_cpu.py --tokens 32768 --batch-sizes 1,4,16,64 --noise-steps 50   # a smaller one

Writes benchmarks/results/sweep_cpu-<date>.json and the report (report.md, loss_vs_batch.png,
curves.png, sweep.json) to benchmarks/results/sweep_cpu-<date>/.
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch

from _common import RESULTS, write_result
from batchfit import load_workload
from batchfit.report.sweep_markdown import write_sweep_report
from batchfit.runs.data import BatchSource
from batchfit.sweep import SweepConfig, gradient_noise_scale, plan_sweep, run_sweep
from batchfit.sweep.result import read_result, save_noise

MODEL = '''
from batchfit.zoo import language_model_workload
from batchfit.zoo.transformer import Transformer, TransformerConfig

def workload(seq_len=None):
    cfg = TransformerConfig(vocab_size=512, seq_len=seq_len or 64, d_model=96, n_layers=3, n_heads=4, d_ff=256,
                            llama=True, tied_embeddings=False)
    return language_model_workload(name="gpt-stories-0.4m", build_model=lambda: Transformer(cfg), vocab_size=512,
                                   seq_len=cfg.seq_len,
                                   description="Llama-style GPT as the zoo builds it: d 96, 3 layers, 4 heads, "
                                               "FFN 256, vocab 512, untied, seq 64 (0.43M parameters)")
'''

NAMES = ["Tom", "Lily", "Sam", "Mia", "Ben", "Anna", "Max", "Zoe", "Leo", "Ivy"]
ANIMALS = ["cat", "dog", "bird", "frog", "bunny", "duck", "fox", "bear"]
THINGS = ["ball", "kite", "cake", "boat", "box", "hat", "tree", "flower", "car", "book"]
ADJ = ["big", "little", "red", "blue", "happy", "sad", "shiny", "soft", "funny", "old"]
PLACES = ["park", "garden", "house", "forest", "beach", "school", "shop", "river"]


def story(rng: random.Random) -> str:
    """A few sentences with the regularities of a TinyStories story: names recur, pronouns agree."""
    a, b = rng.sample(NAMES, 2)
    animal, thing, place = rng.choice(ANIMALS), rng.choice(THINGS), rng.choice(PLACES)
    adj1, adj2 = rng.sample(ADJ, 2)
    lines = [f"Once upon a time, there was a {adj1} {animal} named {a}.",
             f"{a} liked to play in the {place} with {b}.",
             f"One day, {a} found a {adj2} {thing}.",
             rng.choice([f"{a} gave the {thing} to {b}, and {b} was happy.",
                         f"{b} wanted the {thing} too, so they shared it.",
                         f"The {thing} fell in the {place}, and {a} was sad."]),
             rng.choice([f"Then {a} and {b} went home.", f"They played with the {thing} all day.",
                         f"{b} said, \"Thank you, {a}!\""]),
             "The end."]
    return " ".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="262144")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--lrs", default="1e-3,3e-3")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--noise-sizes", default="4,32")
    parser.add_argument("--noise-steps", type=int, default=200)
    parser.add_argument("--stories", type=int, default=12000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="sweep_cpu-"))
    rng = random.Random(0)
    corpus = work / "stories.txt"
    corpus.write_text("\n".join(story(rng) for _ in range(args.stories)))
    (work / "stories_gpt.py").write_text(MODEL)
    spec = f"{work / 'stories_gpt.py'}:workload"
    workload = load_workload(spec)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    config = SweepConfig(model=spec, batch_sizes=sizes, tokens=int(float(args.tokens)), data=str(corpus),
                         lrs=[float(x) for x in args.lrs.split(",")], lr_scaling="sqrt", lr_ref_batch=8,
                         warmup="5%", eval_every="10%", eval_samples=64, store=work / "sweep.db",
                         cache_dir=work / "cache", device="cpu", workers=args.workers)
    say = lambda message: print(f"[{time.perf_counter() - started:7.1f} s] {message}", flush=True)  # noqa: E731
    started = time.perf_counter()
    plan = plan_sweep(config, workload, progress=say)
    sweep_started = time.perf_counter()
    run_sweep(plan, progress=say)
    sweep_seconds = time.perf_counter() - sweep_started

    small, big = (int(s) for s in args.noise_sizes.split(","))
    noise_started = time.perf_counter()
    noise = gradient_noise_scale(workload, BatchSource(workload, seed=0, tokens=plan.tokens), small=small, big=big,
                                 steps=args.noise_steps, lr=1e-3 * (big / 8) ** 0.5, progress=say)
    noise_seconds = time.perf_counter() - noise_started
    save_noise(config.store, noise.to_json())
    result = read_result(config.store, seconds=sweep_seconds)

    date = time.strftime("%Y-%m-%d")
    folder = RESULTS / f"sweep_cpu-{date}"
    write_sweep_report(result, folder)
    best = result.best_runs()
    rows = [{"batch_size": b, "lr": r["lr"], "steps": r["steps"], "tokens": r["tokens"],
             "best_val_loss": round(r["best_val_loss"], 4), "final_train_loss": round(r["final_train_loss"], 4),
             "seconds": round(r["seconds"], 1)} for b, r in best.items()]
    print(f"{'batch':>5} {'lr':>8} {'steps':>6} {'best val':>9} {'seconds':>8}")
    for row in rows:
        print(f"{row['batch_size']:5d} {row['lr']:8.2g} {row['steps']:6d} {row['best_val_loss']:9.4f} "
              f"{row['seconds']:8.1f}")
    print(f"sweep: best batch {result.best_batch_size()}, fastest to {result.target():.4f}: "
          f"{result.fastest_batch_size()} ({sweep_seconds:.0f} s)")
    print(f"noise: B_simple {noise.b_simple:.1f} {noise.b_simple_interval} ({noise_seconds:.0f} s)")
    path = write_result("sweep_cpu", {
        "what": "scaled-down seed 002 on CPU: batch-size sweep at an exact token budget (best learning rate per "
                "batch size) and the gradient noise scale's prediction, with the wall-clock cost of each",
        "model": workload.description, "data": plan.tokens.to_json() | {"source": "synthetic stories (seed 0)"},
        "tokens_per_run": config.tokens, "batch_sizes": sizes, "lrs_at_batch_8": config.lrs, "lr_scaling": "sqrt",
        "workers": args.workers, "threads_per_worker": 1,
        "sweep": {"seconds": round(sweep_seconds, 1), "runs": len(result.runs), "best_per_batch_size": rows,
                  "best_batch_size": result.best_batch_size(), "target_loss": result.target(),
                  "fastest_batch_size": result.fastest_batch_size()},
        "noise": {"seconds": round(noise_seconds, 1), "batch_sizes": [small, big], "steps": args.noise_steps,
                  "b_simple": noise.b_simple, "b_simple_interval": list(noise.b_simple_interval)},
        "report": str(folder.relative_to(RESULTS.parent))})
    print(f"wrote {path} and {folder}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
