"""``BatchFit``: a Lightning callback that picks the micro-batch and the accumulation for a global batch.

    trainer = lightning.Trainer(callbacks=[batchfit.lightning.BatchFit(global_batch=512, target_util=0.9)])

At ``setup`` (after the datamodule's own setup, before any data loader is built) it traces a
copy of the LightningModule on fake tensors at the trainer's precision (``mode="estimate"``,
no GPU needed) or probes it on the device (``mode="probe"``), takes the largest micro-batch
under ``target_util`` of the GPU's memory, and sets

- the ``batch_size`` attribute (datamodule, module or hparams, found as Lightning's own
  batch-size finder finds it) to the micro-batch, and
- ``trainer.accumulate_grad_batches`` so that micro-batch x accumulation x devices == global_batch,

then logs the decision and the report it wrote. Unlike Lightning's ``BatchSizeFinder`` it
changes neither the effective batch (the optimizer sees ``global_batch`` samples per step
whatever fits) nor the model: the trace runs on a copy.

This module imports ``lightning``; ``import batchfit`` does not import this module.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr
except ImportError as error:  # say what to install, not just what is missing
    raise ImportError(f"batchfit.lightning needs Lightning: pip install 'batchfit[lightning]' ({error})") from error
from torch import nn

from batchfit.errors import OptionError
from batchfit.integrations.elastic_split import (
    GlobalBatchPlan,
    fake_copy,
    plan_global_batch,
    same_optimizer,
    take_samples,
    to_device,
)
from batchfit.workload import StepOptions, Workload

logger = logging.getLogger(__name__)

PRECISIONS = {"32-true": "fp32", "32": "fp32", "64-true": "fp32", "bf16-mixed": "bf16-mixed",
              "16-mixed": "fp16-mixed", "bf16-true": "bf16", "16-true": "bf16"}
"""Lightning's precision -> the traced step's (16-true is traced as bf16: the same bytes)."""


class BatchFit(Callback):
    """Set the data loader's batch size and the gradient accumulation to reach ``global_batch``.

    ``gpu`` / ``gpu_memory`` name the GPU to size for when the trainer runs where there is none
    (``"h100-80gb"``, ``"24GiB"``); otherwise the GPU here, else a traced H100, said in the log.
    """

    def __init__(self, global_batch: int, *, target_util: float = 0.9, mode: str = "estimate",
                 multiple_of: int = 1, gpu: str | None = None, gpu_memory: str | None = None,
                 limit: str = "reserved", batch_size_attr: str = "batch_size", report: bool = True,
                 report_dir: str | Path | None = None) -> None:
        if mode not in ("estimate", "probe"):
            raise OptionError(f"unknown mode '{mode}': use estimate (traced, no GPU needed) or probe (measured)")
        self.global_batch, self.target_util, self.mode = global_batch, target_util, mode
        self.multiple_of, self.gpu, self.gpu_memory, self.limit = multiple_of, gpu, gpu_memory, limit
        self.batch_size_attr, self.report, self.report_dir = batch_size_attr, report, report_dir
        self.plan: GlobalBatchPlan | None = None
        """The decision, once ``setup`` ran."""
        self.report_path: Path | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not lightning_hasattr(pl_module, self.batch_size_attr):
            raise OptionError(
                f"BatchFit sets the batch size through a '{self.batch_size_attr}' attribute, and neither the "
                "datamodule, the LightningModule nor its hparams has one: add self.batch_size to your "
                "LightningDataModule and build train_dataloader() with it (or pass batch_size_attr=)")
        sample = next(iter(_train_dataloader(trainer, pl_module)))
        precision = str(trainer.precision)
        options = trainer_options(trainer)
        if precision not in PRECISIONS:
            logger.warning("BatchFit: precision '%s' is traced as fp32", precision)
        with warnings.catch_warnings():
            # The copy has no trainer: its self.log() calls warn and do nothing, as they should here.
            warnings.filterwarnings("ignore", message=".*self.log.*")
            self.plan = plan_global_batch(
                lightning_workload(pl_module, sample), model=pl_module, global_batch=self.global_batch,
                world_size=trainer.world_size, multiple_of=self.multiple_of, target_util=self.target_util,
                gpu=self.gpu, gpu_memory=self.gpu_memory, options=options, mode=self.mode, limit=self.limit,
                say=lambda message: logger.info("BatchFit: %s", message))
        before = trainer.accumulate_grad_batches
        lightning_setattr(pl_module, self.batch_size_attr, self.plan.micro_batch)
        trainer.accumulate_grad_batches = self.plan.accumulation_steps
        if before not in (1, self.plan.accumulation_steps):
            logger.warning("BatchFit: accumulate_grad_batches was %d; now %d", before, self.plan.accumulation_steps)
        if self.report:
            folder = Path(self.report_dir) if self.report_dir else Path(trainer.default_root_dir) / "batchfit"
            self.report_path = self.plan.write_report(folder)
        logger.info("BatchFit: %s, %s: %s=%d, accumulate_grad_batches=%d%s", type(pl_module).__name__, precision,
                    self.batch_size_attr, self.plan.micro_batch, self.plan.accumulation_steps,
                    f" ({self.plan.describe()}; report: {self.report_path})" if self.report_path
                    else f" ({self.plan.describe()})")


def training_arguments(trainer: pl.Trainer) -> dict[str, Any]:
    """The Lightning Trainer's settings that change memory, in TrainingArguments' terms, so the
    one mapping (``integrations/trainer_args.py``) reads them as it reads an HF Trainer's."""
    precision = PRECISIONS.get(str(trainer.precision), "fp32")
    fields: dict[str, Any] = {"bf16": precision == "bf16-mixed", "fp16": precision == "fp16-mixed",
                              "gradient_accumulation_steps": trainer.accumulate_grad_batches}
    if trainer.gradient_clip_val:
        fields["max_grad_norm"] = float(trainer.gradient_clip_val)
    strategy = type(trainer.strategy).__name__
    if strategy.startswith("FSDP"):
        fields["fsdp"] = True
    elif strategy.startswith("DeepSpeed"):
        fields["deepspeed"] = dict(getattr(trainer.strategy, "config", None) or {})
    return fields


