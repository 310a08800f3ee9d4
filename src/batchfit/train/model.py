"""Preparing the model a step trains: building the optimizer an option names, moving a model
(also a fake one) to its device and dtype, finding its main stack of blocks, and freezing
parameters by name. Used by the training step and by the tracer's depth cuts."""

from __future__ import annotations

import fnmatch
import re
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from batchfit.errors import OptionError
from batchfit.workload import KEEP_FP32, StepOptions


def build_optimizer(name: str, params: list[nn.Parameter], model: nn.Module | None = None) -> torch.optim.Optimizer:
    """The --optimizer overrides, with the hyper-parameters that do not change memory left default.
    ``model`` (the step's, wrapped or not): muon splits its parameters by module (train/muon.py)."""
    if name == "muon":
        from batchfit.train.muon import muon_optimizer

        return muon_optimizer(params, model)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=3e-4)
    if name == "adam":
        return torch.optim.Adam(params, lr=3e-4)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-2)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    if name != "adafactor":  # bitsandbytes' and torchao's low-bit optimizers (the [quant] extra)
        from batchfit.train.quantize import build_low_bit_optimizer

        return build_low_bit_optimizer(name, params)
    if not hasattr(torch.optim, "Adafactor"):
        raise OptionError("`optimizer` adafactor needs torch>=2.5: upgrade torch or pick adamw")
    return torch.optim.Adafactor(params, lr=1e-2)


NO_DECAY_NAMES = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")
"""The HF Trainer's names of parameters without weight decay, searched in the lower-cased name
(``Trainer.get_decay_parameter_names``' forbidden_name_patterns, transformers 5)."""


def decay_parameter_names(model: nn.Module) -> set[str]:
    """The parameters the HF Trainer decays: every one but those inside an ``nn.LayerNorm`` and those
    whose name :data:`NO_DECAY_NAMES` finds (``transformers.trainer_pt_utils.get_parameter_names`` checks
    each ancestor's suffix of the name; a suffix that matches makes the whole name match, so the whole
    name is enough)."""
    layer_norms = {name for name, module in model.named_modules() if isinstance(module, nn.LayerNorm) and name}
    return {name for name, _ in model.named_parameters()
            if not NO_DECAY_NAMES.search(name.lower())
            and not any(name.startswith(f"{norm}.") for norm in layer_norms)}


def optimizer_params(model: nn.Module, params: list[nn.Parameter], options: StepOptions) -> list[Any]:
    """What the optimizer is built over: ``params`` as one group, or the HF Trainer's two group dicts
    (``Trainer.create_optimizer``: the decayed weights in the model's order with ``weight_decay``, then
    the rest with none). Both keep their dict even when empty, as the Trainer's (a LoRA step has no
    bias or norm to train)."""
    spec = options.param_groups_spec
    if not spec.decay_split or options.optimizer == "muon":  # Muon splits by module itself (train/muon.py)
        return params
    decay, trained = decay_parameter_names(model), {id(p) for p in params}
    named = [(name, p) for name, p in model.named_parameters() if id(p) in trained]
    return [{"params": [p for name, p in named if name in decay], "weight_decay": spec.weight_decay},
            {"params": [p for name, p in named if name not in decay], "weight_decay": 0.0}]


def move_module(model: nn.Module, device: torch.device, dtype: torch.dtype | None) -> nn.Module:
    """``model.to(device, dtype)``, also for fake models (Module.to cannot swap fake params); the
    modules marked :data:`KEEP_FP32` stay in fp32."""
    kept = [m for m in model.modules() if getattr(m, KEEP_FP32, False)]
    if not any(isinstance(t, FakeTensor) for t in (*model.parameters(), *model.buffers())):
        model = model.to(device=device, dtype=dtype) if dtype else model.to(device)
        for module in kept:
            module.float()
        return model

    def convert(t: torch.Tensor, fp32: bool = False) -> torch.Tensor:
        to = torch.float32 if fp32 else dtype
        return t.to(device=device, dtype=to if to and t.is_floating_point() else None)

    def convert_parameter(p: nn.Parameter, fp32: bool = False) -> nn.Parameter:
        # a parameter class with its own ``to`` (bitsandbytes' Params4bit quantizes there, as
        # ``model.to("cuda")`` does for a QLoRA model built by hand) is kept as that returns it
        moved = convert(p, fp32)
        own = type(p).to is not torch.Tensor.to and isinstance(moved, nn.Parameter)
        return moved if own else nn.Parameter(moved, p.requires_grad)

    # id(tensor) -> (tensor, its moved copy): shared (tied) tensors stay shared. The original is kept
    # so that its id stays its own: once its slot holds the copy it would die, and a tensor made
    # later at its address would be taken for it (the reference model's fp32 head became the
    # policy's, about one build in fifteen: its own storage freed, the parameters 32 KB low).
    moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.no_grad():
        # the fp32 ones first: a tensor they share is theirs; each module once (a second visit of a
        # kept one would look up its copies, not the tensors it was built with)
        for module in dict.fromkeys([*kept, *model.modules()]):
            fp32 = module in kept
            for slots, make in ((module._parameters, convert_parameter),
                                (module._buffers, convert)):
                for name, tensor in slots.items():
                    if tensor is not None:
                        if id(tensor) not in moved:
                            moved[id(tensor)] = (tensor, make(tensor, fp32))
                        slots[name] = moved[id(tensor)][1]
    return model


def block_list(model: nn.Module) -> nn.ModuleList | None:
    """The model's main stack of blocks: its largest ModuleList of modules of one class."""
    best = None
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            if len({type(m) for m in module}) == 1 and (best is None or len(module) > len(best)):
                best = module
    return best


def block_lists(model: nn.Module) -> list[nn.ModuleList]:
    """Every stack of repeated blocks: :func:`block_list`, and each other ModuleList of two or
    more modules of one class with parameters (an encoder-decoder's two stacks, a policy and its
    reference), outermost first and never one inside another's blocks: what FSDP wraps block by
    block (``distributed.strategy._fully_shard_blocks``)."""
    main = block_list(model)
    found = [main] if main is not None else []
    inside = {id(m) for block in found for m in block.modules()}
    for module in model.modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2 or any(id(m) in inside for m in (module, *module)):
            continue  # (a list that holds another's blocks again: FrozenPair.blocks and its LMs' layers)
        if len({type(m) for m in module}) == 1 and all(any(True for _ in m.parameters()) for m in module):
            found.append(module)
            inside |= {id(m) for m in module.modules()}
    return found


def main_blocks(model: nn.Module) -> nn.ModuleList | None:
    """The stack a depth cut shortened (``trace.depth.at_depth`` marks it), else :func:`block_list`:
    in a model with two stacks (GRPO's policy and reference) the cut one need not be the longest."""
    cut = next((m for m in model.modules() if getattr(m, "_batchfit_cut", False)), None)
    return cut if cut is not None else block_list(model)


def apply_freezing(model: nn.Module, options: StepOptions) -> None:
    names = [name for name, _ in model.named_parameters()]
    for patterns in (options.frozen, options.trainable):
        for pattern in patterns:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                raise OptionError(
                    f"the pattern '{pattern}' matches no parameter; names look like '{names[0]}'"
                )
    for name, param in model.named_parameters():
        if options.trainable and not any(fnmatch.fnmatchcase(name, p) for p in options.trainable):
            param.requires_grad_(False)
        if any(fnmatch.fnmatchcase(name, p) for p in options.frozen):
            param.requires_grad_(False)
