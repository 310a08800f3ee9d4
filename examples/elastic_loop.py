"""ElasticStep in a plain training loop: each batch is the global batch, cut into micro-batches.

    python examples/elastic_loop.py

Runs on the CPU in a second. There is no GPU to run out of here, so a forward hook plays one
that holds at most 24 samples (it raises torch.OutOfMemoryError above that, as CUDA would):
the first step runs out at 32, redoes the batch at 16, and every step after runs at 16. The
parameters end where one full-batch step per batch would have put them.
"""

from __future__ import annotations

import torch
from torch import nn

import batchfit

GLOBAL_BATCH = 96
GPU_HOLDS_SAMPLES = 24  # the pretend GPU's limit; delete the hook below on a real one


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)  # a mean over the micro-batch's samples


def pretend_gpu(module: nn.Module, args: tuple) -> None:
    if args[0].shape[0] > GPU_HOLDS_SAMPLES:
        raise torch.OutOfMemoryError(f"CUDA out of memory (pretend: more than {GPU_HOLDS_SAMPLES} samples)")


def main(steps: int = 5) -> list[batchfit.ElasticInfo]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10))
    model.register_forward_pre_hook(pretend_gpu)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = batchfit.ElasticStep(model, optimizer, loss_fn, micro_batch=32)
    data = torch.utils.data.TensorDataset(torch.randn(steps * GLOBAL_BATCH, 32),
                                          torch.randint(0, 10, (steps * GLOBAL_BATCH,)))
    infos = []
    for batch in torch.utils.data.DataLoader(data, batch_size=GLOBAL_BATCH):
        info = step(batch)  # micro-batches + accumulation, one optimizer step
        infos.append(info)
        recovered = f", recovered from an OOM at {list(info.failed_micro_batches)}" if info.oom_events else ""
        print(f"loss {info.loss:.4f}: {info.accumulation_steps} micro-batches of {info.micro_batch}{recovered}")
    return infos


if __name__ == "__main__":
    main()
