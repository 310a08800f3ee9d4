"""A transformers causal LM under the GRPO step (``zoo/grpo.py``): what ``--trainer`` with a TRL
GRPOConfig traces for an ``hf:`` model.

The policy is the model built from its config (``zoo/hf.py``), the reference a frozen second
copy. Generation is greedy decoding with the model's own KV cache (``DynamicCache``, as
``model.generate`` keeps it), the logits of the last position only at each call (generate's
``logits_to_keep=1``); the log-probs are computed from the completion's logits only, as TRL's
``_get_per_token_logps_and_entropies`` asks for them (``logits_to_keep`` = completion + 1).
"""

from __future__ import annotations

import torch
from torch import nn

from batchfit.errors import ModelSpecError
from batchfit.options import Rollout
from batchfit.workload import Workload
from batchfit.zoo.grpo import Policy, grpo_step
from batchfit.zoo.hf import _transformers, _unpacked_sequences, hf_workload


def hf_grpo_workload(target: str, rollout: Rollout) -> Workload:
    """``hf:<target>`` (a causal LM) as the policy of a GRPO step under ``rollout``."""
    base = hf_workload(target, rollout.prompt_len + rollout.new_tokens)
    if base.lm_parts is None and "causal LM" not in base.description:
        raise ModelSpecError(f"{base.name} is not a causal LM ({base.description}): GRPO generates with one")
    transformers = _transformers()
    with torch.device("meta"):
        vocab_size = base.build_model().config.vocab_size

    def logits(model: nn.Module, sequences: torch.Tensor, completion: int) -> torch.Tensor:
        with _unpacked_sequences(transformers):
            return model(input_ids=sequences, logits_to_keep=completion + 1, use_cache=False).logits[:, :-1]

    def decode(model: nn.Module, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
        tokens, cache, step = [prompts], None, prompts
        with _unpacked_sequences(transformers):
            for t in range(new_tokens):
                out = model(input_ids=step, cache=cache, use_cache=True, logits_to_keep=1)
                cache, step = out.cache, out.logits[:, -1].argmax(dim=-1, keepdim=True)
                del out
                tokens.append(step)
        return torch.cat(tokens, dim=1)

    return grpo_step(Policy(build=base.build_model, logits=logits, decode=decode), rollout, vocab_size,
                     name=f"grpo {base.name}", description=base.description.split(", seq ")[0])
