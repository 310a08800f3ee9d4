"""The training step: the one function the tracer, the probe and the bench all run.

Only the tensors differ: fake (tracer), capped fake (virtual device), real (CUDA, CPU).
Hooks let an engine see where it is in the step (inputs, forward, backward, optimizer)
without the step knowing who is watching.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.checkpoint import checkpoint

from batchfit.errors import OptionError
from batchfit.phases import PHASES  # noqa: F401 - the names hooks.phase() receives
from batchfit.workload import StepOptions, Workload

class StepHooks(Protocol):
    def phase(self, name: str) -> None:
        """Called as the step enters one of PHASES (or 'idle' when it is done)."""

    def before_zero_grad(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Called after optimizer.step(), while gradients still exist."""


class NoHooks:
    def phase(self, name: str) -> None:
        pass

    def before_zero_grad(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        pass


def build_optimizer(name: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The --optimizer overrides, with the hyper-parameters that do not change memory left default."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=3e-4)
    if name == "adam":
        return torch.optim.Adam(params, lr=3e-4)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-2)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    if not hasattr(torch.optim, "Adafactor"):
        raise OptionError("--optimizer adafactor needs torch>=2.5: upgrade torch or pick adamw")
    return torch.optim.Adafactor(params, lr=1e-2)


def move_module(model: nn.Module, device: torch.device, dtype: torch.dtype | None) -> nn.Module:
    """``model.to(device, dtype)``, also for fake models (Module.to cannot swap fake params)."""
    if not any(isinstance(t, FakeTensor) for t in (*model.parameters(), *model.buffers())):
        return model.to(device=device, dtype=dtype) if dtype else model.to(device)

    def convert(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype if dtype and t.is_floating_point() else None)

    moved: dict[int, torch.Tensor] = {}  # shared (tied) tensors stay shared
    with torch.no_grad():
        for module in model.modules():
            for slots, make in ((module._parameters, lambda p: nn.Parameter(convert(p), p.requires_grad)),
                                (module._buffers, convert)):
                for name, tensor in slots.items():
                    if tensor is not None:
                        if id(tensor) not in moved:
                            moved[id(tensor)] = make(tensor)
                        slots[name] = moved[id(tensor)]
    return model


def block_list(model: nn.Module) -> nn.ModuleList | None:
    """The model's main stack of blocks: its largest ModuleList of modules of one class."""
    best = None
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            if len({type(m) for m in module}) == 1 and (best is None or len(module) > len(best)):
                best = module
    return best


def main_blocks(model: nn.Module) -> nn.ModuleList | None:
    """The stack a depth cut shortened (``trace.depth.at_depth`` marks it), else :func:`block_list`:
    in a model with two stacks (GRPO's policy and reference) the cut one need not be the longest."""
    cut = next((m for m in model.modules() if getattr(m, "_batchfit_cut", False)), None)
    return cut if cut is not None else block_list(model)


def _checkpoint_blocks(model: nn.Module, preserve_rng_state: bool) -> None:
    blocks = block_list(model)
    if blocks is None:
        raise OptionError(
            "--checkpointing full needs a model with an nn.ModuleList of blocks; "
            "this model has none: apply torch.utils.checkpoint in the model and drop the option"
        )
    for block in blocks:
        forward = block.forward

        def checkpointed(*args, _forward=forward, **kwargs):
            return checkpoint(_forward, *args, use_reentrant=False,
                              preserve_rng_state=preserve_rng_state, **kwargs)

        block.forward = checkpointed


def _apply_freezing(model: nn.Module, options: StepOptions) -> None:
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


class TrainingStep:
    """A model and optimizer built from a Workload, ready to run optimizer steps.

    The step knows nothing about who watches it: an engine passes ``hooks`` to :meth:`run`,
    and the tracer installs its CUDA mirrors by replacing :attr:`step_context` and
    :attr:`forward_autocast` (see ``trace/session.py``). Nor does it know about distribution:
    ``wrap`` (``batchfit.parallel.step_wrapper``) turns the model into what a multi-GPU run
    trains (DDP, FSDP2) and :attr:`model` is what it returns.
    """

    def __init__(self, workload: Workload, options: StepOptions, device: torch.device, *,
                 wrap: Callable[[nn.Module], nn.Module] | None = None) -> None:
        self.workload = workload
        self.options = options
        self.device = device
        # Built directly on the target device: a model built on the CPU first would need its
        # whole fp32 copy in host memory (32 GB for an 8B model) before moving.
        with device:
            model = workload.build_model()
        dtype = torch.bfloat16 if options.precision == "bf16" else None
        self.model = move_module(model, device, dtype)
        _apply_freezing(self.model, options)
        if options.checkpointing == "full":
            # Fake tensors cannot snapshot the CPU generator; dropout-free steps do not need it.
            _checkpoint_blocks(self.model, preserve_rng_state=device.type == "cuda")
        if wrap is not None:
            # After freezing and checkpointing (they name and patch the plain model's modules),
            # before the optimizer: FSDP2 replaces the parameters with their shards, and the
            # optimizer (and its state) must be built over those.
            self.model = wrap(self.model)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params:
            raise OptionError("every parameter is frozen: loosen --freeze or --train-only")
        self.optimizer = (build_optimizer(options.optimizer, params) if options.optimizer
                          else workload.build_optimizer(params))
        self.scaler = None
        if options.precision == "fp16-mixed" and device.type == "cuda":
            self.scaler = torch.amp.GradScaler("cuda")
        self.step_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        """Entered around each whole step (the tracer's CUDA autocast mirror lives here)."""
        self.forward_autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        """The autocast region of the forward pass (and generation)."""
        if options.precision in ("bf16-mixed", "fp16-mixed"):
            dtype = torch.bfloat16 if options.precision == "bf16-mixed" else torch.float16
            self.forward_autocast = lambda: torch.autocast(device.type, dtype=dtype)

    def run(self, batch_size: int, hooks: StepHooks | None = None) -> torch.Tensor:
        """One optimizer step over ``accumulation_steps`` micro-batches; returns the last loss."""
        with self.step_context():
            return self._run(batch_size, hooks or NoHooks())

    def _run(self, batch_size: int, hooks: StepHooks) -> torch.Tensor:
        forward_autocast = self.forward_autocast
        accumulation = self.options.accumulation_steps
        loss = None
        for _ in range(accumulation):
            hooks.phase("inputs")
            batch = self.workload.make_batch(batch_size, self.device)
            if self.workload.generate is not None:
                hooks.phase("generate")
                with torch.no_grad(), forward_autocast():
                    batch = self.workload.generate(self.model, batch)
            hooks.phase("forward")
            with forward_autocast():
                loss = self.workload.loss_fn(self.model, batch)
            del batch  # the graph keeps what backward needs; let the rest go
            hooks.phase("backward")
            scaled = loss / accumulation if accumulation > 1 else loss
            if self.scaler is not None:
                scaled = self.scaler.scale(scaled)
            scaled.backward()
            del scaled
            loss = loss.detach()
        hooks.phase("optimizer")
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        hooks.before_zero_grad(self.model, self.optimizer)
        # Zeroing right after the step (as nanoGPT does) frees the gradients before the next
        # forward; zeroing before backward instead would keep them through it.
        self.optimizer.zero_grad(set_to_none=self.options.set_to_none)
        hooks.phase("idle")
        return loss
