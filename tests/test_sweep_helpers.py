"""Shared by the sweep tests (no tests here): a tiny zoo-style GPT and a corpus written on the spot.

The GPT is the zoo's Transformer at 2 layers, d_model 32 (about 40k parameters), with a
byte-sized vocabulary so the ``bytes`` tokenizer fits it; a step takes milliseconds on one
CPU thread. The corpus is generated from a small grammar, so it has something to learn.
"""

from __future__ import annotations

import random
from pathlib import Path

TINY = '''
import torch
from batchfit.zoo import language_model_workload
from batchfit.zoo.transformer import Transformer, TransformerConfig

FAIL_AT = {fail_at}

def workload(seq_len=None):
    cfg = TransformerConfig(vocab_size=320, seq_len=seq_len or 16, d_model=32, n_layers=2, n_heads=2, d_ff=64,
                            llama=True)
    w = language_model_workload(name="tiny-gpt", build_model=lambda: Transformer(cfg), vocab_size=320,
                                seq_len=cfg.seq_len, description="tiny GPT: 2 layers, d 32")
    if FAIL_AT is not None:
        inner = w.loss_fn

        def loss_fn(model, batch):
            if batch[0].shape[0] == FAIL_AT:
                raise ValueError(f"this workload cannot train at batch size {{FAIL_AT}}")
            return inner(model, batch)

        w.loss_fn = loss_fn
    return w
'''


def write_tiny(folder: Path, name: str = "tiny_gpt", fail_at: int | None = None) -> str:
    """Write the tiny workload as a file; returns its MODEL spec (file.py:workload)."""
    path = Path(folder) / f"{name}.py"
    path.write_text(TINY.format(fail_at=fail_at))
    return f"{path}:workload"


def write_corpus(path: Path, lines: int = 600, seed: int = 0) -> Path:
    rng = random.Random(seed)
    names, verbs = ["Tom", "Lily", "Sam", "Mia", "Ben"], ["saw", "liked", "found", "lost", "made"]
    things, moods = ["ball", "cat", "tree", "cake", "boat"], ["big", "red", "fun", "sad"]
    text = "\n".join(f"{rng.choice(names)} {rng.choice(verbs)} a {rng.choice(things)}. It was {rng.choice(moods)}."
                     for _ in range(lines))
    Path(path).write_text(text)
    return Path(path)
