"""The language-model losses of ``--loss``: plain, chunked:N and fused-linear.

``plain`` is the Workload's own ``loss_fn`` (the zoo's and HF's materialise the whole logits
[B, T, V] and call ``F.cross_entropy``). The other two need the hidden states before the
output projection, the projection's weight and the targets, which the Workload gives through
``Workload.lm_parts`` (the zoo's Transformer language models and HF causal LMs have it):

- ``chunked:N``, :func:`chunked_cross_entropy`: torchtune's ``CEWithChunkedOutputLoss``
  (torchtune/modules/loss/ce_chunked_output_loss.py, used with the model's
  ``set_num_output_chunks``): the hidden states are cut in N chunks along the sequence
  (``tensor_split(N, dim=1)``), each goes through the head on its own, is upcast to fp32 on
  its own and summed into a cross-entropy; the sum is divided by the count of targets that
  are not ``ignore_index``. The full fp32 logits never exist at once; each chunk's fp32
  log-softmax is still saved for backward (as in torchtune), so the saving is the full logits'
  second and third copies (the upcast and the gradients of backward), not the first.
- ``fused-linear``, :class:`FusedLinearCrossEntropy`: a torch-native mirror of Liger's
  ``LigerFusedLinearCrossEntropy`` (src/liger_kernel/ops/fused_linear_cross_entropy.py,
  ``fused_linear_cross_entropy_forward``): the forward loops over chunks of rows and computes
  the logits, the loss and the gradients w.r.t. the hidden states and the head weight, and
  saves only those gradients. Mirrored buffers: ``grad_input`` (zeros like the hidden states),
  ``grad_weight`` (zeros like the weight, when it needs a gradient), ``loss_1d`` (fp32, one per
  row), the logits chunk ``[chunk_size, V]`` in the matmul's dtype, whose gradient is written
  in place (Liger's cross-entropy kernel does the same), ``chunk_size`` as Liger picks it
  (``next_power_of_2(cdiv(BT, cdiv(V, H)))``); backward scales the saved gradients in place
  (Liger's ``element_mul_kernel``). Left out: the Triton kernel's registers (the softmax is
  computed with torch ops on the chunk: a logsumexp vector and a gather per chunk, C floats
  each), the z-loss, label smoothing, softcapping, class weights, token scaling and accuracy
  outputs, the ``mm(out=)`` path (the CPU path allocates the ``[chunk, H]`` product before
  copying it into ``grad_input``, as Liger's own non-CUDA path does), and ``.item()``
  (fake tensors have no values: the count of targets stays a tensor).

Under tensor parallelism the plan may keep the output head's logits sharded on the vocabulary
(``distributed/tp_plans.py``, ``--tp-loss sharded``): it says so on the model
(:data:`TP_LOSS_ATTR`), and :func:`loss_context` is then torch's ``loss_parallel()``, which the
step enters around the forward (where the loss is computed) and the backward, as torchtitan's
``train_context`` does (torchtitan/distributed/utils.py ``get_train_context``). The Workload's
own ``F.cross_entropy`` then runs torch's vocabulary-parallel log-softmax and NLL
(torch/distributed/tensor/parallel/loss.py) on each rank's [B, T, V/N] shard.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from batchfit.errors import OptionError
from batchfit.options import Loss
from batchfit.workload import Workload

IGNORE_INDEX = -100
"""Targets equal to this count for nothing (HF's and torch's default)."""

TP_LOSS_ATTR = "batchfit_tp_loss"
"""Set by a tensor-parallel plan on the model it parallelized: "sharded" (the head's logits stay
split by the vocabulary: the loss must run under loss_parallel), "gathered" (all-gathered onto
every rank) or "replicated" (the plan leaves the head whole). A Workload's own ``parallelize``
that keeps the logits sharded sets it to "sharded"."""

LmParts = Callable[[nn.Module, Any], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def tp_loss_of(model: nn.Module) -> str | None:
    """The loss a tensor-parallel plan built ``model`` for (:data:`TP_LOSS_ATTR`), None without TP
    (a DDP wrapper is looked through)."""
    return getattr(getattr(model, "module", model), TP_LOSS_ATTR, None)


def tp_loss_refusal(loss: str) -> str:
    """Why ``loss`` (not plain) cannot run on a model a tensor-parallel plan built (one line): ``lm_parts``
    multiplies by the head's weight itself, under TP a DTensor split by the vocabulary, which the chunked and
    fused losses do not take."""
    return (f"`loss` {loss} does not run under tensor parallelism: use `loss` plain (the TP plan's "
            "vocabulary-sharded loss, `tp_loss` sharded, never gathers the logits either), or a ddp / fsdp strategy")


def loss_context(model: nn.Module) -> Callable[[], contextlib.AbstractContextManager]:
    """What the loss's forward and backward run under: torch's ``loss_parallel()`` when the
    model's logits are sharded on the vocabulary, else nothing."""
    if tp_loss_of(model) != "sharded":
        return contextlib.nullcontext
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunks: int,
                          ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets``, N chunks of the sequence
    at a time (torchtune's CEWithChunkedOutputLoss): hidden [B, T, H], weight [V, H], targets [B, T]."""
    total = (targets != ignore_index).sum()
    loss = None
    for hidden_chunk, target_chunk in zip(hidden.tensor_split(chunks, dim=1),
                                          targets.tensor_split(chunks, dim=1), strict=True):
        logits = F.linear(hidden_chunk, weight)
        part = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), target_chunk.reshape(-1),
                               ignore_index=ignore_index, reduction="sum")
        loss = part if loss is None else loss + part
    return loss / total


