"""The completion's log-probs as TRL's GRPOTrainer computes them since TRL 1.15: a fused LM head that never
holds the ``[rows, tokens, vocab]`` logits (``trl/trainer/utils.py`` ``add_fused_lm_head``; the projection and
its log-softmax in ``trl/kernels/chunked_logprob.py`` ``ChunkedLogProbFunction``, Apache-2.0, trimmed here to
what a model without logit softcapping allocates).

The head projects ``TOKEN_CHUNK`` tokens by ``VOCAB_CHUNK`` vocabulary entries at a time into one buffer of
that size, allocated at its full width even when the vocabulary is narrower (a 256-token vocabulary still
gets a 32,768-wide buffer), and folds each tile into a running logsumexp; the backward recomputes each tile
and accumulates the hidden states' and the head's gradients in fp32. On a GPU TRL folds each tile with a
Triton kernel that allocates nothing, and scores only the completion's tokens (``compact``); elsewhere it
folds with torch ops (a few tiles' worth of temporaries) and scores every position. :class:`FusedHead`
picks the CPU path; the trace's CUDA mirror (``mirror_cuda``) switches it to the GPU's.
"""

from __future__ import annotations

import contextlib

import torch

TOKEN_CHUNK = 4096
"""Tokens per projection tile (``TOKEN_CHUNK_SIZE``)."""
VOCAB_CHUNK = 32768
"""Vocabulary entries per tile (``_CHUNKED_LOGPROB_CHUNK_SIZE``): the buffer's width whatever the vocabulary."""


def _fold_forward(tile, targets, running_max, sum_exp, x_sum_exp, target_logit, vocab_start, inv_t, entropy):
    # TRL's _forward_tile (logit_scale 1, no softcap): the same ops, so the same temporaries
    z = tile.float() * 1.0
    z = z * inv_t
    local = targets - vocab_start
    new_m = torch.maximum(running_max, z.amax(-1))
    rescale = torch.exp(running_max - new_m)
    e = torch.exp(z - new_m.unsqueeze(-1))
    sum_exp.mul_(rescale).add_(e.sum(-1))
    if entropy:
        x_sum_exp.mul_(rescale).add_((e * z).sum(-1))
    running_max.copy_(new_m)
    n_cols = tile.shape[1]
    in_tile = (local >= 0) & (local < n_cols)
    target_z = z.gather(-1, local.clamp(0, n_cols - 1).unsqueeze(-1)).squeeze(-1)
    target_logit.copy_(torch.where(in_tile, target_z, target_logit))


def _fold_backward(tile, targets, log_z, grad_logprobs, vocab_start, inv_t):
    # TRL's _backward_tile without an entropy gradient (GRPO's loss has none)
    y = tile.float() * 1.0
    z = y * inv_t
    log_p = z - log_z.unsqueeze(-1)
    p = torch.exp(log_p)
    grad = torch.zeros_like(z)
    is_target = torch.arange(vocab_start, vocab_start + tile.shape[1], device=z.device) == targets.unsqueeze(-1)
    grad += grad_logprobs.unsqueeze(-1) * (is_target.float() - p)
    grad = grad * inv_t
    tile.copy_(grad * 1.0)


