"""What an RL step traced from a TRL config (``--trainer``, ``options.Rollout``) does not run as TRL
does: one Approximation each, said on every output (``docs/run.md``, RL steps)."""

from __future__ import annotations

from batchfit.options import Rollout
from batchfit.trace.approximation import Approximation

SOURCE = "docs/run.md, RL steps: generation, reference log-probs, the update"


def rollout_approximations(rollout: Rollout, accumulation_steps: int) -> list[Approximation]:
    out = []
    if accumulation_steps > 1:
        out.append(Approximation(
            what=f"gradient_accumulation_steps {accumulation_steps}: each micro-batch traced with its own generation",
            may_differ_by="high by the gradients' bytes in the generation and scoring phases of the micro-batches "
                          "after the first (TRL generates once per rollout, before any gradient exists)",
            source=SOURCE))
    if rollout.algorithm == "grpo":
        out.append(Approximation(
            what="GRPO: the log-probs through TRL's fused LM head (TRL 1.15 and later; checked against trl 1.16.0)",
            may_differ_by="low under TRL 1.14 and earlier, which held the completion's logits: by about rows x "
                          "completion x vocabulary x 4 B in the reference and update phases; under 1.15 and later "
                          "the generation phase within 600 B of a real CPU step of a 2-layer Llama (-0.09% to "
                          "+0.04%, fp32 and bf16, with and without five logits processors: TRL's per-row prompt "
                          "tensors, on the host on a GPU)",
            source=SOURCE))
    if rollout.algorithm == "ppo":
        out.append(Approximation(
            what="PPO: one update micro-batch traced",
            may_differ_by=("low by the previous micro-batch's outputs where a rollout has more than one (TRL keeps "
                           "its policy output, whole-sequence logits and hidden states, and the entropy's softmax "
                           "until the next forward returns)" if rollout.steps_per_generation > 1 else "nothing: the "
                          "rollout is one micro-batch"),
            source=SOURCE))
        out.append(Approximation(
            what="PPO: the value and reward models traced as the policy's architecture with a one-score head",
            may_differ_by="the difference in size of the models at sft_model_path and reward_model_path",
            source=SOURCE))
    return out
