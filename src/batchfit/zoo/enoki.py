"""Seed 004's model: "Enoki", a Llama-style transformer with head_dim 64, measured by hand on
4 x H100 at 28 to 48 heads (FSDP against FSDP+TP4, seq 2048).

Reconstructed from seed 004's sizes, which fit d = 64 x heads, 3/4 x heads layers, an untied
50,257-token vocabulary: 991,845,120 parameters at 28 heads (its "0.99B"), 4.39B at 48. The
blocks are Llama's (RMSNorm, RoPE, SwiGLU with d_ff = 8d/3 rounded to 64): seed 004's own
code is not known (benchmarks/seed004.py compares the two).
"""

from __future__ import annotations

from batchfit.workload import Workload
from batchfit.zoo.language_model import language_model_workload
from batchfit.zoo.transformer import Transformer, TransformerConfig

VOCAB = 50257
SEQ = 2048
HEADS = (28, 32, 36, 40, 44, 48)
"""The six sizes seed 004 measured: zoo names enoki-28h ... enoki-48h."""


def enoki_config(heads: int, seq_len: int | None = None) -> TransformerConfig:
    d = 64 * heads
    return TransformerConfig(vocab_size=VOCAB, seq_len=seq_len or SEQ, d_model=d, n_layers=3 * heads // 4,
                             n_heads=heads, d_ff=round(8 * d / 3 / 64) * 64, llama=True, tied_embeddings=False)


def enoki(heads: int, seq_len: int | None = None) -> Workload:
    cfg = enoki_config(heads, seq_len)
    return language_model_workload(
        name=f"enoki-{heads}h", build_model=lambda: Transformer(cfg), vocab_size=VOCAB, seq_len=cfg.seq_len,
        description=f"seed 004: Llama-style, head_dim 64, {heads} heads, d {cfg.d_model}, {cfg.n_layers} layers, "
                    f"vocab {VOCAB} untied, seq {cfg.seq_len}")
