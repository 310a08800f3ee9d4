"""float8 training with torchao (``--precision fp8-tensorwise | fp8-rowwise``), as torchtitan applies it.

The model's ``nn.Linear`` layers become torchao's ``Float8Linear`` through torchao's own
``convert_to_float8_training``, with the config of ``Float8LinearConfig.from_recipe_name``
(``tensorwise``: one scale per tensor, e4m3 forward, e5m2 gradients; ``rowwise``: one scale per
row, e4m3 everywhere, scales rounded down to powers of 2). Which linears: torchtitan's
``module_filter_fn`` (``torchtitan/components/quantization/utils.py``): both dimensions divisible
by 16 (``torch._scaled_mm``'s requirement) and not a filtered name; its Llama-3 configs filter the
output head (``filter_fqns=["lm_head"]`` / ``["output"]``), and so does batchfit: the model's output
head (HF's ``get_output_embeddings()``, else a top-level ``lm_head``, ``output`` or ``head``).

The rest of the step runs bf16-mixed (autocast): what torchtitan does on one GPU
(``maybe_enable_amp``: ``torch.autocast("cuda", bfloat16)`` when FSDP does not shard; under FSDP2 its
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` instead, which batchfit's FSDP
strategies apply the same way for every mixed precision).

Under FSDP2 the tensorwise recipe gathers weights in float8 (torchtitan's
``enable_fsdp_float8_all_gather=True`` with ``precompute_float8_dynamic_scale_for_fsdp``): each
converted weight is wrapped in torchao's ``WeightWithDynamicFloat8CastTensor`` before sharding
(:func:`enable_float8_all_gather`, called by ``distributed/strategy.py``), so FSDP2 all-gathers one
byte per element instead of bf16's two. Rowwise gathers in bf16 (torchao allows float8 all-gather
for tensorwise only).

Nothing here is a multiplier: the step runs torchao's real modules and tensor subclasses (on fake
tensors when traced), so what they allocate, cast and save for backward is what the trace counts.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

from torch import nn

from batchfit.errors import OptionError

HEAD_NAMES: tuple[str, ...] = ("lm_head", "output", "head")
"""Top-level names of an output head that stays in high precision (torchtitan's filter_fqns)."""


def _torchao():
    """What batchfit uses of ``torchao.float8``, imported with torchao's import-time warnings (its CUDA
    extensions do not load on a CPU build) and PyTorch's pytree note about it kept off the terminal."""
    import logging

    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        from torchao.float8 import (
            Float8LinearConfig,
            convert_to_float8_training,
            precompute_float8_dynamic_scale_for_fsdp,
        )
        from torchao.float8.config import ScalingGranularity, ScalingType
        from torchao.float8.float8_linear import Float8Linear
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    except ImportError as error:
        raise OptionError(f"float8 training needs torchao, which cannot be imported here ({error}): "
                          "pip install 'batchfit[fp8]'") from error
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
    return SimpleNamespace(
        Float8LinearConfig=Float8LinearConfig, convert_to_float8_training=convert_to_float8_training,
        precompute_float8_dynamic_scale_for_fsdp=precompute_float8_dynamic_scale_for_fsdp,
        ScalingGranularity=ScalingGranularity, ScalingType=ScalingType, Float8Linear=Float8Linear,
        WeightWithDynamicFloat8CastTensor=WeightWithDynamicFloat8CastTensor)


def _head(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        head = next((getattr(model, n) for n in HEAD_NAMES if isinstance(getattr(model, n, None), nn.Linear)), None)
    return head


def float8_filter(model: nn.Module):
    """torchtitan's ``module_filter_fn``: dims divisible by 16, not the output head."""
    head = _head(model)

    def keep(module: nn.Module, fqn: str) -> bool:
        return (module is not head and module.in_features % 16 == 0 and module.out_features % 16 == 0)

    return keep


def convert_to_float8(model: nn.Module, recipe: str) -> list[str]:
    """Swap the model's eligible ``nn.Linear`` layers for torchao's ``Float8Linear`` (in place,
    with torchao's ``convert_to_float8_training`` and ``recipe``: tensorwise or rowwise); returns the
    names of its float8 linears. Layers already converted (a model prepared on the meta device and
    filled later, as ``plan`` does) stay."""
    float8 = _torchao()
    Float8Linear = float8.Float8Linear  # noqa: N806 - torchao's class

    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    keep = float8_filter(model)
    float8.convert_to_float8_training(
        model, config=config,
        module_filter_fn=lambda m, fqn: type(m) is nn.Linear and not isinstance(m, Float8Linear) and keep(m, fqn))
    return [name for name, _ in float8_linears(model)]


def float8_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's torchao ``Float8Linear`` layers, by name (none where torchao was never imported:
    then no model holds one, and a run without float8 does not pay for importing it)."""
    module = sys.modules.get("torchao.float8.float8_linear")
    if module is None:
        return []
    Float8Linear = module.Float8Linear  # noqa: N806 - torchao's class
    return [(n, m) for n, m in model.named_modules() if isinstance(m, Float8Linear)]


def enable_float8_all_gather(model: nn.Module) -> int:
    """What ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)`` makes ``Float8Linear.from_float``
    do, applied to a model converted without it (torchao's own lines, ``float8_linear.py``): each
    tensorwise float8 linear's weight becomes a ``WeightWithDynamicFloat8CastTensor``, whose
    ``fsdp_pre_all_gather`` casts the shard to float8 before FSDP2 gathers it. Call before
    ``fully_shard``. Returns how many weights were wrapped (rowwise layers: none)."""
    import dataclasses

    float8 = _torchao()
    ScalingGranularity, ScalingType = float8.ScalingGranularity, float8.ScalingType  # noqa: N806
    WeightWithDynamicFloat8CastTensor = float8.WeightWithDynamicFloat8CastTensor  # noqa: N806
    wrapped = 0
    for _, module in float8_linears(model):
        cast = module.config.cast_config_weight
        if (cast.scaling_granularity is not ScalingGranularity.TENSORWISE
                or cast.scaling_type is not ScalingType.DYNAMIC
                or isinstance(module.weight, WeightWithDynamicFloat8CastTensor)):
            continue
        module.config = dataclasses.replace(module.config, enable_fsdp_float8_all_gather=True)
        module.weight = nn.Parameter(
            WeightWithDynamicFloat8CastTensor(module.weight, module.linear_mm_config, cast.target_dtype),
            requires_grad=module.weight.requires_grad)
        wrapped += 1
    return wrapped


def precompute_scales_after_step(model: nn.Module, optimizer) -> bool:
    """torchtitan's ``post_optimizer_hook`` with ``precompute_float8_dynamic_scale_for_fsdp=True``: after
    each optimizer step, torchao's ``precompute_float8_dynamic_scale_for_fsdp`` works out every float8
    weight's scale in one all-reduce (instead of one per weight in the next forward). Registered only
    where FSDP2 gathers float8 weights (a sharded ``WeightWithDynamicFloat8CastTensor``); returns whether."""
    if not float8_linears(model):
        return False
    float8 = _torchao()
    if not any(isinstance(getattr(m.weight, "_local_tensor", None), float8.WeightWithDynamicFloat8CastTensor)
               for _, m in float8_linears(model)):
        return False
    optimizer.register_step_post_hook(lambda *_: float8.precompute_float8_dynamic_scale_for_fsdp(model))
    return True
