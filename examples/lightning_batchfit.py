"""The BatchFit callback: Lightning trains with the micro-batch and accumulation that reach a global batch.

    python examples/lightning_batchfit.py

Runs on the CPU in seconds. Without a GPU the callback sizes for the GPU you name (here a
small one, 600 MiB, so that the global batch of 256 needs accumulation: name yours, e.g.
gpu="h100-80gb"); on a GPU it sizes for that GPU. It sets the datamodule's batch_size and
trainer.accumulate_grad_batches at setup, logs them and writes its report.
"""

from __future__ import annotations

import logging
import tempfile

import lightning
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import batchfit.lightning


class Model(lightning.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 64))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Data(lightning.LightningDataModule):
    def __init__(self, batch_size: int = 32) -> None:
        super().__init__()
        self.batch_size = batch_size  # BatchFit sets this

    def setup(self, stage: str) -> None:
        self.data = TensorDataset(torch.randn(1024, 16, 64), torch.randn(1024, 16, 64))

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)


def main(root_dir: str | None = None) -> tuple[batchfit.lightning.BatchFit, lightning.Trainer, Data]:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    root_dir = root_dir or tempfile.mkdtemp(prefix="batchfit-lightning-")
    fit = batchfit.lightning.BatchFit(global_batch=256, target_util=0.9, gpu_memory="600MiB")
    trainer = lightning.Trainer(accelerator="cpu", devices=1, max_steps=3, callbacks=[fit], logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, default_root_dir=root_dir)
    data = Data()
    trainer.fit(Model(), datamodule=data)
    print(f"trained {trainer.global_step} steps of {data.batch_size} x {trainer.accumulate_grad_batches} samples; "
          f"report: {fit.report_path}")
    return fit, trainer, data


if __name__ == "__main__":
    main()
