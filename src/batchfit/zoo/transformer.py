"""A nanoGPT-style decoder that is GPT-2 or Llama by its config, for the zoo.

GPT-2: learned positions, LayerNorm, GELU MLP, biases, tied embeddings.
Llama: rotary positions, RMSNorm, SwiGLU MLP, no biases, grouped-query attention.
Attention is ``F.scaled_dot_product_attention`` (causal), as nanoGPT and HF use on GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    vocab_size: int
    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None
    d_ff: int
    llama: bool = False
    """Llama block (RoPE, RMSNorm, SwiGLU, no bias) instead of GPT-2's."""
    tied_embeddings: bool = True


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        bias = not cfg.llama
        self.qkv = nn.Linear(cfg.d_model, (self.n_heads + 2 * self.n_kv_heads) * self.head_dim, bias=bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=bias)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                cache: dict | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split(
            [self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.n_kv_heads * self.head_dim], dim=-1
        )
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:  # generation: the KV cache grows by t positions, as HF's DynamicCache
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = k, v
        if self.n_kv_heads != self.n_heads:  # grouped-query attention, as HF's repeat_kv
            repeat = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] == k.shape[2])
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


def rope_tables(seq_len: int, head_dim: int, theta: float = 500000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq_len).float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (..., T, head_dim) by the tables already cut to its T positions."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class MLP(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.llama = cfg.llama
        width = 2 * cfg.d_ff if cfg.llama else cfg.d_ff
        self.up = nn.Linear(cfg.d_model, width, bias=not cfg.llama)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=not cfg.llama)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.llama:
            gate, up = self.up(x).chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        norm = (lambda: nn.RMSNorm(cfg.d_model)) if cfg.llama else (lambda: nn.LayerNorm(cfg.d_model))
        self.norm1, self.attn, self.norm2, self.mlp = norm(), Attention(cfg), norm(), MLP(cfg)

    def forward(self, x: torch.Tensor, rope=None, cache: dict | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, cache)
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = None if cfg.llama else nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model) if cfg.llama else nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tied_embeddings:
            self.head.weight = self.embed.weight
        if cfg.llama:
            cos, sin = rope_tables(cfg.seq_len, cfg.d_model // cfg.n_heads)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        for name, p in self.named_parameters():  # GPT-2 init, scaled residual projections
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * cfg.n_layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor, caches: list[dict] | None = None, start: int = 0) -> torch.Tensor:
        """Logits for ``idx``; with ``caches`` (one dict per block), positions start at ``start``."""
        return self.head(self.hidden(idx, caches, start))

    def hidden(self, idx: torch.Tensor, caches: list[dict] | None = None, start: int = 0) -> torch.Tensor:
        """The final norm's output, what the head projects (TRL's fused LM head takes it without the logits)."""
        x = self.embed(idx)
        t = idx.shape[1]
        rope = None
        if self.pos is not None:
            x = x + self.pos(torch.arange(start, start + t, device=idx.device))
        else:
            rope = (self.rope_cos[start:start + t], self.rope_sin[start:start + t])
        for i, block in enumerate(self.blocks):
            x = block(x, rope, caches[i] if caches is not None else None)
        return self.norm(x)
