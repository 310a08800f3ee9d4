"""--attention: the attention implementation of a transformers model, set before the step runs.

transformers picks a model's attention by ``config._attn_implementation`` (``eager``, ``sdpa``,
``flash_attention_2``, ...) and each model class says which it supports (``_supports_sdpa``,
``_supports_flash_attn``): Gemma 2 has no SDPA path, and refuses it. The step sets the one
asked for with transformers' own ``set_attn_implementation``, which checks that support, so a
family that cannot run it is refused in one line naming the ones it can.

``flash`` (the flash_attn package's FlashAttention-2) runs on a CUDA GPU only, and is not
traced: on fake tensors no flash_attn kernel runs, and transformers' flash path calls it. A
traced step refuses it and names what to trace instead (``flash_refused``).
"""

from __future__ import annotations

import torch
from torch import nn

from batchfit.errors import OptionError
from batchfit.workload import HF_ATTENTION


def _hf_models(model: nn.Module) -> list[nn.Module]:
    """The outermost transformers PreTrainedModels in ``model`` (the model itself, a wrapper's, or a
    pipeline rank's stages): ``set_attn_implementation`` reaches the models nested in each."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return []
    found: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and not any(module in set(f.modules()) for f in found):
            found.append(module)
    return found


def attention_of(model: nn.Module) -> str | None:
    """The implementation a transformers model runs, in --attention's words (None: not one)."""
    models = _hf_models(model)
    if not models:
        return None
    used = models[0].config._attn_implementation
    return next((ours for ours, theirs in HF_ATTENTION.items() if theirs == used), used)


def flash_refused(model_name: str, supports_sdpa: bool) -> OptionError:
    """Why a traced step does not run --attention flash, and what to trace instead."""
    instead = ("--attention sdpa with --precision bf16-mixed: without a mask SDPA runs the same "
               "FlashAttention-2 kernel on the GPU, and the trace keeps what it saves (q, k, v, the output, an "
               "fp32 log-sum-exp per row)" if supports_sdpa else
               f"--attention eager ({model_name} has no SDPA path in transformers): an upper bound, it holds the "
               "[B, H, T, T] scores that flash never does")
    return OptionError(f"--attention flash is not traced (flash_attn's kernels run on a CUDA GPU only; measure it "
                       f"with `batchfit probe --device cuda`); to trace, use {instead}")


def set_attention(model: nn.Module, attention: str | None, device: torch.device, *, fake: bool) -> None:
    """Make every transformers model in ``model`` run ``attention`` (None: leave it as built).
    ``fake``: the step is traced, so flash (which needs flash_attn on a CUDA GPU) is refused."""
    if attention is None:
        return
    models = _hf_models(model)
    if not models:
        raise OptionError(f"--attention {attention} sets a transformers model's attn_implementation; "
                          f"{type(model).__name__} is not one (its attention is its own code): drop --attention")
    for hf in models:
        if attention == "flash" and (fake or device.type != "cuda"):
            raise flash_refused(type(hf).__name__, bool(getattr(hf, "_supports_sdpa", False)))
        try:
            hf.set_attn_implementation(HF_ATTENTION[attention])
        except (ValueError, ImportError) as error:
            supported = [name for name, flag in (("eager", True), ("sdpa", getattr(hf, "_supports_sdpa", False)),
                                                 ("flash", getattr(hf, "_supports_flash_attn", False))) if flag]
            why = (str(error).strip().splitlines() or [""])[0].split(". ")[0]
            if isinstance(error, ImportError):
                raise OptionError(f"--attention {attention}: {why}: pip install flash-attn, or use --attention "
                                  "sdpa") from None
            raise OptionError(f"--attention {attention}: {why}: use --attention "
                              f"{' or '.join(supported)} for {type(hf).__name__}") from None
