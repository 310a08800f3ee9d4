"""The full sweeps `recommend` is held to: every batch size trained on the whole budget, per setup.

Setups differ in model size (0.1M and 0.4M parameters), data (synthetic stories, real Python
source), budget (16,384 to 425,984 tokens) and learning-rate protocol (one fixed rate as in seed
002, or scaled by sqrt(batch)). ``tuning`` setups are the ones recommend's settings were chosen
on (the three earlier benchmarks); ``held-out`` setups were added after, and no setting was
chosen on them. Each sweep is stored once, in ``benchmarks/results/recommend_sweeps-<date>.json``
(per batch size: the rate, the best and final validation loss, the seconds), so recommend is
judged against it without training the sweep again (``recommend_cpu.py`` reads it).

    nice -n 10 python benchmarks/recommend_sweeps.py                      # every setup missing from the file
    nice -n 10 python benchmarks/recommend_sweeps.py --setups source      # one (replaces it in the file)

Each sweep: batchfit sweep's defaults (warmup 1%, cosine to 10%), --eval-every 25%, 64 validation
samples, one thread.
"""

from __future__ import annotations

import argparse
import json
import random
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from _common import RESULTS, write_result
from batchfit import load_workload
from batchfit.sweep import SweepConfig, plan_sweep, run_sweep
from sweep_cpu import story

MODELS = {
    "gpt-0.1m": '''
from batchfit.zoo import language_model_workload
from batchfit.zoo.transformer import Transformer, TransformerConfig

def workload(seq_len=None):
    cfg = TransformerConfig(vocab_size=256, seq_len=seq_len or 32, d_model=64, n_layers=2, n_heads=4, d_ff=128,
                            llama=True)
    return language_model_workload(name="gpt-stories-0.1m", build_model=lambda: Transformer(cfg), vocab_size=256,
                                   seq_len=cfg.seq_len, description="Llama-style GPT: d 64, 2 layers, seq 32")
''',
    "gpt-0.4m": '''
from batchfit.zoo import language_model_workload
from batchfit.zoo.transformer import Transformer, TransformerConfig

def workload(seq_len=None):
    cfg = TransformerConfig(vocab_size=256, seq_len=seq_len or 64, d_model=96, n_layers=3, n_heads=4, d_ff=256,
                            llama=True)
    return language_model_workload(name="gpt-0.4m", build_model=lambda: Transformer(cfg), vocab_size=256,
                                   seq_len=cfg.seq_len, description="Llama-style GPT: d 96, 3 layers, seq 64")
''',
}

STDLIB_PACKAGES = ("json", "email", "asyncio", "logging", "concurrent", "http", "xml", "unittest")


@dataclass(frozen=True, kw_only=True)
class Setup:
    model: str
    """A key of MODELS."""
    data: str
    """stories (synthetic, seeded) or stdlib (this Python's own source of STDLIB_PACKAGES, about 2.5 MB)."""
    batch_sizes: tuple[int, ...]
    tokens: int
    lr: float
    """The peak rate at the smallest batch size."""
    lr_scaling: str
    role: str
    """tuning: recommend's settings were chosen on it; held-out: never."""


SETUPS = {
    "fixed": Setup(model="gpt-0.1m", data="stories", batch_sizes=(1, 2, 4, 8, 16, 32), tokens=65536, lr=3e-3,
                   lr_scaling="none", role="tuning"),
    "scaled": Setup(model="gpt-0.1m", data="stories", batch_sizes=(1, 2, 4, 8, 16, 32), tokens=65536, lr=1e-3,
                    lr_scaling="sqrt", role="tuning"),
    "seed002": Setup(model="gpt-0.1m", data="stories", batch_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256), tokens=425984,
                     lr=3e-3, lr_scaling="none", role="tuning"),
    "source": Setup(model="gpt-0.4m", data="stdlib", batch_sizes=(1, 2, 4, 8, 16, 32, 64), tokens=65536, lr=3e-3,
                    lr_scaling="none", role="held-out"),
    "source-scaled": Setup(model="gpt-0.4m", data="stdlib", batch_sizes=(1, 2, 4, 8, 16, 32), tokens=196608,
                           lr=1e-3, lr_scaling="sqrt", role="held-out"),
    "tiny-budget": Setup(model="gpt-0.1m", data="stdlib", batch_sizes=(1, 2, 4, 8, 16, 32, 64), tokens=16384, lr=1e-3,
                         lr_scaling="sqrt", role="held-out"),
}