def _chunk_size(rows: int, hidden_size: int, vocab: int) -> int:
    """Liger's: bound the transient logits to about rows x hidden elements."""
    inc_factor = -(-vocab // hidden_size)
    per = -(-rows // inc_factor)
    return min(1 << (per - 1).bit_length(), rows)


class FusedLinearCrossEntropy(torch.autograd.Function):
    """Linear + mean cross-entropy whose forward also computes both gradients, chunk by chunk of
    rows, and saves only them (Liger's fused linear cross-entropy; see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
        rows, hidden_size = hidden.shape
        vocab = weight.shape[0]
        chunk = _chunk_size(rows, hidden_size, vocab)
        grad_input = torch.zeros_like(hidden)
        grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
        loss_1d = torch.zeros(rows, dtype=torch.float32, device=hidden.device)
        keep = targets != ignore_index
        scale = 1.0 / keep.sum()  # a tensor: Liger's .item() needs values a fake tensor has not
        for start in range(0, rows, chunk):
            end = min(start + chunk, rows)
            x = hidden[start:end]
            logits = x @ weight.t()  # [chunk, V] in the matmul's dtype (autocast's under autocast)
            target = targets[start:end]
            kept = keep[start:end]
            safe = target.masked_fill(~kept, 0)
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe.unsqueeze(1)).squeeze(1)
            loss_1d[start:end] = (lse - picked).float() * kept
            # the gradient of the mean loss w.r.t. the logits, in place: (softmax - onehot) / n
            logits.sub_(lse.unsqueeze(1)).exp_()
            logits.scatter_add_(1, safe.unsqueeze(1), -kept.to(logits.dtype).unsqueeze(1))
            logits.mul_((scale * kept).to(logits.dtype).unsqueeze(1))
            del lse, picked
            grad_input[start:end] = logits @ weight
            if grad_weight is not None:  # as Liger: addmm into the gradient (out=: no autocast),
                # the chunk's operands in the gradient's dtype (no-ops unless autocast made bf16 logits)
                torch.addmm(grad_weight, logits.t().to(grad_weight.dtype), x.to(grad_weight.dtype),
                            out=grad_weight)
            del logits
        loss = loss_1d.sum() * scale
        ctx.save_for_backward(grad_input, grad_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_input, grad_weight = ctx.saved_tensors
        # Liger skips this when grad_output is exactly 1 (a value check fake tensors cannot do).
        grad_input.mul_(grad_output)
        if grad_weight is not None:
            grad_weight.mul_(grad_output)
        return grad_input, grad_weight, None, None


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                               ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets`` without the full logits:
    hidden [..., H], weight [V, H], targets [...]."""
    return FusedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.size(-1)), weight, targets.reshape(-1),
                                         ignore_index)


def lm_loss(loss: Loss, workload: Workload) -> Callable[[nn.Module, Any], torch.Tensor]:
    """The ``(model, batch) -> loss`` of ``--loss``: the Workload's own for ``plain``, else the
    chunked or fused loss over ``workload.lm_parts``."""
    if loss.kind == "plain":
        return workload.loss_fn
    parts = workload.lm_parts
    if parts is None:
        raise OptionError(f"`loss` {loss} needs the hidden states and the output head, and {workload.name} "
                          "gives no lm_parts: set Workload.lm_parts, or use `loss` plain")
    if loss.kind == "fused-linear":
        def fused(model: nn.Module, batch: Any) -> torch.Tensor:
            hidden, weight, targets = parts(model, batch)
            return fused_linear_cross_entropy(hidden, weight, targets)

        return fused
    chunks = loss.chunks or 1
    seq = workload.tokens_per_sample
    if seq is not None and chunks > seq:  # tensor_split would make empty chunks, one op each (100,000 of them)
        raise OptionError(f"`loss` {loss}: {chunks} chunks of a {seq}-token sequence; use chunked:N with N at most "
                          f"{seq} (torchtune uses 8, e.g. chunked:8)")

    def chunked(model: nn.Module, batch: Any) -> torch.Tensor:
        hidden, weight, targets = parts(model, batch)
        return chunked_cross_entropy(hidden, weight, targets, chunks)

    return chunked