class ChunkedLogProb(torch.autograd.Function):
    """Per-token log-probs (and the entropy where asked) of ``hidden @ weight.T`` in tiles."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, entropy: bool, triton: bool):
        device, n_tokens, vocab = hidden.device, hidden.shape[0], weight.shape[0]
        compute = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else hidden.dtype
        running_max = torch.full((n_tokens,), float("-inf"), device=device, dtype=torch.float32)
        # TRL allocates all seven running statistics whichever outputs it was asked for
        sum_exp, x_sum_exp, sq_sum_exp, z_sum = (torch.zeros((n_tokens,), device=device) for _ in range(4))
        max_before_target = torch.full((n_tokens,), float("-inf"), device=device, dtype=torch.float32)  # noqa: F841
        target_logit = torch.zeros((n_tokens,), device=device, dtype=torch.float32)
        buffer = torch.empty((min(n_tokens, TOKEN_CHUNK), VOCAB_CHUNK), device=device, dtype=compute)
        for token_start in range(0, n_tokens, TOKEN_CHUNK):
            token_end = min(token_start + TOKEN_CHUNK, n_tokens)
            hidden_chunk = hidden[token_start:token_end].to(compute)
            for start in range(0, vocab, VOCAB_CHUNK):
                end = min(start + VOCAB_CHUNK, vocab)
                tile = buffer[:token_end - token_start, :end - start]
                torch.mm(hidden_chunk, weight[start:end].to(compute).t(), out=tile)
                if not triton:  # TRL's Triton kernel folds in registers: nothing allocated
                    rows = slice(token_start, token_end)
                    _fold_forward(tile, targets[rows], running_max[rows], sum_exp[rows], x_sum_exp[rows],
                                  target_logit[rows], start, 1 / temperature, entropy)
        log_z = running_max + torch.log(sum_exp)
        logprobs = target_logit - log_z
        out_entropy = log_z - x_sum_exp / sum_exp if entropy else None
        ctx.save_for_backward(hidden, weight, targets, log_z, log_z if out_entropy is None else out_entropy)
        ctx.compute, ctx.temperature, ctx.triton = compute, temperature, triton
        return logprobs, out_entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, targets, log_z, _ = ctx.saved_tensors
        n_tokens, vocab = hidden.shape[0], weight.shape[0]
        grad_hidden = torch.zeros(hidden.shape, device=hidden.device) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, device=weight.device) if ctx.needs_input_grad[1] else None
        buffer = torch.empty((min(n_tokens, TOKEN_CHUNK), VOCAB_CHUNK), device=hidden.device, dtype=ctx.compute)
        grad_logprobs = grad_logprobs.float().contiguous()
        for token_start in range(0, n_tokens, TOKEN_CHUNK):
            token_end = min(token_start + TOKEN_CHUNK, n_tokens)
            rows = slice(token_start, token_end)
            hidden_chunk = hidden[rows].to(ctx.compute)
            for start in range(0, vocab, VOCAB_CHUNK):
                end = min(start + VOCAB_CHUNK, vocab)
                w_chunk = weight[start:end].to(ctx.compute)
                tile = buffer[:token_end - token_start, :end - start]
                torch.mm(hidden_chunk, w_chunk.t(), out=tile)
                if ctx.triton:
                    # on a GPU the tile becomes the logits' gradient in place, and TRL's _addmm_fp32 accumulates a
                    # half-precision tile with torch.addmm(out_dtype=float32, out=acc): nothing allocated either
                    # way (an fp32 tile's .float() is itself), so a fake step skips both
                    continue
                _fold_backward(tile, targets[rows], log_z[rows], grad_logprobs[rows], start, 1 / ctx.temperature)
                if grad_hidden is not None:  # TRL's _addmm_fp32 off CUDA: fp32 copies of half-precision operands
                    grad_hidden[rows].addmm_(tile.float(), w_chunk.float())
                if grad_weight is not None:
                    grad_weight[start:end].addmm_(tile.t().float(), hidden_chunk.float())
        return (grad_hidden.to(hidden.dtype) if grad_hidden is not None else None,
                grad_weight.to(weight.dtype) if grad_weight is not None else None, None, None, None, None)


def fused_completion_logprobs(hidden_states: torch.Tensor, weight: torch.Tensor, sequences: torch.Tensor,
                              completion: int, *, entropy: bool, triton: bool, temperature: float = 1.0,
                              fp32_head: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """TRL's ``_fused_forward`` after the backbone: ``hidden_states`` ``[rows, seq, hidden]`` -> the log-probs
    (and entropies) of the last ``completion`` tokens, ``[rows, completion]`` each, as ``views`` of the
    ``[rows, seq - 1]`` per-position outputs (TRL's ``_get_per_token_logps_and_entropies`` slices them).
    ``fp32_head`` (cast_lm_head_to_fp32): TRL casts the hidden states to fp32 (a copy, saved for the
    backward) and runs the head outside autocast, so its tiles are fp32."""
    labels = sequences.clone()  # TRL: input_ids.masked_fill(attention_mask == 0, -100); no padding here
    labels[:, :-completion] = -100
    hidden_states, labels = hidden_states[:, :-1], labels[:, 1:]
    mask = labels != -100
    if fp32_head:
        hidden_states = hidden_states.float()
    with torch.autocast(hidden_states.device.type, enabled=False) if fp32_head else contextlib.nullcontext():
        return _scored(hidden_states, weight, labels, mask, completion, entropy, triton, temperature)


def _scored(hidden_states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor,
            completion: int, entropy: bool, triton: bool,
            temperature: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The tiles run over the positions TRL scores, then its per-position outputs cut to the completion."""
    if triton:  # only the completion's tokens are scored on a GPU
        # hidden_states[mask] and labels[mask], as TRL indexes them: the mask is the last `completion` positions of
        # every row (no padding), so a slice copied out is the same tensor, with a shape fake tensors can know
        scored = hidden_states[:, -completion:].reshape(-1, hidden_states.size(-1))
        targets = labels[:, -completion:].reshape(-1)
        per_token = ChunkedLogProb.apply(scored, weight, targets, temperature, entropy, True)
        per_token = [None if x is None else x.new_zeros(mask.shape).masked_scatter(mask, x) for x in per_token]
    else:
        per_token = ChunkedLogProb.apply(hidden_states.reshape(-1, hidden_states.size(-1)), weight,
                                         labels.clamp(min=0).reshape(-1), temperature, entropy, False)
        per_token = [None if x is None else x.view(mask.shape).masked_fill(~mask, 0) for x in per_token]
    logprobs, entropies = per_token
    logprobs.sum().neg() / mask.sum().clamp(min=1)  # TRL's forward also returns this loss; GRPO does not use it
    return logprobs[:, -completion:], None if entropies is None else entropies[:, -completion:]
