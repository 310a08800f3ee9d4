"""A byte-level gated recurrent LM in the spirit of seed 000 (a Mamba-gated Elman network).

Each layer computes ``h_t = a_t * h_{t-1} + (1 - a_t) * x_t`` over the sequence, with the
forget gate ``a_t`` and the input from the layer's input, and gates the output with SiLU.
The scan runs in parallel in log space (as minGRU does), so a whole sequence is a handful
of ops: cumsum and logcumsumexp, no Python loop over time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class RecurrentConfig:
    vocab_size: int = 256
    seq_len: int = 512
    d_model: int = 4096
    n_layers: int = 6


class GatedElman(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(d_model)
        self.in_proj = nn.Linear(d_model, 3 * d_model, bias=False)  # input, forget, output gate
        self.out_proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value, forget, gate = self.in_proj(self.norm(x)).chunk(3, dim=-1)
        log_a = -F.softplus(-forget.float())  # log sigmoid(forget)
        log_b = -F.softplus(forget.float()) + torch.log(F.softplus(value.float()) + 1e-6)
        a_star = torch.cumsum(log_a, dim=1)
        h = torch.exp(a_star + torch.logcumsumexp(log_b - a_star, dim=1))
        return x + self.out_proj((h.type_as(x)) * F.silu(gate))


class RecurrentLM(nn.Module):
    def __init__(self, cfg: RecurrentConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(GatedElman(cfg.d_model) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
