"""A GRPO step (the job of seed 003): generate, score against a frozen reference, update the policy.

The step is TRL's ``GRPOTrainer`` in its memory-deciding parts, one phase each (``phases.py``):

1. ``generate``: every completion is sampled with a KV cache (:func:`sample_token`) (the cache grows with
   rows x length: the memory seed 003 saw jump). The rows are the whole generation batch:
   ``steps_per_generation`` update steps' worth (TRL's ``generation_batch_size`` per device),
   each prompt repeated ``group_size`` times (TRL's ``num_generations``).
2. ``reference``: with no gradients, the reference model's log-probs of every completion, in
   chunks of the update's batch (TRL's ``_get_per_token_logps_and_entropies``), and the
   policy's own "old" log-probs where TRL computes them (``old_logprobs``); random rewards
   stand in for the reward function (memory and time do not depend on their values), normalised
   within each group.
3. ``forward`` / ``backward`` / ``optimizer``: a clipped policy-gradient step with a KL penalty on
   the first update batch of the generation batch (every one of them is the same size).

Two model families share this step: the zoo's GPT-2 small (``grpo-gpt2-124m``) and any
transformers causal LM built from its config (``hf_grpo_workload``, what ``--trainer`` with a
TRL GRPOConfig traces); each gives the step its backbone, its LM head and its decoding (:class:`Policy`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from batchfit.errors import OptionError
from batchfit.options import Rollout
from batchfit.workload import KEEP_FP32, Workload, shape_only_call
from batchfit.zoo.fused_logprobs import fused_completion_logprobs
from batchfit.zoo.transformer import Transformer, TransformerConfig

GPT2 = dict(vocab_size=50257, d_model=768, n_layers=12, n_heads=12, d_ff=3072)


@dataclass(frozen=True)
class Policy:
    """How one model family runs in the GRPO step."""

    build: Callable[[], nn.Module]
    """Builds one copy of the model (the policy; the reference is a second, frozen, copy)."""
    hidden: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    """(model, sequences) -> the backbone's last hidden states ``[rows, seq, hidden]``, no logits (TRL's fused
    LM head runs the backbone alone)."""
    head: Callable[[nn.Module], torch.Tensor]
    """model -> the LM head's weight ``[vocab, hidden]``."""
    decode: Callable[[nn.Module, torch.Tensor, int], torch.Tensor]
    """(model, prompts, new tokens) -> prompts and completions ``[rows, prompt + new tokens]``."""
    logits: Callable[[nn.Module, torch.Tensor, int], torch.Tensor] | None = None
    """(model, sequences, completion length) -> the logits that predict the completion ``[rows, completion,
    vocab]``: given, the completion is scored from them by :func:`selective_log_softmax` (TRL <= 1.14, and seed
    003's own GRPO loop) instead of TRL >= 1.15's fused LM head, which never holds them."""


class PolicyAndReference(nn.Module):
    def __init__(self, build: Callable[[], nn.Module], reference: bool = True,
                 fp32_head: Callable[[nn.Module], torch.Tensor] | None = None) -> None:
        """``fp32_head``: the head's weight of a copy, kept in fp32 in both copies (TRL's cast_lm_head_to_fp32)."""
        super().__init__()
        self.policy = build()
        self.reference = build().requires_grad_(False) if reference else None
        for copy in (self.policy, self.reference):
            if fp32_head is not None and copy is not None:
                cast_head_to_fp32(copy, fp32_head(copy))
        self.triton = False
        """Whether the log-probs fold their tiles as TRL's Triton kernel does on a GPU (``zoo/fused_logprobs.py``)."""

    def mirror_cuda(self) -> None:
        """Called by the trace's CUDA mirror: on a GPU, TRL scores the completion with its Triton kernel."""
        self.triton = True


