"""Hugging Face Trainer: the per-device batch and the accumulation for a global batch, from a trace.

    args = batchfit.transformers.fit_training_args(model, args, global_batch=512, seq_len=2048)
    Trainer(model=model, args=args, ...)   # per_device_train_batch_size, gradient_accumulation_steps set

The model is traced as the Trainer will run it: a copy on fake tensors (no GPU, no memory),
with the options ``args`` map onto (``integrations/trainer_args.py``, the mapping ``batchfit
estimate --trainer args.json`` uses: precision, activation checkpointing, torch_compile, Liger,
LoRA / quantization sections where given; what is not used is logged), and with the optimizer class and
settings the Trainer builds from ``args.optim`` (``Trainer.get_optimizer_cls_and_kwargs``) over its
two parameter groups (``Trainer.create_optimizer``: ``param_groups`` decay:WD), or
the one given as ``optimizer=``; an optimizer it cannot build is an error, never AdamW instead.
Unlike ``auto_find_batch_size``, the global batch stays what was asked for: a smaller
micro-batch means more accumulation steps, never a different effective batch.

``fit_training`` also returns a ``TrainerCallback`` (``PeakCheck``) that, on a GPU, compares
the traced peak with ``torch.cuda.max_memory_allocated()`` after the first steps.

This module imports ``transformers`` (the real package: the import is absolute); ``import
batchfit`` does not import this module. The Trainer itself also needs ``accelerate``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

try:
    import transformers
except ImportError as error:  # say what to install, not just what is missing
    raise ImportError(f"batchfit.transformers needs transformers: pip install 'batchfit[hf]' ({error})") from error

from batchfit.errors import OptionError
from batchfit.integrations.elastic_split import GlobalBatchPlan, fake_copy, plan_global_batch, same_optimizer
from batchfit.integrations.trainer_args import from_training_arguments, traced_in_a_trainer
from batchfit.train.attention import attention_of
from batchfit.workload import ATTENTIONS, StepOptions, Workload

logger = logging.getLogger(__name__)

GiB = 2**30


def _optimizer_builder(args: Any, model: nn.Module, optimizer: Any = None):
    """What the Trainer will train with: ``optimizer`` when given (the one passed as
    ``Trainer(optimizers=(optimizer, scheduler))``, or a function of the parameters), else the
    class and settings the Trainer builds for ``args.optim`` (``Trainer.create_optimizer`` calls
    ``get_optimizer_cls_and_kwargs``). An optimizer that cannot be built here is an OptionError
    naming it, never a stand-in: another optimizer holds other state."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return lambda params: same_optimizer(optimizer, params)
    if optimizer is not None:
        return optimizer
    optim = getattr(args, "optim", None)
    name = getattr(optim, "value", optim)  # an OptimizerNames member, or its string
    if optim is None:
        raise OptionError(f"{type(args).__name__} has no 'optim': pass the TrainingArguments the Trainer gets, or "
                          "the Trainer's optimizer: fit_training(..., optimizer=lambda params: MyOptimizer(params))")
    try:
        cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
    except Exception as error:  # a package missing here (bitsandbytes), an unknown name
        lines = str(error).strip().splitlines()
        raise OptionError(
            f"the Trainer's optimizer for optim='{name}' cannot be built here ({type(error).__name__}: "
            f"{lines[0] if lines else ''}): install what it needs, or pass it: fit_training(..., "
            "optimizer=lambda params: MyOptimizer(params))") from error
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise OptionError(f"optim='{name}' makes the Trainer build {getattr(cls, '__name__', cls)}, not a "
                          "torch.optim.Optimizer batchfit can trace: pass one, fit_training(..., "
                          "optimizer=lambda params: MyOptimizer(params))")
    return lambda params: cls(params, **kwargs)


def hf_model_workload(model: nn.Module, seq_len: int, optimizer=None) -> Workload:
    """A transformers model trained on ``seq_len`` tokens per sample, as the Trainer calls it:
    ``model(input_ids=..., labels=...).loss``."""
    from batchfit.zoo.hf import _unpacked_sequences

    vocab = model.config.vocab_size

    def make_batch(batch_size: int, device: torch.device) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab, (batch_size, seq_len), device=device)
        return {"input_ids": ids, "labels": ids}

    def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with _unpacked_sequences(transformers):
            return model(**batch).loss

    name = type(model).__name__
    extra = {"build_optimizer": optimizer} if optimizer is not None else {}
    attention = attention_of(model)  # the user's model's own, named in every output (flex & co.: traced as they are)
    return Workload(name=name, build_model=fake_copy(model), make_batch=make_batch, loss_fn=loss_fn,
                    tokens_per_sample=seq_len, description=f"{name}, seq {seq_len}",
                    attention=attention if attention in ATTENTIONS else None, **extra)


