"""A transformers causal LM under TRL's PPO step (``trl/experimental/ppo/ppo_trainer.py``), what
``--trainer`` with a PPOConfig traces for an ``hf:`` model.

Four models, as TRL holds them: the policy and a value model (the same architecture as a
``ForSequenceClassification`` with one label: its backbone and a scalar ``score`` head), both trained
by one optimizer (TRL's ``PolicyAndValueWrapper``); a frozen reference policy and a frozen reward
model. One step, in the phases the step announces:

1. ``generate``: the rollout's queries (per-device batch x gradient accumulation x mini-batches rows)
   generated in chunks of ``local_rollout_forward_batch_size`` with ``output_scores``: every new
   token's logits in fp32, divided by the temperature (``TemperatureLogitsWarper``, a new tensor),
   kept, stacked per chunk, then all chunks padded into one tensor (``batch_generation``, ``pad``).
   TRL keeps that tensor (``logitss``) to the next rollout: it is alive through the update and the
   next generation, so it is kept here on the model between steps.
2. ``reference``: with no gradients, chunk by chunk: the policy's log-probs from those logits; the
   reference's whole-sequence logits (``forward(..., output_hidden_states=True)``, no
   ``logits_to_keep``) and its log-probs; the value model's and the reward model's scores
   (``get_reward``: the backbone's hidden states, the score head).
3. the update of the first micro-batch: the value model's backbone and head, the policy's
   whole-sequence logits, the clipped policy and value losses, backward.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from batchfit.options import Rollout
from batchfit.workload import Workload
from batchfit.zoo.grpo import selective_log_softmax
from batchfit.zoo.hf import _transformers, _unpacked_sequences, hf_workload


class PPOModels(nn.Module):
    def __init__(self, build_policy, build_scorer) -> None:
        super().__init__()
        self.policy, self.value_model = build_policy(), build_scorer()
        self.reference = build_policy().requires_grad_(False)
        self.reward_model = build_scorer().requires_grad_(False)
        self.rollout_logits: torch.Tensor | None = None
        """TRL's ``logitss``: the last rollout's generation logits, alive until the next rollout replaces them."""


def _scores(scorer: nn.Module, sequences: torch.Tensor) -> torch.Tensor:
    """TRL's ``get_reward``: the backbone's hidden states (all of them kept), the score head on the last."""
    backbone = getattr(scorer, scorer.base_model_prefix)
    output = backbone(input_ids=sequences, return_dict=True, output_hidden_states=True, use_cache=False)
    return scorer.score(output.hidden_states[-1])


def ppo_workload(target: str, rollout: Rollout) -> Workload:
    """``hf:<target>`` (a causal LM) as the policy of TRL's PPO step under ``rollout``."""
    base = hf_workload(target, rollout.prompt_len + rollout.new_tokens)
    transformers = _transformers()
    with torch.device("meta"):
        config = base.build_model().config
    prompt, new_tokens, per_rollout = rollout.prompt_len, rollout.new_tokens, rollout.steps_per_generation

    scorer_config = copy.deepcopy(config)
    scorer_config.num_labels = 1  # TRL's value and reward models: one score per token

    def build_scorer() -> nn.Module:
        return transformers.AutoModelForSequenceClassification.from_config(scorer_config)

    def make_batch(batch_size: int, device: torch.device) -> torch.Tensor:
        return torch.randint(0, config.vocab_size, (batch_size * per_rollout, prompt), device=device)

    def decode(model: nn.Module, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``generate(..., output_scores=True)`` and TRL's ``torch.stack(output.scores, 1)``."""
        tokens, scores, cache, step = [queries], [], None, queries
        for _ in range(new_tokens):
            out = model(input_ids=step, cache=cache, use_cache=True, logits_to_keep=1)
            cache = out.cache
            last = out.logits[:, -1, :].to(copy=True, dtype=torch.float32)
            del out
            scores.append(last / 1.0)  # the temperature warper: a new tensor (its value changes no memory)
            del last
            step = torch.softmax(scores[-1], dim=-1).argmax(dim=-1, keepdim=True)  # sampling's probabilities
            tokens.append(step)
        logits = torch.stack(scores, 1)
        del scores
        return torch.cat(tokens, dim=1), logits

    def generate(model: PPOModels, queries: torch.Tensor) -> dict:
        chunk = rollout.chunk_rows or len(queries)
        sequences, chunks = [], []
        with _unpacked_sequences(transformers):
            for i in range(0, len(queries), chunk):
                done, logits = decode(model.policy, queries[i:i + chunk])
                sequences.append(done)
                chunks.append(logits)
        padded = torch.zeros((len(chunks), chunk, new_tokens, config.vocab_size), dtype=torch.float32,
                             device=queries.device)  # TRL's pad(): every chunk copied into one tensor
        for i, logits in enumerate(chunks):
            padded[i, :len(logits)] = logits
        del chunks
        model.rollout_logits = padded.view(-1, new_tokens, config.vocab_size)[:len(queries)]  # the last one's freed
        return {"sequences": torch.cat(sequences)}

    def reference(model: PPOModels, batch: dict) -> dict:
        sequences, chunk = batch["sequences"], rollout.chunk_rows or len(batch["sequences"])
        logprobs, ref_logprobs, values, scores = [], [], [], []
        with _unpacked_sequences(transformers):
            for i in range(0, len(sequences), chunk):
                rows, responses = sequences[i:i + chunk], sequences[i:i + chunk, prompt:]
                logprobs.append(selective_log_softmax(model.rollout_logits[i:i + chunk], responses))
                output = model.reference(input_ids=rows, return_dict=True, output_hidden_states=True)
                ref_logits = output.logits[:, prompt - 1:-1]
                ref_logits /= 1.0  # the temperature, in place
                ref_logprobs.append(selective_log_softmax(ref_logits, responses))
                del output, ref_logits
                full_value = _scores(model.value_model, rows)
                values.append(full_value[:, prompt - 1:-1].squeeze(-1))
                scores.append(_scores(model.reward_model, rows)[:, -1].squeeze(-1))
        batch.update(logprobs=torch.cat(logprobs), ref_logprobs=torch.cat(ref_logprobs), values=torch.cat(values),
                     scores=torch.cat(scores))
        kl = batch["logprobs"] - batch["ref_logprobs"]
        rewards = -0.05 * kl
        rewards[:, -1] += batch["scores"]
        batch["returns"] = rewards + batch["values"]  # GAE's returns and advantages: [rows, new tokens] each
        batch["advantages"] = batch["returns"] - batch["values"]
        return batch

    def loss_fn(model: PPOModels, batch: dict) -> torch.Tensor:
        rows = len(batch["sequences"]) // per_rollout  # the first micro-batch; the others are alike
        sequences = batch["sequences"][:rows]
        responses = sequences[:, prompt:]
        with _unpacked_sequences(transformers):
            critic = getattr(model.value_model, model.value_model.base_model_prefix)
            hidden = critic(input_ids=sequences, return_dict=True, output_hidden_states=True).hidden_states[-1]
            value_logits = model.value_model.score(hidden)
            output = model.policy(input_ids=sequences, return_dict=True, output_hidden_states=True)
        logits = output.logits[:, prompt - 1:-1]
        logits /= 1.0  # the temperature, in place
        new_logprobs = selective_log_softmax(logits, responses)
        vpred = value_logits[:, prompt - 1:-1].squeeze(-1)
        values, returns = batch["values"][:rows], batch["returns"][:rows]
        clipped = torch.clamp(vpred, values - 0.2, values + 0.2)
        vf_loss = 0.5 * torch.max(torch.square(vpred - returns), torch.square(clipped - returns)).mean()
        ratio = torch.exp(new_logprobs - batch["logprobs"][:rows])
        advantages = batch["advantages"][:rows]
        pg_loss = torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 0.8, 1.2)).mean()
        return pg_loss + 0.1 * vf_loss

    return Workload(
        name=f"ppo {base.name}", build_model=lambda: PPOModels(base.build_model, build_scorer), make_batch=make_batch,
        loss_fn=loss_fn, generate=generate, reference=reference, tokens_per_sample=prompt + new_tokens,
        description=f"{base.description.split(', seq ')[0]}; PPO: policy and value model trained, reference and "
                    f"reward models frozen, {prompt}-token queries, {new_tokens} new tokens with every step's logits "
                    f"kept, {per_rollout} micro-batches per rollout"
                    + (f", generated {rollout.chunk_rows} rows at a time" if rollout.chunk_rows else ""))