def cast_head_to_fp32(model: nn.Module, weight: torch.Tensor) -> None:
    """TRL's ``_cast_lm_head_to_fp32`` (grpo_trainer.py): the head that holds ``weight`` stays fp32 when the step
    casts the model (``workload.KEEP_FP32``) and its forward (generation's logits) runs in fp32 on an fp32
    copy of the hidden states; a module that shares the weight (a tied embedding) gets it in fp32 too, its output
    cast back to the model's dtype, as TRL's hook does."""
    owners = [m for m in model.modules() if getattr(m, "weight", None) is weight]
    head = owners[-1]  # the output head comes after the embedding it may share its weight with
    setattr(head, KEEP_FP32, True)

    def fp32_forward(hidden_states: torch.Tensor) -> torch.Tensor:
        bias = getattr(head, "bias", None)
        return F.linear(hidden_states.to(torch.float32), head.weight.to(torch.float32),
                        None if bias is None else bias.to(torch.float32))

    head.forward = fp32_forward
    for tied in owners[:-1]:
        def back_to_model_dtype(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            dtype = next((p.dtype for p in model.parameters() if p is not head.weight and p.is_floating_point()),
                         output.dtype)
            return output.to(dtype)

        tied.register_forward_hook(back_to_model_dtype)


def _logprobs(policy: Policy, model: nn.Module, sequences: torch.Tensor, completion: int, *, entropy: bool,
              triton: bool, fp32_head: bool = False) -> torch.Tensor:
    """The completion's log-probs as TRL's GRPO computes them (its fused LM head: ``zoo/fused_logprobs.py``); the
    policy's entropies too, as TRL asks its policy's head for them (the reference's head only for log-probs).
    A policy with ``logits`` scores from its whole logits instead (the temperature's in-place division kept:
    its value changes no memory)."""
    if policy.logits is not None:
        logits = policy.logits(model, sequences, completion)
        logits.div_(1.0)
        return selective_log_softmax(logits, sequences[:, -completion:])
    logprobs, entropies = fused_completion_logprobs(policy.hidden(model, sequences), policy.head(model), sequences,
                                                    completion, entropy=entropy, triton=triton, fp32_head=fp32_head)
    return logprobs


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits).gather(index)`` as TRL computes it (``trl/trainer/utils.py``; its PPOTrainer's, and
    its GRPOTrainer's before 1.15): in fp32 the chosen logits less each row's logsumexp, one row at a time (the
    row's exponentials only); in half precision a log_softmax per row."""
    index = index.unsqueeze(-1)
    if logits.dtype in (torch.float32, torch.float64):
        chosen = torch.gather(logits, dim=-1, index=index).squeeze(-1)
        return chosen - torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
    return torch.stack([torch.log_softmax(row, dim=-1).gather(-1, i).squeeze(-1) for row, i in zip(logits, index)])


def _chunked_logprobs(policy: Policy, model: nn.Module, sequences: torch.Tensor, completion: int,
                      chunk: int, *, entropy: bool, triton: bool, fp32_head: bool = False) -> torch.Tensor:
    """Log-probs in chunks of ``chunk`` rows, concatenated at the end, as TRL scores the generation batch."""
    parts = [_logprobs(policy, model, sequences[i:i + chunk], completion, entropy=entropy, triton=triton,
                       fp32_head=fp32_head) for i in range(0, len(sequences), chunk)]
    return torch.cat(parts)


def grpo_step(policy: Policy, rollout: Rollout, vocab_size: int, *, name: str, description: str,
              kl_coef: float = 0.02, clip: float = 0.2) -> Workload:
    """The GRPO step of ``policy`` under ``rollout``'s settings; ``batch_size`` is the update's
    completions per device (TRL's ``per_device_train_batch_size``)."""
    prompt_len, new_tokens, group = rollout.prompt_len, rollout.new_tokens, rollout.group_size
    per_generation, fp32 = rollout.steps_per_generation, rollout.fp32_head
    if fp32 and policy.logits is not None:
        raise OptionError(f"cast_lm_head_to_fp32 is traced on TRL's fused LM head (an hf: causal LM); {name} scores "
                          "from its own logits, not TRL's: drop cast_lm_head_to_fp32, or give hf:<model>")

    def make_batch(batch_size: int, device: torch.device) -> torch.Tensor:
        # each prompt already repeated once per completion (TRL's RepeatSampler): the rows of a generation
        return torch.randint(0, vocab_size, (batch_size * per_generation, prompt_len), device=device)

    def generate(model: PolicyAndReference, prompts: torch.Tensor) -> dict:
        # a trace runs it once per shape and writes it again, or from the line through two sizes (trace/written.py)
        sequences = shape_only_call(_decode_key(model.policy, prompts, new_tokens), prompts.shape[0], prompts.device,
                                 lambda: policy.decode(model.policy, prompts, new_tokens))
        rewards = torch.randn(prompts.shape[0], device=prompts.device)
        groups = rewards.view(-1, group)
        advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1, 1)
        return {"sequences": sequences, "advantages": advantages}

    def reference(model: PolicyAndReference, batch: dict) -> dict:
        chunk = len(batch["sequences"]) // per_generation
        if model.reference is not None:
            batch["ref_logp"] = _chunked_logprobs(policy, model.reference, batch["sequences"], new_tokens, chunk,
                                                  entropy=False, triton=model.triton, fp32_head=fp32)
        if rollout.old_logprobs:
            batch["old_logp"] = _chunked_logprobs(policy, model.policy, batch["sequences"], new_tokens, chunk,
                                                  entropy=True, triton=model.triton, fp32_head=fp32)
        return batch

    def loss_fn(model: PolicyAndReference, batch: dict) -> torch.Tensor:
        rows = len(batch["sequences"]) // per_generation  # the first update batch; the others are alike
        sequences, advantages = batch["sequences"][:rows], batch["advantages"][:rows]
        logp = _logprobs(policy, model.policy, sequences, new_tokens, entropy=True, triton=model.triton,
                         fp32_head=fp32)
        old = batch["old_logp"][:rows] if "old_logp" in batch else logp.detach()  # on-policy: these, detached
        ratio = torch.exp(logp - old)
        loss = -torch.min(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages).mean()
        if "ref_logp" in batch:
            ref_logp = batch["ref_logp"][:rows]
            kl = (torch.exp(ref_logp - logp) - (ref_logp - logp) - 1).mean()
            loss = loss + kl_coef * F.relu(kl)
        return loss

    return Workload(
        name=name, make_batch=make_batch,
        build_model=lambda: PolicyAndReference(policy.build, rollout.reference, policy.head if fp32 else None),
        loss_fn=loss_fn, generate=generate, reference=reference if rollout.reference or rollout.old_logprobs else None,
        group_size=rollout.batch_multiple, tokens_per_sample=prompt_len + new_tokens,
        description=f"{description}; GRPO: group {group}, {prompt_len}-token prompts, {new_tokens} new tokens with "
                    f"a KV cache" + (f", {per_generation} update steps per generation" if per_generation > 1 else "")
                    + ("" if rollout.reference else ", no reference model (beta 0)")
                    + (", LM head in fp32" if fp32 else ""))


def _decode_key(model: nn.Module, prompts: torch.Tensor, new_tokens: int) -> tuple:
    """Everything but the rows that what a decode loop allocates depends on (``trace/written.py``)."""
    device = prompts.device.type
    return ("decode", id(model), tuple(prompts.shape[1:]), prompts.dtype, new_tokens, torch.is_grad_enabled(),
            torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device),
            tuple(sorted({str(p.dtype) for p in model.parameters()})))