def trainer_options(trainer: pl.Trainer) -> StepOptions:
    """The traced step's options for ``trainer``: through the mapping the HF Trainer and
    ``--trainer args.json`` take; Lightning's true-half precisions (no TrainingArguments field)
    are traced as bf16 weights and states."""
    from batchfit.integrations.trainer_args import from_training_arguments, traced_in_a_trainer

    mapping = from_training_arguments(training_arguments(trainer), world_size=trainer.world_size,
                                      check_fields=False)
    options = traced_in_a_trainer(mapping, say=lambda line: logger.info("BatchFit: %s", line))
    if PRECISIONS.get(str(trainer.precision)) == "bf16":
        options["precision"] = "bf16"
    return StepOptions(**options)


def _train_dataloader(trainer: pl.Trainer, pl_module: pl.LightningModule):
    if trainer.datamodule is not None and hasattr(trainer.datamodule, "train_dataloader"):
        return trainer.datamodule.train_dataloader()
    try:
        return pl_module.train_dataloader()
    except Exception as error:  # Lightning's default raises: no loader was defined there
        raise OptionError("BatchFit needs one training batch to trace: give the Trainer a LightningDataModule "
                          "or define train_dataloader() on the LightningModule") from error


def _loss(output: Any) -> torch.Tensor:
    """training_step returns the loss, or a dict holding it."""
    return output["loss"] if isinstance(output, dict) else output


def _first_optimizer(configured: Any) -> torch.optim.Optimizer | None:
    """The optimizer in whatever ``configure_optimizers`` returned (an optimizer, a list, a
    tuple of lists, a dict with 'optimizer')."""
    if isinstance(configured, torch.optim.Optimizer):
        return configured
    if isinstance(configured, dict):
        return _first_optimizer(configured.get("optimizer"))
    if isinstance(configured, (list, tuple)) and configured:
        return _first_optimizer(configured[0])
    return None


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def lightning_workload(pl_module: pl.LightningModule, sample_batch: Any) -> Workload:
    """The LightningModule's ``training_step`` as a Workload, with the optimizer its
    ``configure_optimizers`` builds (on the copy's parameters), fed with ``sample_batch``'s samples.

    The optimizer is the one the Trainer will train with, or an OptionError says why it
    cannot be read: never a stand-in (another optimizer holds other state, so its estimate
    would be for another run). In order: the trainer's optimizers once it built them;
    ``configure_optimizers()`` on the copy; on the module itself when the copy's call fails
    (it may read ``self.trainer``, e.g. for a scheduler's total steps, which only the module
    has), then rebuilt over the copy's parameters with the same class and settings."""
    build_copy = fake_copy(pl_module)
    copies: list[nn.Module] = []
    name = type(pl_module).__name__

    def build_model() -> nn.Module:
        copies.append(build_copy())
        return copies[-1]

    def the_modules_optimizer() -> torch.optim.Optimizer:
        trainer = getattr(pl_module, "_trainer", None)
        built = list(getattr(trainer, "optimizers", None) or [])
        if built:
            return built[0]
        try:
            configured = copies[-1].configure_optimizers()
        except Exception as copy_error:
            try:
                configured = pl_module.configure_optimizers()
            except Exception as error:
                raise OptionError(
                    f"BatchFit traces the optimizer {name}.configure_optimizers() builds, and it failed on "
                    f"the module ({_first_line(error)}) and on its copy ({_first_line(copy_error)}): make it "
                    "work at the Trainer's setup, before fit starts") from error
        optimizer = _first_optimizer(configured)
        if optimizer is None:
            raise OptionError(
                f"{name}.configure_optimizers() returned {type(configured).__name__}, in which BatchFit finds no "
                "torch.optim.Optimizer to trace: return an optimizer, a list or tuple of them, or a dict with "
                "'optimizer' (manual optimization with no optimizer cannot be sized)")
        return optimizer

    def optimizer_of_the_copy(params) -> torch.optim.Optimizer:
        optimizer = the_modules_optimizer()
        trained = {id(p) for p in params}
        if {id(p) for group in optimizer.param_groups for p in group["params"]} == trained:
            return optimizer  # built over the copy's parameters, groups and all
        return same_optimizer(optimizer, params)

    def make_batch(n: int, device: torch.device) -> Any:
        return to_device(take_samples(sample_batch, n), device)

    return Workload(name=name, build_model=build_model, make_batch=make_batch,
                    loss_fn=lambda model, batch: _loss(model.training_step(batch, 0)),
                    build_optimizer=optimizer_of_the_copy, description=f"{name}.training_step")

