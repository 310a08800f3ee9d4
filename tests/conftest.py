"""Small workloads whose bytes can be worked out by hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchfit.workload import Workload


def mlp_workload(d_in: int = 1024, d_hidden: int = 4096, *, name: str = "mlp") -> Workload:
    """Linear(d_in, d_hidden) -> ReLU -> Linear(d_hidden, d_in); loss = mean(y**2)."""
    return Workload(
        name=name,
        build_model=lambda: nn.Sequential(nn.Linear(d_in, d_hidden), nn.ReLU(), nn.Linear(d_hidden, d_in)),
        make_batch=lambda b, device: torch.randn(b, d_in, device=device),
        loss_fn=lambda model, x: model(x).pow(2).mean(),
        tokens_per_sample=None,
    )


@pytest.fixture
def mlp() -> Workload:
    return mlp_workload()


@pytest.fixture
def one_thread():
    """torch on one thread for the test (deterministic and fast on a shared 2-core machine): the training
    tests take it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