def sample_token(last_logits: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One draw as transformers' ``generate`` samples under TRL's defaults (``do_sample``, temperature 1, no top-k
    or top-p: no logits processor): the last position's logits copied to fp32, their softmax, a multinomial draw.
    Returns the tokens ``[rows, 1]`` and the two ``[rows, vocab]`` fp32 tensors, which ``generate`` keeps alive
    through the next forward (until the next draw replaces them)."""
    scores = last_logits.to(copy=True, dtype=torch.float32)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, num_samples=1), (scores, probs)


def _zoo_policy(cfg: TransformerConfig) -> Policy:
    def decode(model: Transformer, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
        caches = [{} for _ in model.blocks]
        tokens, token, kept = [prompts], prompts, None
        for t in range(new_tokens):
            out = model(token, caches, 0 if t == 0 else prompts.shape[1] + t - 1)
            token, kept = sample_token(out[:, -1])
            del out
            tokens.append(token)
        del kept
        return torch.cat(tokens, dim=1)

    def logits(model: Transformer, sequences: torch.Tensor, completion: int) -> torch.Tensor:
        return model(sequences)[:, -completion - 1:-1]  # every position's logits: this loop keeps them all

    # Seed 003's lean GRPO loop is not TRL: it scores from the model's whole logits. Measured there at batch 96
    # (144 new tokens, RTX 4090): 21.78 GB allocated; TRL's fused head would hold far less.
    return Policy(build=lambda: Transformer(cfg), hidden=lambda model, sequences: model.hidden(sequences),
                  head=lambda model: model.head.weight, decode=decode, logits=logits)


def grpo_workload(seq_len: int | None = None, *, rollout: Rollout | None = None) -> Workload:
    """GPT-2 small under GRPO; ``seq_len`` is the number of new tokens generated per prompt (default 144)."""
    rollout = rollout or Rollout()
    if seq_len is not None:
        rollout = dataclasses.replace(rollout, new_tokens=seq_len)
    cfg = TransformerConfig(seq_len=rollout.prompt_len + rollout.new_tokens, **GPT2)
    return grpo_step(_zoo_policy(cfg), rollout, cfg.vocab_size, name="grpo-gpt2-124m",
                     description="GRPO RL step: generate, then update a GPT-2 small policy against a frozen reference")
