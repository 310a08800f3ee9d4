"""What estimate suggests when nothing fits (issue 19, item 20): only options that apply."""

from __future__ import annotations

import torch
from torch import nn

from batchfit import estimate
from batchfit.targets import parse_target
from batchfit.workload import Workload

D = 4096  # one Linear(4096, 4096): 64 MiB of fp32 weights, 256 MiB with gradients and AdamW's two states


class WithAdapter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(D, D)
        self.lora_a, self.lora_b = nn.Linear(D, 8, bias=False), nn.Linear(8, D, bias=False)

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x))


def workload(build) -> Workload:
    return Workload(name="linear", build_model=build, make_batch=lambda b, d: torch.randn(b, D, device=d),
                    loss_fn=lambda m, x: m(x).pow(2).mean())


def suggested(build) -> list[str]:
    # 600 MiB total - 512 MiB CUDA context = 88 MiB usable: batch 1 cannot fit
    result = estimate(workload(build), device=parse_target("virtual:600MiB").device, max_batch=8,
                      limit="allocated")
    assert result.max_batch_size == 0
    return [s.option for s in result.suggestions]


def test_lora_is_suggested_only_for_a_model_with_lora_parameters():
    assert "--train-only '*lora*'" not in suggested(lambda: nn.Linear(D, D))  # it would say: matches no parameter
    assert "--train-only '*lora*'" in suggested(WithAdapter)
