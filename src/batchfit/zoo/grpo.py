"""A GRPO-like RL step (the job of seed 003): generate, then update the policy.

The policy is GPT-2 small; a frozen copy is the reference model for the KL term. Each step
generates ``max_new_tokens`` tokens greedily for every prompt with a KV cache (the cache
grows with batch x length: the memory seed 003 saw jump), scores them (random rewards stand
in for the reward function: memory and time do not depend on their values), normalises the
rewards within each group of ``group_size`` completions, and takes a clipped policy-gradient
step with a KL penalty, as GRPO does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchfit.workload import Workload
from batchfit.zoo.transformer import Transformer, TransformerConfig

GPT2 = dict(vocab_size=50257, d_model=768, n_layers=12, n_heads=12, d_ff=3072)


class PolicyAndReference(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.policy = Transformer(cfg)
        self.reference = Transformer(cfg).requires_grad_(False)


def _logprobs(model: Transformer, sequences: torch.Tensor, prompt_len: int) -> torch.Tensor:
    logits = model(sequences[:, :-1])[:, prompt_len - 1:]
    targets = sequences[:, prompt_len:]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def grpo_workload(seq_len: int | None = None, *, prompt_len: int = 32, group_size: int = 8,
                  kl_coef: float = 0.02, clip: float = 0.2) -> Workload:
    """``seq_len`` is the number of new tokens generated per prompt (default 144)."""
    max_new_tokens = seq_len or 144
    cfg = TransformerConfig(seq_len=prompt_len + max_new_tokens, **GPT2)

    def make_batch(batch_size: int, device: torch.device) -> torch.Tensor:
        return torch.randint(0, cfg.vocab_size, (batch_size, prompt_len), device=device)

    def generate(model: PolicyAndReference, prompts: torch.Tensor) -> dict:
        caches = [{} for _ in model.policy.blocks]
        logits = model.policy(prompts, caches, 0)
        tokens = [prompts]
        for t in range(max_new_tokens):
            token = logits[:, -1].argmax(dim=-1, keepdim=True)
            tokens.append(token)
            if t + 1 < max_new_tokens:
                logits = model.policy(token, caches, prompt_len + t)
        sequences = torch.cat(tokens, dim=1)
        rewards = torch.randn(prompts.shape[0], device=prompts.device)
        return {"sequences": sequences, "rewards": rewards}

    def loss_fn(model: PolicyAndReference, batch: dict) -> torch.Tensor:
        sequences, rewards = batch["sequences"], batch["rewards"]
        logp = _logprobs(model.policy, sequences, prompt_len)
        with torch.no_grad():
            ref_logp = _logprobs(model.reference, sequences, prompt_len)
        groups = rewards.view(-1, group_size)
        advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1, 1)
        ratio = torch.exp(logp - logp.detach())  # on-policy: the old log-probs are these, detached
        policy_loss = -torch.min(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages).mean()
        kl = (torch.exp(ref_logp - logp) - (ref_logp - logp) - 1).mean()
        return policy_loss + kl_coef * F.relu(kl)

    return Workload(
        name="grpo-gpt2-124m", build_model=lambda: PolicyAndReference(cfg), make_batch=make_batch,
        loss_fn=loss_fn, generate=generate, group_size=group_size, tokens_per_sample=prompt_len + max_new_tokens,
        description=f"GRPO RL step: generate, then update a GPT-2 small policy against a frozen reference; "
                    f"group {group_size}, "
                    f"{prompt_len}-token prompts, {max_new_tokens} new tokens with a KV cache",
    )
