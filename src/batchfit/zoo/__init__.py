"""Built-in workloads: real architectures at real sizes, built with no weights.

``ZOO`` maps a name to a factory ``(seq_len: int | None) -> Workload``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from batchfit.workload import Workload
from batchfit.zoo.enoki import HEADS as ENOKI_HEADS
from batchfit.zoo.enoki import enoki
from batchfit.zoo.frozen_pair import frozen_pair, frozen_pair_tiny
from batchfit.zoo.grpo import grpo_workload
from batchfit.zoo.language_model import language_model_workload
from batchfit.zoo.recurrent import RecurrentConfig, RecurrentLM
from batchfit.zoo.transformer import Transformer, TransformerConfig


def _transformer(name: str, description: str, default_seq_len: int, **config):
    def factory(seq_len: int | None = None) -> Workload:
        cfg = TransformerConfig(seq_len=seq_len or default_seq_len, **config)
        return language_model_workload(
            name=name, build_model=lambda: Transformer(cfg), vocab_size=cfg.vocab_size,
            seq_len=cfg.seq_len, description=f"{description}, seq {cfg.seq_len}",
        )

    return factory


def _byte_elman(seq_len: int | None = None) -> Workload:
    # Seed 000's model: E1, LadderLM(level=1, dim=3584, depth=6) of github.com/ekg/elman.
    cfg = RecurrentConfig(seq_len=seq_len or 512)
    return language_model_workload(
        name="byte-elman-400m", build_model=lambda: RecurrentLM(cfg), vocab_size=cfg.vocab_size,
        seq_len=cfg.seq_len,
        description=f"byte-level Elman RNN with Mamba-style output gating, 386M parameters: "
                    f"d {cfg.d_model}, {cfg.n_layers} layers, dense tanh recurrence, vocab 256, seq {cfg.seq_len}",
    )


ZOO: dict[str, Callable[..., Workload]] = {
    # Seed 002's model (its table gives 22,696,448 parameters).
    "gpt-tinystories-22m": _transformer(
        "gpt-tinystories-22m", "Llama-style GPT for TinyStories: d 512, 4 layers, 16 heads, FFN 1344, "
        "vocab 10000, untied", 256,
        vocab_size=10000, d_model=512, n_layers=4, n_heads=16, d_ff=1344, llama=True,
        tied_embeddings=False),
    "gpt2-124m": _transformer(
        "gpt2-124m", "GPT-2 small (nanoGPT): d 768, 12 layers, 12 heads, vocab 50257", 1024,
        vocab_size=50257, d_model=768, n_layers=12, n_heads=12, d_ff=3072),
    "llama-1b": _transformer(
        "llama-1b", "Llama-3.2-1B-shaped: d 2048, 16 layers, 32 heads (8 KV), FFN 8192, "
        "vocab 128256, tied", 2048,
        vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_ff=8192,
        llama=True, tied_embeddings=True),
    "byte-elman-400m": _byte_elman,
    "grpo-gpt2-124m": grpo_workload,  # the RL step of seed 003
    "frozen-pair": frozen_pair,  # seed 001: frozen Llama-3.1-8B + Qwen2.5-7B, trainable encoder + adapters
    "frozen-pair-tiny": frozen_pair_tiny,  # the same wiring, small enough for CI
    # seed 004: FSDP against FSDP+TP4 on 4 x H100 at six sizes (0.99B at 28 heads to 4.39B at 48)
    **{f"enoki-{heads}h": functools.partial(enoki, heads) for heads in ENOKI_HEADS},
}
