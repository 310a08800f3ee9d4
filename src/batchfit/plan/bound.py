"""``plan --strategies auto``: candidates that cannot fit, known before they are traced.

Every rank holds, at its optimizer step, its share of the parameters, their gradients and the
optimizer state, whatever else the step keeps. That share has a floor computed from the parameter
count alone (the model built on the meta device): DDP keeps everything on each rank, ZeRO-1/2
keep the parameters whole on each rank (they shard the optimizer state, ZeRO-2 the gradients too), HSDP
(``hsdp<R>``) shards them within groups of world / R GPUs and keeps R copies, ``fsdp-noreshard`` holds
every block's parameters gathered at the end of the forward (2 bytes each at least; its shards of the
parameters and optimizer state then, the gradients not yet), and any other
strategy spreads them over at most every GPU, so the rank that holds the most holds at least the
whole divided by its shard group (the world, for those). When that floor plus the cuBLAS workspace
passes the GPU's usable memory, not even local batch 1 fits (reserved memory is never below
allocated): the candidate is a skipped row saying so, with the figure, instead of a tracing session
(a 70B model's DDP, ZeRO-1, ZeRO-2, hsdp8 and fsdp-noreshard on 64 80 GB GPUs). The floor is a lower
bound only where every byte of it is certain: all parameters trainable, AdamW's or Adam's two states per
parameter (the default optimizer), nothing offloaded, quantized or frozen; otherwise nothing is set
aside.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from batchfit.devices import Device, GiB

ADAM_STATES = 2
"""AdamW / Adam keep exp_avg and exp_avg_sq, each the parameter's dtype and shape."""


@dataclass(frozen=True)
class ModelBytes:
    """A model's parameter bytes as the step keeps them, and what its optimizer state adds per byte."""

    param_bytes: int
    """All parameters, in the dtype the step holds them in (its gradients take as many)."""
    state_per_param_byte: int
    """Optimizer state bytes per parameter byte (2 for AdamW / Adam)."""


def model_bytes(workload, options) -> ModelBytes | None:
    """``workload``'s parameter bytes from its model built on the meta device, or None where the floor
    would not be certain (another optimizer, frozen / LoRA / quantized parameters, offloaded ones, a
    model that cannot be built there)."""
    from batchfit.workload import default_optimizer

    own_optimizer = options.optimizer is None and workload.build_optimizer is not default_optimizer
    if (own_optimizer or options.optimizer not in (None, "adamw", "adam") or options.frozen or options.trainable
            or options.lora != "none" or options.quantize != "none" or options.offload_spec.params):
        return None
    import torch

    try:
        with torch.device("meta"):
            model = workload.build_model()
    except Exception:  # noqa: BLE001 - a model that needs real memory to build: the tracer decides
        return None
    params = list(model.parameters())
    if not params or not all(p.is_floating_point() for p in params):
        return None
    # --precision bf16 casts the model to bf16 (train/step.py); every other precision keeps the built dtype
    total = sum(p.numel() * (2 if options.precision == "bf16" else p.element_size()) for p in params)
    return ModelBytes(param_bytes=total, state_per_param_byte=ADAM_STATES)


def floor_bytes(strategy, model: ModelBytes) -> int:
    """The least the fullest rank of ``strategy`` holds at its optimizer step: parameters,
    gradients and optimizer state (see the module's docstring for each rule)."""
    p, state = model.param_bytes, model.param_bytes * model.state_per_param_byte
    whole = 2 * p + state  # parameters, gradients, optimizer state
    spread = whole // strategy.world_size
    if getattr(strategy, "pp", 1) > 1 or strategy.tp > 1 or getattr(strategy, "ep", 1) > 1:
        return spread
    if strategy.shard == "ddp":
        return whole
    if strategy.shard in ("zero1", "zero2"):
        # the parameters stay whole on every rank; the state is split by whole parameters, largest first
        # (ZeroRedundancyOptimizer), so rank 0's share may be less than 1/dp: none of it is counted
        return p
    if strategy.shard == "hsdp":  # each of the R replicas holds the whole, sharded over world / R ranks
        return whole * strategy.replicas // strategy.world_size
    if strategy.shard == "fsdp-noreshard":  # at the end of the forward: every block gathered, no gradient yet
        return max(spread, (p + state) // strategy.world_size + gathered_bytes(model))
    return spread


def gathered_bytes(model: ModelBytes) -> int:
    """The least a rank holds of all parameters all-gathered: 2 bytes each (bf16 or fp16 compute, from fp32
    or 2-byte weights: at least half of ``param_bytes``)."""
    return model.param_bytes // 2


def too_large(workload, options, device: Device) -> Callable[[object], str | None]:
    """Why a strategy cannot fit local batch 1 on ``device`` by its floor (or None: trace it)."""
    model = model_bytes(workload, options)

    def why(strategy) -> str | None:
        if model is None:
            return None
        floor = floor_bytes(strategy, model) + device.workspace_bytes
        if floor <= device.usable_bytes:
            return None
        what = ("its parameters and AdamW state with every block's parameters gathered at the end of the forward "
                "(2 bytes each at least)" if strategy.shard == "fsdp-noreshard" and floor_bytes(strategy, model) >
                floor_bytes(dataclasses.replace(strategy, shard="fsdp"), model)
                else "its parameters, gradients and AdamW state alone")
        return (f"{what} take at least {floor / GiB:,.1f} GiB per GPU (computed from the parameter "
                f"count, with the cuBLAS workspace), over the {device.usable_bytes / GiB:.1f} GiB usable, so not "
                "even local batch 1 fits; fsdp shards all three")
    return why
