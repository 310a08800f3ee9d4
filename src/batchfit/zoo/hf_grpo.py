"""A transformers causal LM under the GRPO step (``zoo/grpo.py``): what ``--trainer`` with a TRL
GRPOConfig traces for an ``hf:`` model.

The policy is the model built from its config (``zoo/hf.py``), the reference a frozen second
copy. Generation samples as ``model.generate`` does (``zoo/hf_sampling.py``: its logits processors for the
GRPOConfig's sampling settings, what it keeps between tokens) with the model's own KV cache (``DynamicCache``),
the logits of the last position only at each call (generate's ``logits_to_keep=1``); the log-probs come from the
base model's hidden states through TRL's fused LM head (``zoo/fused_logprobs.py``), as TRL's
``_get_per_token_logps_and_entropies`` computes them since TRL 1.15.
"""

from __future__ import annotations

import torch
from torch import nn

from batchfit.errors import ModelSpecError
from batchfit.options import Rollout
from batchfit.workload import Workload
from batchfit.zoo.grpo import Policy, grpo_step
from batchfit.zoo.hf import _transformers, _unpacked_sequences, hf_workload
from batchfit.zoo.hf_sampling import sample


def hf_grpo_workload(target: str, rollout: Rollout) -> Workload:
    """``hf:<target>`` (a causal LM) as the policy of a GRPO step under ``rollout``."""
    base = hf_workload(target, rollout.prompt_len + rollout.new_tokens)
    if base.lm_parts is None and "causal LM" not in base.description:
        raise ModelSpecError(f"{base.name} is not a causal LM ({base.description}): GRPO generates with one")
    transformers = _transformers()
    with torch.device("meta"):
        config = base.build_model().config
    vocab_size, eos_token_id = config.vocab_size, _first_id(getattr(config, "eos_token_id", None))

    def hidden(model: nn.Module, sequences: torch.Tensor) -> torch.Tensor:
        # TRL's fused head runs the base model alone; TRL passes the batch's attention mask, all ones here (no
        # padding), which transformers reads as no mask at all: passing none keeps fake tensors from building one
        with _unpacked_sequences(transformers):
            return model.base_model(input_ids=sequences, use_cache=False).last_hidden_state

    def forward(model: nn.Module, step: torch.Tensor, positions: torch.Tensor | None, cache: object) -> object:
        extra = {} if positions is None else {"position_ids": positions}
        return model(input_ids=step, cache=cache, use_cache=True, logits_to_keep=1, **extra)

    def decode(model: nn.Module, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
        with _unpacked_sequences(transformers):
            return sample(transformers, model, prompts, new_tokens, forward, sampling=rollout.sampling,
                          eos_token_id=eos_token_id)

    policy = Policy(build=base.build_model, hidden=hidden, head=lambda model: model.get_output_embeddings().weight,
                    decode=decode)
    return grpo_step(policy, rollout, vocab_size,
                     name=f"grpo {base.name}", description=base.description.split(", seq ")[0])


def _first_id(token_id: int | list[int] | None) -> int:
    """The config's EOS id (TRL takes the tokenizer's, which the trace has not: only its tensor's size counts)."""
    if isinstance(token_id, (list, tuple)):
        token_id = token_id[0] if token_id else None
    return 0 if token_id is None else int(token_id)
