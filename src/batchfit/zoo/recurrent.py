"""A byte-level Elman RNN with Mamba-style output gating, saving what its CUDA kernel saves.

The architecture is "E1" of the Elman ladder (github.com/ekg/elman, ``LadderLM(level=1)``),
the model of seed 000. Each block, after a pre-norm, does

    x, z = split(in_proj(x));  x = silu(x)
    h_t  = tanh(W_x x_t + W_h h_{t-1} + b)          a dense, non-linear recurrence
    out  = out_proj(h_t * silu(z_t))

The recurrence is non-linear, so it has no parallel scan: the real model runs it in one
fused CUDA kernel that loops over time inside the kernel and keeps, for backward, its inputs
x and z, the pre-activations v and the hidden states h_0..h_T (one T x B x D tensor each),
and nothing per step. ``ElmanScan`` is an autograd Function that saves exactly those and
recomputes the gradient through time in its backward, as the kernel does. Its two time
loops are custom ops, so the tracer sees each as one op, as it would see the kernel; as
plain Python the loops would cost T x layers x several dispatches per traced step: minutes
for one estimate instead of seconds.
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
    d_model: int = 3584
    n_layers: int = 6


# The two time loops are custom ops: on real tensors they run step by step; on fake tensors
# (the tracer) they are one op that allocates nothing, as a fused kernel's loop holds only a
# few B x D vectors. Every T x B x D tensor is allocated outside them, where the tracer
# counts it. As Python loops they would also cost T x layers Python dispatches per trace.
@torch.library.custom_op("batchfit::elman_scan_", mutates_args=("v", "h"))
def _scan_(v: torch.Tensor, h: torch.Tensor, w_h: torch.Tensor) -> None:
    """In place, for t = 1..T: ``v_t += h_{t-1} W_h^T``, ``h_t = tanh(v_t)``; h[0] holds h_0."""
    h_steps, w_h_t = h.unbind(0), w_h.t()
    for t, v_t in enumerate(v.unbind(0)):
        v_t.addmm_(h_steps[t], w_h_t)
        torch.tanh(v_t, out=h_steps[t + 1])


@_scan_.register_fake
def _(v: torch.Tensor, h: torch.Tensor, w_h: torch.Tensor) -> None:
    return None


@torch.library.custom_op("batchfit::elman_scan_backward_", mutates_args=("grad",))
def _scan_backward_(grad: torch.Tensor, v: torch.Tensor, w_h: torch.Tensor) -> None:
    """In place, for t = T..1: dL/dh_t (from the output) becomes dL/dv_t, through time."""
    carry = torch.zeros_like(grad[0])  # dL/dh_t through h_{t+1}
    one = v.new_ones(())
    for v_t, grad_t in zip(reversed(v.unbind(0)), reversed(grad.unbind(0))):
        tanh_v = torch.tanh(v_t)  # from the kept pre-activation, as a kernel recomputes it
        grad_t.add_(carry).mul_(torch.addcmul(one, tanh_v, tanh_v, value=-1))  # tanh' = 1 - tanh^2
        carry = grad_t @ w_h


@_scan_backward_.register_fake
def _(grad: torch.Tensor, v: torch.Tensor, w_h: torch.Tensor) -> None:
    return None


class ElmanScan(torch.autograd.Function):
    """``h_t = tanh(x_t W_x^T + h_{t-1} W_h^T + b)``, ``out_t = h_t * silu(z_t)``, with h_0 = 0.

    x and z are time-major (T, B, D), as the kernel takes them. Only shapes steer the
    loops (no .item(), no branches on values), so it runs on fake tensors too.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, z: torch.Tensor, w_x: torch.Tensor, w_h: torch.Tensor,
                b: torch.Tensor) -> torch.Tensor:
        # Function.forward runs with autograd off: nothing inside the loop is recorded.
        # The input half of every step at once, in one GEMM; the loop adds W_h h_{t-1} in place.
        v = torch.addmm(b, x.flatten(0, 1), w_x.t()).view_as(x)
        h = x.new_zeros((x.shape[0] + 1, *x.shape[1:]))
        torch.ops.batchfit.elman_scan_(v, h, w_h)
        ctx.save_for_backward(x, z, h, v, w_x, w_h)
        return F.silu(z).mul_(h[1:])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, z, h, v, w_x, w_h = ctx.saved_tensors
        # The gradient arrives as a transposed view (of out_proj's input copy); the kernel
        # takes contiguous memory, so the real model copies it, and so does this.
        grad_out = grad_out.contiguous()
        # In-place where possible: a kernel computes these element-wise, with no temporaries.
        sig = torch.sigmoid(z)
        grad_v = torch.mul(z, sig).mul_(grad_out)  # dL/dh_t from the output = g * silu(z)
        grad_z = torch.sub(1, sig).mul_(z).add_(1).mul_(sig)  # silu'(z) = s (1 + z (1 - s))
        del sig
        grad_z.mul_(h[1:]).mul_(grad_out)
        torch.ops.batchfit.elman_scan_backward_(grad_v, v, w_h)
        flat = grad_v.flatten(0, 1)
        grad_x = (flat @ w_x).view_as(x)
        grad_w_x = flat.t() @ x.flatten(0, 1)
        grad_w_h = flat.t() @ h[:-1].flatten(0, 1)
        grad_b = flat.sum(0)
        return grad_x, grad_z, grad_w_x, grad_w_h, grad_b


def elman_loop(x: torch.Tensor, z: torch.Tensor, w_x: torch.Tensor, w_h: torch.Tensor,
               b: torch.Tensor) -> torch.Tensor:
    """The same recurrence as a plain autograd loop: the reference ``ElmanScan`` is tested against."""
    h = x.new_zeros(x.shape[1:])
    outs = []
    for t in range(x.shape[0]):
        h = torch.tanh(x[t] @ w_x.t() + h @ w_h.t() + b)
        outs.append(h * F.silu(z[t]))
    return torch.stack(outs)


class MambaGatedElman(nn.Module):
    """One pre-norm residual block: ``x + mixer(norm(x))``."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        # LayerNorm (weight and bias) as the seed's LadderLM had: its parameter count,
        # 386,340,864, includes the biases.
        self.norm = nn.LayerNorm(d_model)
        self.in_proj = nn.Linear(d_model, 2 * d_model, bias=False)  # recurrence input, gate
        self.w_x = nn.Parameter(torch.empty(d_model, d_model))
        self.w_h = nn.Parameter(torch.empty(d_model, d_model))
        self.b = nn.Parameter(torch.zeros(d_model))
        self.out_proj = nn.Linear(d_model, d_model, bias=False)
        nn.init.xavier_uniform_(self.w_x)
        nn.init.xavier_uniform_(self.w_h, gain=0.1)  # a contracting recurrence, as the seed's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xr, z = self.in_proj(self.norm(x)).chunk(2, dim=-1)
        # The real model hands the kernel time-major contiguous copies and copies the
        # output back: each copy is a tensor autograd keeps, so they are mirrored here.
        xr = F.silu(xr).transpose(0, 1).contiguous()
        z = z.transpose(0, 1).contiguous()
        dtype = xr.dtype  # under autocast the weights join the activations' dtype
        out = ElmanScan.apply(xr, z, self.w_x.to(dtype), self.w_h.to(dtype), self.b.to(dtype))
        return x + self.out_proj(out.transpose(0, 1).contiguous())


class RecurrentLM(nn.Module):
    def __init__(self, cfg: RecurrentConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(MambaGatedElman(cfg.d_model) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied, as in the seed's model
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
