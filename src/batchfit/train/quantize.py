"""QLoRA as a user builds it: the frozen base's linear layers in bitsandbytes 4-bit or 8-bit
(bitsandbytes' own ``Linear4bit`` / ``Linear8bitLt``), PEFT's LoRA adapters on top, and the
8-bit, paged and low-bit optimizers (bitsandbytes, torchao) by name.

What transformers does for ``from_pretrained(..., quantization_config=BitsAndBytesConfig(...))``
(``transformers/integrations/bitsandbytes.py: replace_with_bnb_linear``): every ``nn.Linear``
but the output head (``get_keys_to_not_convert``) becomes a ``Linear4bit`` whose ``Params4bit``
weight is quantized when it reaches its device (``Params4bit._quantize``). PEFT's
``prepare_model_for_kbit_training`` then freezes the base and casts the other fp16/bf16
parameters to fp32: batchfit's mixed precisions keep fp32 weights already (``bf16`` keeps them
in bf16). Gradient checkpointing is ``--checkpointing`` here, not the function's default.

bitsandbytes, peft and torchao are imported here, lazily: ``pip install 'batchfit[quant]'``.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from batchfit.errors import OptionError
from batchfit.workload import StepOptions

BNB_OPTIMIZERS = {"adamw-8bit": "AdamW8bit", "paged-adamw-8bit": "PagedAdamW8bit",
                  "lion-8bit": "Lion8bit", "paged-lion-8bit": "PagedLion8bit"}
"""--optimizer name -> ``bitsandbytes.optim`` class (TrainingArguments' adamw_8bit,
paged_adamw_8bit, lion_8bit, paged_lion_8bit)."""
TORCHAO_OPTIMIZERS = {"adamw-torchao-8bit": "AdamW8bit", "adamw-torchao-4bit": "AdamW4bit"}
"""--optimizer name -> ``torchao.optim`` class (TrainingArguments' adamw_torch_8bit / _4bit)."""
INSTALL = "pip install 'batchfit[quant]'"


@contextlib.contextmanager
def _quiet_imports() -> Iterator[None]:
    """bitsandbytes (an optional CPU kernel package it looks for), and torchao when peft imports it
    (CUDA-only libraries, a torch.compile notice), log warnings at import that concern neither a
    trace nor a CPU step: silenced for the import, as the rest of batchfit's output is one line."""
    loggers = [logging.getLogger(name) for name in ("bitsandbytes", "torchao", "torch.utils._pytree", "root")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def load_bitsandbytes(why: str) -> Any:
    """``import bitsandbytes``, or a one-line OptionError that says what to install (or that the
    installed build cannot load its native library)."""
    try:
        with _quiet_imports():
            import bitsandbytes
            import bitsandbytes.functional  # noqa: F401 - loads the native library
    except ImportError as error:
        raise OptionError(f"{why} needs bitsandbytes: pip install 'batchfit[quant]'") from error
    except Exception as error:  # noqa: BLE001 - a build whose native library does not load
        raise OptionError(f"{why}: bitsandbytes is installed but cannot load ({type(error).__name__}: "
                          f"{str(error).splitlines()[0] if str(error) else ''}); reinstall it "
                          f"({INSTALL}, bitsandbytes>=0.45 has a CPU backend)") from error
    return bitsandbytes


def _load_peft(why: str) -> Any:
    try:
        with _quiet_imports():
            import peft
    except ImportError as error:
        raise OptionError(f"{why} needs peft: pip install 'batchfit[quant]'") from error
    return peft


def _output_head(model: nn.Module) -> nn.Module | None:
    """The output head, never quantized nor adapted (transformers' ``get_keys_to_not_convert``,
    PEFT's all-linear): the model's own answer, else a Linear named lm_head / output / head."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if head is None:
        named = dict(model.named_modules())
        head = next((named[n] for n in ("lm_head", "output", "head") if isinstance(named.get(n), nn.Linear)), None)
    return head


def linear_names(model: nn.Module) -> list[str]:
    """Names of the plain ``nn.Linear`` layers that quantization and all-linear LoRA take."""
    head = _output_head(model)
    return [name for name, m in model.named_modules() if type(m) is nn.Linear and m is not head]


def compute_dtype(options: StepOptions) -> torch.dtype:
    """bnb_4bit_compute_dtype from --precision: bf16 for bf16(-mixed), fp16 for fp16-mixed, else fp32."""
    return {"bf16": torch.bfloat16, "bf16-mixed": torch.bfloat16,
            "fp16-mixed": torch.float16}.get(options.precision, torch.float32)


def quantize_model(model: nn.Module, options: StepOptions, device: torch.device) -> None:
    """Replace the linear layers (not the head) by bitsandbytes' quantized ones, frozen, as
    ``replace_with_bnb_linear`` does, each quantized on ``device`` as soon as it is made
    (``Params4bit._quantize`` / ``Int8Params._quantize``)."""
    if options.quantize == "none":
        return
    bnb = load_bitsandbytes(f"`quantize` {options.quantize}")
    # transformers' bitsandbytes quantizer leaves a model's _keep_in_fp32_modules alone (T5's wo,
    # which T5 casts its input to the weight's dtype for: a uint8 packed weight would make it uint8)
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    names = [name for name in linear_names(model) if not keep & set(name.split("."))]
    if not names:
        raise OptionError(f"`quantize` {options.quantize} found no nn.Linear layer (but the output head) "
                          "to quantize in this model: drop `quantize`")
    kind = options.quantize_spec.kind
    for name in names:
        old = model.get_submodule(name)
        with torch.device("meta"):  # the new module's own init weight: replaced below
            if kind == "int8":
                new = bnb.nn.Linear8bitLt(old.in_features, old.out_features, old.bias is not None,
                                          has_fp16_weights=False, threshold=6.0)
            else:
                new = bnb.nn.Linear4bit(old.in_features, old.out_features, old.bias is not None,
                                        compute_dtype=compute_dtype(options),
                                        compress_statistics=options.quantize_spec.double, quant_type=kind)
        if kind == "int8":
            # Int8Params quantizes when it leaves the CPU for another device; on the CPU itself
            # (the truth runs, the fake trace) the same function quantizes it here.
            new.weight = bnb.nn.Int8Params(old.weight.data.to(torch.float16), requires_grad=False,
                                           has_fp16_weights=False)
            new.weight._quantize(device)
        else:
            new.weight = bnb.nn.Params4bit(old.weight.data, requires_grad=False,
                                           compress_statistics=options.quantize_spec.double,
                                           quant_type=kind, module=new)
            new.weight._quantize(device)
        if old.bias is not None:
            new.bias = nn.Parameter(old.bias.data, requires_grad=False)
        new.requires_grad_(False)
        model.set_submodule(name, new)
        del old
    for param in model.parameters():  # prepare_model_for_kbit_training: the whole base is frozen
        param.requires_grad_(False)
    # what from_pretrained sets: PEFT wraps the layers in its bnb classes only when it is set
    # (peft/tuners/lora/bnb.py: dispatch_bnb_4bit / dispatch_bnb_8bit)
    model.is_loaded_in_4bit, model.is_loaded_in_8bit = kind != "int8", kind == "int8"


def apply_lora(model: nn.Module, options: StepOptions) -> nn.Module:
    """PEFT's LoRA (or DoRA) on ``model``: ``get_peft_model(model, LoraConfig(...))``, which wraps
    a quantized layer in ``peft.tuners.lora.bnb.Linear4bit`` / ``Linear8bitLt``. Only the
    adapters train."""
    spec = options.lora_spec
    if spec is None:
        return model
    peft = _load_peft(f"`lora` {options.lora}")
    linears = [name for name, m in model.named_modules() if _is_linear(m)]
    targets = spec.targets
    if targets:
        missing = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in linears)]
        if missing:
            shown = sorted({n.rsplit(".", 1)[-1] for n in linears})[:8]
            raise OptionError(f"`lora` targets {'+'.join(missing)} match no linear layer of this model; "
                              f"its linear layers are named {', '.join(shown) or '(none)'}")
    elif not [n for n in linears if model.get_submodule(n) is not _output_head(model)]:
        raise OptionError("`lora` found no linear layer (but the output head) to adapt in this model; "
                          f"its modules are named {', '.join(n for n, _ in list(model.named_modules())[1:6])}")
    config = peft.LoraConfig(r=spec.r, lora_alpha=spec.alpha or 2 * spec.r, lora_dropout=0.0,
                             use_dora=spec.dora, target_modules=list(targets) if targets else "all-linear")
    for param in model.parameters():
        param.requires_grad_(False)
    with warnings.catch_warnings():  # transformers' FutureWarning on an attribute PEFT reads
        warnings.simplefilter("ignore", FutureWarning)
        return peft.get_peft_model(model, config)


def preload(options: StepOptions) -> None:
    """Import what ``--quantize`` / ``--lora`` need, and let PEFT import its tuners, before a trace:
    a module that makes tensors at import (peft's LoHa: ``scale=torch.tensor(1)`` defaults) would
    otherwise make them inside the first traced build only, and depths 2, 3, 4 would differ."""
    if options.quantize != "none":
        load_bitsandbytes(f"`quantize` {options.quantize}")
    if options.lora != "none":
        peft = _load_peft(f"`lora` {options.lora}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft.get_peft_model(nn.Sequential(nn.Linear(2, 2)), peft.LoraConfig(r=1, target_modules=["0"]))


def _is_linear(module: nn.Module) -> bool:
    if type(module) is nn.Linear:
        return True
    return type(module).__module__.startswith("bitsandbytes") and isinstance(module, nn.Linear)


def build_low_bit_optimizer(name: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """bitsandbytes' 8-bit / paged optimizers, torchao's low-bit AdamW, with default hyper-parameters."""
    if name in BNB_OPTIMIZERS:
        bnb = load_bitsandbytes(f"`optimizer` {name}")
        return getattr(bnb.optim, BNB_OPTIMIZERS[name])(params, lr=1e-4)
    try:
        import torchao.optim
    except ImportError as error:
        raise OptionError(f"`optimizer` {name} needs torchao: pip install 'batchfit[quant]'") from error
    return getattr(torchao.optim, TORCHAO_OPTIMIZERS[name])(params, lr=1e-4)
