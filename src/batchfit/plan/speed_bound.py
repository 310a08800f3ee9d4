"""``plan --strategies auto``: the most tokens/s a candidate could reach, known before it is traced.

The plan's time model (``plan/time_model.py``) writes a pipeline step of ``m`` micro-batches as

    step >= compute + bubble = compute / (1 - f),    compute = FLOPs of the busiest rank / (peak x MFU)

(communication and offload copies only add to it; ``f`` the schedule's idle share,
``pp_schedules.bubble_fraction``, 0 without pp), and tokens/s = dp x micro-batch x sequence / micro-step.
The FLOPs have a floor read from the model built on the meta device: every ``nn.Linear`` of a
trained dense transformer runs once per token forward (2 FLOPs per weight), once for its weight's
gradient and once for its input's (2 each), and under ``checkpointing`` full each block's linears run
their forward again in the backward (2 more). torch's flop counter counts exactly those matmuls
(attention, norms and the loss only add to them). TP splits each linear over its ranks, cp the tokens,
dp the samples, and the busiest of pp ranks runs at least their mean, so every rank of
``world = pp x dp x cp x tp`` GPUs has its share, and

    tokens/s <= GPUs x peak x MFU x (1 - f) / (linear FLOPs per token)

whatever the micro-batch and whatever fits. A candidate whose bound is at most the best traced
candidate's tokens/s cannot be ranked first: auto shows it as not traced, with this figure. The floor
is taken only where each FLOP of it is certain (every parameter trained: no frozen, LoRA or quantized
base; no mixture of experts, whose experts see a share of the tokens; no float8 linears, which the
counter does not count as matmuls; a model with transformer blocks and tokens), and each traced
row's FLOPs are checked against it (:func:`below_floor`): a model that breaks it is traced whole.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchfit.plan.world import World


@dataclass(frozen=True)
class LinearFlops:
    """A model's linear layers, as the floor counts them."""

    linear_params: int
    """Weights of every ``nn.Linear`` (each module once)."""
    recomputed_params: int
    """Of those, the weights inside the checkpointed blocks (``checkpointing`` full; 0 otherwise)."""
    tokens_per_sample: int

    @property
    def flops_per_token(self) -> int:
        """6 per linear weight (forward, weight gradient, input gradient), 2 more per recomputed one."""
        return 6 * self.linear_params + 2 * self.recomputed_params

    def rank_flops(self, strategy, local_batch: int) -> float:
        """The least FLOPs the busiest rank of ``strategy`` runs at ``local_batch`` samples."""
        share = strategy.tp * getattr(strategy, "cp", 1) * getattr(strategy, "pp", 1)
        return self.flops_per_token * self.tokens_per_sample * local_batch / share

    def formula(self) -> str:
        recomputed = (f" + 2 x {_count(self.recomputed_params)} recomputed (checkpointing full)"
                      if self.recomputed_params else "")
        per_token = self.flops_per_token
        flops = f"{per_token / 1e9:,.1f} GFLOP" if per_token >= 1e9 else f"{per_token:,} FLOP"
        return f"{flops} per token = 6 x {_count(self.linear_params)} linear weights{recomputed}"


def _count(n: int) -> str:
    """A weight count as people write it: 68.45B, or whole below ten million."""
    return f"{n / 1e9:,.2f}B" if n >= 10**7 else f"{n:,}"


def linear_flops(workload, options, experts: int | None = None) -> LinearFlops | None:
    """``workload``'s linear FLOPs floor, or None where it would not be certain (the module docstring)."""
    from batchfit.options import FP8_PRECISIONS

    tokens = workload.tokens_per_sample
    if (not tokens or experts or options.frozen or options.trainable or options.lora != "none"
            or options.quantize != "none" or options.precision in FP8_PRECISIONS):
        return None
    import torch
    from torch import nn

    from batchfit.distributed.pipeline import _zoo_blocks
    from batchfit.distributed.pipeline_hf import hf_layers

    try:
        with torch.device("meta"):
            model = workload.build_model()
    except Exception:  # noqa: BLE001 - a model that needs real memory to build: the tracer decides
        return None
    blocks = _zoo_blocks(model)
    blocks = blocks if blocks is not None else hf_layers(model)
    if blocks is None or not all(p.requires_grad for p in model.parameters()):
        return None

    def linear(module: nn.Module) -> int:
        return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))

    recomputed = linear(blocks) if options.checkpointing_spec.kind == "full" else 0
    return LinearFlops(linear_params=linear(model), recomputed_params=recomputed, tokens_per_sample=tokens)


def tokens_per_s_bound(flops: LinearFlops, strategy, world: World, peak_tflops: float, mfu: float) -> float:
    """The most tokens/s ``strategy`` on ``world`` could reach (the module docstring's formula)."""
    return world.gpus * peak_tflops * 1e12 * mfu * (1 - bubble(strategy)) / flops.flops_per_token


def bubble(strategy) -> float:
    """The pipeline's idle share the time model adds for ``strategy`` (0 without pp)."""
    if getattr(strategy, "pp", 1) <= 1:
        return 0.0
    from batchfit.distributed.pp_schedules import bubble_fraction, parse_schedule

    return bubble_fraction(parse_schedule(strategy.pp_schedule, strategy.microbatches), strategy.pp)


def why_bounded(flops: LinearFlops, strategy, world: World, peak_tflops: float, mfu: float, best: float,
                best_name: str) -> str:
    """The row's ``skipped``: 'not traced: at most ...', its bound, the formula, and the traced row it cannot beat."""
    bound = tokens_per_s_bound(flops, strategy, world, peak_tflops, mfu)
    idle = bubble(strategy)
    bubble_part = f" x (1 - bubble {idle:.3f})" if idle else ""
    return (f"not traced: at most {bound:,.0f} tokens/s (compute bound: {world.gpus} GPUs x {peak_tflops:,.0f} "
            f"TFLOP/s x MFU {mfu:.2f}{bubble_part} / {flops.formula()}), below {best_name}'s traced "
            f"{best:,.0f}")


def below_floor(flops: LinearFlops, strategy, local_batch: int, traced_flops: int) -> bool:
    """Whether a traced rank counted fewer FLOPs than the floor: then the floor is wrong for this model."""
    return traced_flops < flops.rank_flops(strategy, local_batch)