SWEEP_OPTIONS = {"eval_every": "25%", "eval_samples": 64}


def corpus(folder: Path, data: str) -> Path:
    """The setup's text file in ``folder`` (written once)."""
    path = folder / f"{data}.txt"
    if not path.exists():
        if data == "stories":
            rng = random.Random(0)
            path.write_text("\n".join(story(rng) for _ in range(12000)))
        else:
            lib = Path(sysconfig.get_paths()["stdlib"])
            files = sorted(p for name in STDLIB_PACKAGES for p in (lib / name).rglob("*.py"))
            path.write_text("\n".join(p.read_text(errors="replace") for p in files))
    return path


def model_spec(folder: Path, model: str) -> str:
    path = folder / f"{model.replace('.', '_').replace('-', '_')}.py"
    path.write_text(MODELS[model])
    return f"{path}:workload"


def run_setup_sweep(folder: Path, name: str, setup: Setup, seed: int = 0) -> dict:
    """The setup's full sweep; ``seed`` draws the initial model and the data order (0: the stored sweeps)."""
    spec = model_spec(folder, setup.model)
    workload = load_workload(spec)
    store = folder / (f"sweep-{name}.db" if seed == 0 else f"sweep-{name}-seed{seed}.db")
    config = SweepConfig(model=spec, batch_sizes=list(setup.batch_sizes), tokens=setup.tokens,
                         data=str(corpus(folder, setup.data)), tokenizer="bytes", lrs=[setup.lr],
                         lr_scaling=setup.lr_scaling, store=store, resume=store.exists(), cache_dir=folder / "cache",
                         device="cpu", seed=seed, **SWEEP_OPTIONS)
    started = time.perf_counter()
    result = run_sweep(plan_sweep(config, workload))
    best = result.best_runs()
    runs = {str(b): {"lr": r["lr"], "best_val_loss": r["best_val_loss"], "final_val_loss": r["final_val_loss"],
                     "steps": r["steps"], "seconds": r["seconds"]} for b, r in best.items()}
    print(f"{name} (seed {seed}): best batch {result.best_batch_size()} "
          + ", ".join(f"{b}: {r['best_val_loss']:.4f}" for b, r in runs.items()), flush=True)
    return {**asdict(setup), "batch_sizes": list(setup.batch_sizes), "sweep_options": SWEEP_OPTIONS,
            "model_description": workload.description, "best_batch_size": result.best_batch_size(), "runs": runs,
            "seconds": time.perf_counter() - started}


def stored_sweeps() -> dict[str, dict]:
    """The newest stored sweep of each setup whose settings are still the setup's."""
    found: dict[str, dict] = {}
    for path in sorted(RESULTS.glob("recommend_sweeps-*.json")):
        for name, sweep in json.loads(path.read_text())["sweeps"].items():
            setup = SETUPS.get(name)
            if setup is not None and sweep_matches(sweep, setup):
                found[name] = {**sweep, "file": path.name}
    return found


def sweep_matches(sweep: dict, setup: Setup) -> bool:
    return ({k: sweep.get(k) for k in asdict(setup)} == {**asdict(setup), "batch_sizes": list(setup.batch_sizes)}
            and sweep.get("sweep_options") == SWEEP_OPTIONS)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setups", default=None, help="any of: " + ", ".join(SETUPS) + " (default: those not stored)")
    parser.add_argument("--keep", type=Path, default=None, help="a folder kept between runs (the sweeps resume)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    stored = {k: {x: y for x, y in v.items() if x != "file"} for k, v in stored_sweeps().items()}
    names = args.setups.split(",") if args.setups else [n for n in SETUPS if n not in stored]
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for name in names:
            stored[name] = run_setup_sweep(folder, name, SETUPS[name])
            path = write_result("recommend_sweeps", {"sweeps": stored})  # after each: a stopped run keeps the rest
            print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
