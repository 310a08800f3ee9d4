"""The Lightning callback: a real ``lightning.Trainer`` on the CPU, sized for a small named GPU.

The GPU is 600 MiB (88 MiB usable after the CUDA context, 64 MiB of it cuBLAS workspace), so
the traced micro-batch of this model is smaller than the global batch and the callback must
accumulate; the test then checks that the fit ran with exactly those numbers: the data loader's
batches hold ``micro_batch`` samples and the optimizer stepped once per ``accumulation`` batches.
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

lightning = pytest.importorskip("lightning")

from batchfit.integrations.lightning import BatchFit  # noqa: E402

GLOBAL_BATCH = 256
SEQ, WIDTH, HIDDEN = 16, 64, 512


class TinyModule(lightning.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, WIDTH))
        self.batch_sizes: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.batch_sizes.append(x.shape[0])
        loss = (self.net(x) - y).pow(2).mean()
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class TinyData(lightning.LightningDataModule):
    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(2 * GLOBAL_BATCH, SEQ, WIDTH, generator=g),
                                  torch.randn(2 * GLOBAL_BATCH, SEQ, WIDTH, generator=g))

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)


def test_batchfit_sets_the_batch_size_and_accumulation_it_logs_and_the_fit_runs(tmp_path, caplog):
    module, data = TinyModule(), TinyData()
    callback = BatchFit(global_batch=GLOBAL_BATCH, gpu_memory="600MiB")
    trainer = lightning.Trainer(accelerator="cpu", devices=1, max_steps=2, callbacks=[callback], logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                default_root_dir=tmp_path)
    with caplog.at_level(logging.INFO, logger="batchfit"):
        trainer.fit(module, datamodule=data)
    plan = callback.plan
    micro, accumulation = plan.micro_batch, plan.accumulation_steps
    assert accumulation > 1 and micro * accumulation == GLOBAL_BATCH
    assert micro <= plan.sizing.micro_batch  # never above what was traced to fit
    assert data.batch_size == micro and trainer.accumulate_grad_batches == accumulation
    assert f"batch_size={micro}, accumulate_grad_batches={accumulation}" in caplog.text
    assert "GPU with 600.00 MiB" in caplog.text and (tmp_path / "batchfit" / "report.md").exists()
    # the fit ran with those numbers: 2 optimizer steps of `accumulation` micro-batches of `micro`
    assert trainer.global_step == 2
    assert module.batch_sizes == [micro] * (2 * accumulation)


def test_import_batchfit_pulls_in_neither_lightning_nor_transformers():
    import subprocess

    code = ("import sys, batchfit; heavy = [m for m in ('lightning', 'transformers') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_lightning_example_runs(tmp_path):
    from tiny import load_example

    fit, trainer, data = load_example("lightning_batchfit").main(str(tmp_path))
    assert trainer.global_step == 3
    assert (data.batch_size, trainer.accumulate_grad_batches) == (fit.plan.micro_batch, fit.plan.accumulation_steps)
    assert data.batch_size * trainer.accumulate_grad_batches == 256 and fit.report_path.exists()


class ScheduledModule(TinyModule):
    """Its optimizer needs the trainer (OneCycleLR's total steps), which BatchFit's copy has not."""

    def configure_optimizers(self):
        sgd = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        steps = self.trainer.estimated_stepping_batches
        return {"optimizer": sgd, "lr_scheduler": torch.optim.lr_scheduler.OneCycleLR(sgd, 0.1, total_steps=steps)}


class BrokenModule(TinyModule):
    def configure_optimizers(self):
        raise RuntimeError("no optimizer today")


def _fit(module, tmp_path):
    callback = BatchFit(global_batch=GLOBAL_BATCH, gpu_memory="600MiB", limit="allocated", report=False)
    trainer = lightning.Trainer(accelerator="cpu", devices=1, max_steps=1, callbacks=[callback], logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                default_root_dir=tmp_path)
    trainer.fit(module, datamodule=TinyData())
    return callback


def test_the_modules_own_optimizer_is_traced_when_it_needs_the_trainer(tmp_path):
    """SGD with momentum keeps one fp32 buffer per parameter (AdamW would keep two):
    Linear(64, 512) + Linear(512, 64) = 131,072 + 2,048 + 131,072 + 512 (256 B in a 512 B block)."""
    callback = _fit(ScheduledModule(), tmp_path)
    point = callback.plan.sizing.result.points[0]
    assert point.breakdown["optimizer_state"] == 131_072 + 2_048 + 131_072 + 512


def test_an_optimizer_that_cannot_be_built_is_an_error_naming_it(tmp_path):
    from batchfit.errors import OptionError

    with pytest.raises(OptionError, match=r"BrokenModule.configure_optimizers\(\) builds, and it failed .*"
                                          "no optimizer today") as error:
        _fit(BrokenModule(), tmp_path)
    assert "\n" not in str(error.value)
