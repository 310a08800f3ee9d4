"""Seed 001's model: two frozen decoder LMs in bf16 fed by a small trainable encoder.

A source text (bytes) goes through a trainable transformer encoder; ``latents`` learned
queries pool it into a short sequence; one adapter per LM maps that sequence into the LM's
embedding space, where it is prepended to the target tokens as a soft prompt. Both LMs are
frozen and in bf16 (seed 001: Llama-3.1-8B + Qwen2.5-7B), yet backward runs through them
to reach the prefix, so their activations are held: the memory seed 001 budgeted by hand.
The loss is the sum of both LMs' next-token losses on the target tokens.

    frozen-pair        Llama-3.1-8B + Qwen2.5-7B (shipped configs), ~105M trainable: an encoder
                       of 5 blocks (d 1024), 32 latents, two 2-layer MLP adapters; seq 256
    frozen-pair-tiny   the same wiring with two tiny LMs, for CI

Both LMs' decoder layers are wrapped in one class and also listed together in
``FrozenPair.blocks``, so the model's main stack of blocks (``train.model.block_list``) is all of
them: ``--checkpointing full`` recomputes every frozen layer of both LMs, and FSDP puts each
in its own group, as a real run of this model would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from batchfit.workload import Workload
from batchfit.zoo.hf import CONFIGS, _transformers, _unpacked_sequences

BYTES = 256


@dataclass(frozen=True)
class PairConfig:
    lm_a: dict
    lm_b: dict
    d_encoder: int
    encoder_layers: int
    heads: int
    latents: int
    seq_len: int


class FrozenLayer(nn.Module):
    """One decoder layer of either LM, under one class: the LM calls it as it called the layer."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, *args, **kwargs):
        return self.layer(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # what the LM reads off its layers (attention_type, ...)
            return getattr(self._modules["layer"], name)


def _decoder(config_dict: dict) -> nn.Module:
    transformers = _transformers()
    values = dict(config_dict)
    config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    config.use_cache = False
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
    model.requires_grad_(False)
    layers = model.model.layers
    for i, layer in enumerate(layers):
        layers[i] = FrozenLayer(layer)
    return model


def _adapter(d_in: int, d_out: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, d_out), nn.GELU(), nn.Linear(d_out, d_out))


class FrozenPair(nn.Module):
    def __init__(self, cfg: PairConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.lm_a, self.lm_b = _decoder(cfg.lm_a), _decoder(cfg.lm_b)
        d = cfg.d_encoder
        self.embed = nn.Embedding(BYTES, d)
        self.encoder = nn.ModuleList(
            nn.TransformerEncoderLayer(d, cfg.heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(cfg.encoder_layers))
        self.latents = nn.Parameter(torch.randn(cfg.latents, d) * 0.02)
        self.pool = nn.MultiheadAttention(d, cfg.heads, batch_first=True)
        self.adapter_a = _adapter(d, self.lm_a.config.hidden_size)
        self.adapter_b = _adapter(d, self.lm_b.config.hidden_size)
        # Registered after the LMs, so parameter names stay lm_a.model.layers.N...
        self.blocks = nn.ModuleList([*self.lm_a.model.layers, *self.lm_b.model.layers])

    def forward(self, source: torch.Tensor, target_a: torch.Tensor, target_b: torch.Tensor) -> torch.Tensor:
        x = self.embed(source)
        for layer in self.encoder:
            x = layer(x)
        z, _ = self.pool(self.latents.expand(source.shape[0], -1, -1), x, x, need_weights=False)
        loss = 0.0
        m = self.cfg.latents
        for lm, adapter, target in ((self.lm_a, self.adapter_a, target_a), (self.lm_b, self.adapter_b, target_b)):
            tokens = lm.get_input_embeddings()(target)
            prefix = adapter(z).to(tokens.dtype)  # the frozen LM is bf16 whatever the step's precision
            logits = lm(inputs_embeds=torch.cat([prefix, tokens], dim=1)).logits[:, m - 1:-1]
            loss = loss + F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))
        return loss


def frozen_pair_workload(cfg: PairConfig, name: str, description: str) -> Workload:
    transformers = _transformers()

    def make_batch(batch_size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        shape = (batch_size, cfg.seq_len)
        return (torch.randint(0, BYTES, shape, device=device),
                torch.randint(0, cfg.lm_a["vocab_size"], shape, device=device),
                torch.randint(0, cfg.lm_b["vocab_size"], shape, device=device))

    def loss_fn(model: FrozenPair, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        with _unpacked_sequences(transformers):
            return model(*batch)

    return Workload(name=name, build_model=lambda: FrozenPair(cfg), make_batch=make_batch, loss_fn=loss_fn,
                    tokens_per_sample=cfg.seq_len, description=f"{description}, seq {cfg.seq_len}")


def frozen_pair(seq_len: int | None = None) -> Workload:
    """Seed 001's size: frozen Llama-3.1-8B + Qwen2.5-7B (bf16), ~105M trainable."""
    cfg = PairConfig(lm_a=CONFIGS["llama-3.1-8b"], lm_b=CONFIGS["qwen2.5-7b"], d_encoder=1024, encoder_layers=5,
                     heads=16, latents=32, seq_len=seq_len or 256)
    return frozen_pair_workload(cfg, "frozen-pair", "seed 001: frozen Llama-3.1-8B + Qwen2.5-7B (bf16) fed by a "
                                "trainable encoder (5 blocks, d 1024, 32 latents) and two MLP adapters")


_TINY_LLAMA = dict(CONFIGS["llama-3.2-1b"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=False)
_TINY_QWEN = dict(CONFIGS["qwen2.5-7b"], hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=640)


def frozen_pair_tiny(seq_len: int | None = None) -> Workload:
    """The same wiring at a size CI traces in seconds."""
    cfg = PairConfig(lm_a=_TINY_LLAMA, lm_b=_TINY_QWEN, d_encoder=32, encoder_layers=2, heads=4, latents=4,
                     seq_len=seq_len or 32)
    return frozen_pair_workload(cfg, "frozen-pair-tiny", "two tiny frozen LMs (Llama-style d 64, Qwen2-style d 48, "
                                "2 layers each, bf16) fed by a trainable encoder (2 blocks, d 32, 4 latents)")
