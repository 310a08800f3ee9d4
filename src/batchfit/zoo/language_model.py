"""The language-model workload every zoo transformer (and enoki, a file of its own) is built as:
next-token prediction on random tokens, with the head's input for --loss chunked:N / fused-linear."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from batchfit.errors import OptionError
from batchfit.workload import Workload


def head_input(model: nn.Module, head_name: str, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``model`` with its output head ``head_name`` (a bias-free nn.Linear) passing its input
    through: (the hidden states the head would project, the head's weight). The head module is
    still called (its hooks and name stay in a trace); only its matmul is skipped. ``model`` may be
    wrapped: DDP (the wrapper runs, its gradient hooks see the head's gradient) or FSDP2 (the root
    keeps its parameters gathered after forward, so the weight read here is the whole one, and
    its gradient is reduce-scattered with the root's at the end of backward)."""
    plain = getattr(model, "module", model)  # DDP's wrapper is called; the head is the model's
    head = getattr(plain, head_name, None)
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise OptionError(f"`loss` chunked:N / fused-linear needs {type(plain).__name__}.{head_name} to be a "
                          "bias-free nn.Linear output head: use `loss` plain")
    head.forward = lambda x: x
    try:
        hidden = model(*args, **kwargs)
    finally:
        del head.forward
    return hidden, head.weight


def language_model_workload(*, name: str, build_model: Callable[[], nn.Module], vocab_size: int,
                            seq_len: int, description: str) -> Workload:
    """Next-token prediction on random tokens: ``model(idx) -> logits``, cross-entropy loss."""

    def make_batch(batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(0, vocab_size, (batch_size, seq_len), device=device)
        y = torch.randint(0, vocab_size, (batch_size, seq_len), device=device)
        return x, y

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    def lm_parts(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]):
        """(hidden states before ``model.head``, its weight, the targets): for --loss chunked/fused."""
        x, y = batch
        hidden, weight = head_input(model, "head", x)
        return hidden, weight, y

    return Workload(name=name, build_model=build_model, make_batch=make_batch, loss_fn=loss_fn,
                    tokens_per_sample=seq_len, description=description, lm_parts=lm_parts)