@dataclass
class TrainerFit:
    """What ``fit_training`` decided: the arguments to train with, and how they were found."""

    args: Any
    """The TrainingArguments with per_device_train_batch_size and gradient_accumulation_steps set."""
    plan: GlobalBatchPlan

    @property
    def traced_peak_bytes(self) -> int | None:
        """The traced peak at the chosen micro-batch (max_memory_allocated's view)."""
        result = self.plan.sizing.result
        point = result.point(self.plan.micro_batch) if hasattr(result, "point") else None
        return point.peak_bytes if point is not None else self.plan.sizing.peak_bytes

    def callback(self, after_steps: int = 3) -> PeakCheck:
        return PeakCheck(self.traced_peak_bytes, self.plan.micro_batch, after_steps=after_steps)


def fit_training(model: nn.Module, args: Any, *, global_batch: int, seq_len: int | None = None,
                 target_util: float = 0.9, multiple_of: int = 1, gpu: str | None = None, gpu_memory: str | None = None,
                 mode: str = "estimate", limit: str = "reserved", optimizer: Any = None) -> TrainerFit:
    """Size ``model`` as ``args`` will train it, and split ``global_batch`` over the devices of ``args``.

    ``gpu`` / ``gpu_memory`` name the GPU when there is none here (``"h100-80gb"``, ``"24GiB"``);
    otherwise the GPU here, else a traced H100, said in the log. ``optimizer``: the one given to
    ``Trainer(optimizers=...)`` (an optimizer, or a function of the parameters that builds it);
    by default the one the Trainer builds from ``args.optim``.
    """
    mapping = from_training_arguments(args)  # the one mapping --trainer args.json takes too
    options = StepOptions(**traced_in_a_trainer(mapping, say=lambda line: logger.info("batchfit: %s", line)))
    if optimizer is None:  # the Trainer builds it (create_optimizer): over its two parameter groups
        options = dataclasses.replace(options, param_groups=mapping.step["param_groups"])
    seq_len = seq_len or mapping.seq_len
    if seq_len is None:
        raise OptionError("fit_training needs the tokens per sample: pass seq_len=2048 (or max_length in an SFTConfig)")
    world_size = mapping.world_size
    workload = hf_model_workload(model, seq_len, _optimizer_builder(args, model, optimizer))
    plan = plan_global_batch(workload, model=model, global_batch=global_batch, world_size=world_size,
                             multiple_of=multiple_of, target_util=target_util, gpu=gpu, gpu_memory=gpu_memory,
                             options=options, mode=mode, limit=limit,
                             say=lambda message: logger.info("batchfit: %s", message))
    changes = {"per_device_train_batch_size": plan.micro_batch, "gradient_accumulation_steps": plan.accumulation_steps}
    fitted = dataclasses.replace(args, **changes) if dataclasses.is_dataclass(args) else _with(args, changes)
    logger.info("batchfit: %s, %s%s: per_device_train_batch_size=%d, gradient_accumulation_steps=%d (%s)",
                type(model).__name__, options.precision,
                ", gradient checkpointing" if options.checkpointing == "full" else "",
                plan.micro_batch, plan.accumulation_steps, plan.describe())
    return TrainerFit(fitted, plan)


def _with(args: Any, changes: dict) -> Any:
    import copy

    fitted = copy.copy(args)
    for key, value in changes.items():
        setattr(fitted, key, value)
    return fitted


def fit_training_args(model: nn.Module, args: Any, *, global_batch: int, seq_len: int | None = None,
                      **kwargs) -> Any:
    """``args`` with ``per_device_train_batch_size`` and ``gradient_accumulation_steps`` set so
    that their product x the number of devices == ``global_batch`` (see ``fit_training``)."""
    return fit_training(model, args, global_batch=global_batch, seq_len=seq_len, **kwargs).args


class PeakCheck(transformers.TrainerCallback):
    """After ``after_steps`` optimizer steps on a GPU, log the traced peak next to the observed one."""

    def __init__(self, traced_peak_bytes: int | None, micro_batch: int, *, after_steps: int = 3) -> None:
        self.traced_peak_bytes, self.micro_batch, self.after_steps = traced_peak_bytes, micro_batch, after_steps
        self.observed_peak_bytes: int | None = None
        """torch.cuda.max_memory_allocated() after ``after_steps`` steps; None without a GPU."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != self.after_steps:
            return
        traced = f"{self.traced_peak_bytes / GiB:.2f} GiB" if self.traced_peak_bytes else "unknown"
        if not torch.cuda.is_available():
            logger.info("batchfit: no GPU here, so the traced peak (%s at micro-batch %d) is not checked",
                        traced, self.micro_batch)
            return
        self.observed_peak_bytes = torch.cuda.max_memory_allocated()
        ratio = (f", {self.observed_peak_bytes / self.traced_peak_bytes:.0%} of traced"
                 if self.traced_peak_bytes else "")
        logger.info("batchfit: peak after %d steps at micro-batch %d: traced %s, observed %.2f GiB "
                    "(max_memory_allocated%s)", state.global_step, self.micro_batch, traced,
                    self.observed_peak_bytes / GiB, ratio)
