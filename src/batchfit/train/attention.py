"""--attention: the attention implementation of a transformers model, set before the step runs.

transformers picks a model's attention by ``config._attn_implementation`` (``eager``, ``sdpa``,
``flash_attention_2``, ...) and each model class says which it supports (``_supports_sdpa``,
``_supports_flash_attn``): Gemma 2 has no SDPA path, and refuses it. The step sets the one
asked for with transformers' own ``set_attn_implementation``, which checks that support, so a
family that cannot run it is refused in one line naming the ones it can.

``flash`` is the flash_attn package's FlashAttention-2 (``flash_attention_2``): a real step on
a CUDA GPU runs it (the package installed); a CPU step cannot (refused in one line). On fake
tensors (and the meta device, where ``plan`` prepares a model) no flash_attn kernel runs, so the
model calls :func:`flash_attention_saved` instead, registered in transformers' AttentionInterface:
transformers' ``flash_attention_forward`` with the kernel replaced by PyTorch's copy of the same
FlashAttention-2 kernel (``aten._scaled_dot_product_flash_attention``), whose fake kernel
allocates what FlashAttention-2 does: the output laid out as q is, an fp32 log-sum-exp per
query row and the RNG state, with q, k, v saved as given (no copies: their last dimension is
contiguous) and K/V with their own heads (grouped-query attention unexpanded). A softcap
(Gemma 2) or a sliding window changes what the kernel computes, not what it holds.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from batchfit.errors import OptionError
from batchfit.workload import HF_ATTENTION

FLASH_SAVED = "batchfit-fa2-saved"
"""The AttentionInterface name of :func:`flash_attention_saved` (no 'flash' in it: transformers
would then look for the flash_attn package)."""


def _hf_models(model: nn.Module) -> list[nn.Module]:
    """The outermost transformers PreTrainedModels in ``model`` (the model itself, a wrapper's, or a
    pipeline rank's stages): ``set_attn_implementation`` reaches the models nested in each."""
    if "transformers" not in sys.modules:  # no transformers model can exist without it
        return []
    try:
        from transformers import PreTrainedModel
    except ImportError:  # a broken install: say what to do
        raise OptionError("`attention` sets a transformers model's attention: pip install 'batchfit[hf]'") from None
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
    if used == FLASH_SAVED:
        return "flash"
    return next((ours for ours, theirs in HF_ATTENTION.items() if theirs == used), used)


def flash_attention_saved(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          sliding_window: int | None = None, softcap: float | None = None,
                          is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' ``flash_attention_forward`` (integrations/flash_attention.py) on fake tensors:
    its casts and paddings, then PyTorch's FlashAttention-2 kernel for flash_attn's (the same
    saved tensors; see the module). ``query`` is [B, H, T, D], as transformers passes it."""
    try:
        from transformers.integrations.flash_attention import get_target_dtype
    except ImportError:
        raise OptionError("`attention` sets a transformers model's attention: pip install 'batchfit[hf]'") from None

    if not (is_fake(query) or query.device.type == "meta"):
        raise RuntimeError("batchfit's FlashAttention-2 stand-in runs on fake tensors only; a GPU step runs "
                           "flash_attention_2 itself")
    if attention_mask is not None:
        raise OptionError("`attention` flash is traced for batches without padding (no attention_mask): "
                          "flash_attn's variable-length path is not traced; use `attention` sdpa")
    head_dim, v_head_dim = query.shape[-1], value.shape[-1]
    if v_head_dim != head_dim:  # MLA: flash_attention_forward pads V to Q's head size, crops the output
        value = nn.functional.pad(value, [0, head_dim - v_head_dim])
    target = get_target_dtype(query, module)  # fp32 inputs cast as transformers casts them
    if target is not None:
        query, key, value = query.to(target), key.to(target), value.to(target)
    if query.dtype not in (torch.float16, torch.bfloat16):
        raise OptionError("`attention` flash runs in fp16 / bf16 only (flash_attn refuses fp32 inputs): use "
                          "`precision` bf16-mixed (or bf16, fp16-mixed)")
    padded = head_dim % 8
    if padded:  # flash_attn pads the head size to a multiple of 8 itself (FlashAttnFunc.forward)
        query, key, value = (nn.functional.pad(t, [0, 8 - padded]) for t in (query, key, value))
    causal = module.is_causal if is_causal is None else is_causal
    scale = scaling if scaling is not None else head_dim ** -0.5
    out = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout, causal, False, scale=scale)[0]
    return out[..., :v_head_dim].transpose(1, 2), None  # [B, T, H, D], as flash_attn returns it


def _register_flash_saved() -> None:
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError:
        raise OptionError("`attention` sets a transformers model's attention: pip install 'batchfit[hf]'") from None

    AttentionInterface.register(FLASH_SAVED, flash_attention_saved)
    AttentionMaskInterface.register(FLASH_SAVED, flash_attention_mask)  # no mask without padding, as flash's


def _flash_for(device: torch.device, fake: bool, hf: nn.Module, precision: str) -> str:
    """The transformers implementation that --attention flash becomes here."""
    if fake or device.type == "meta":
        if precision == "fp32":
            raise OptionError("`attention` flash runs in fp16 / bf16 only (flash_attn refuses fp32 inputs): use "
                              "`precision` bf16-mixed (or bf16, fp16-mixed), or `attention` sdpa")
        if not getattr(hf, "_supports_flash_attn", False):
            raise OptionError(f"`attention` flash: {type(hf).__name__} does not support flash attention in "
                              "transformers: use `attention` sdpa or eager")
        _register_flash_saved()
        return FLASH_SAVED
    if device.type != "cuda":
        raise OptionError(f"`attention` flash runs flash_attn's CUDA kernels; a {device.type} step cannot: trace it "
                          "(batchfit estimate) or use `attention` sdpa")
    return HF_ATTENTION["flash"]


def set_attention(model: nn.Module, attention: str | None, device: torch.device, *, fake: bool,
                  precision: str = "fp32") -> None:
    """Make every transformers model in ``model`` run ``attention`` (None: leave it as built).
    ``fake``: the step is traced, where flash runs as :func:`flash_attention_saved`."""
    if attention is None:
        return
    models = _hf_models(model)
    if not models:
        raise OptionError(f"`attention` {attention} sets a transformers model's attn_implementation; "
                          f"{type(model).__name__} is not one (its attention is its own code): drop `attention`")
    for hf in models:
        wanted = _flash_for(device, fake, hf, precision) if attention == "flash" else HF_ATTENTION[attention]
        try:
            hf.set_attn_implementation(wanted)
        except (ValueError, ImportError) as error:
            supported = [name for name, flag in (("eager", True), ("sdpa", getattr(hf, "_supports_sdpa", False)),
                                                 ("flash", getattr(hf, "_supports_flash_attn", False))) if flag]
            why = (str(error).strip().splitlines() or [""])[0].split(". ")[0]
            if isinstance(error, ImportError):
                raise OptionError(f"`attention` {attention}: {why}: pip install flash-attn, or use `attention` "
                                  "sdpa") from None
            raise OptionError(f"`attention` {attention}: {why}: use `attention` "
                              f"{' or '.join(supported)} for {type(hf).__name__}") from None
