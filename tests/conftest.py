"""Small workloads whose bytes can be worked out by hand."""

from __future__ import annotations

import types

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


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory, monkeypatch):
    """Each test has its own $BATCHFIT_CACHE (the trace cache, the token cache): no test reads
    or writes the user's, and none reads the traces another test left."""
    monkeypatch.setenv("BATCHFIT_CACHE", str(tmp_path_factory.mktemp("batchfit-cache")))


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


@pytest.fixture
def fewer_blocks(tmp_path):
    """``fewer_blocks("hf:llama-3.2-1b", 10)``: the spec of that shipped transformers config with 10
    hidden layers instead of its own (written to a config.json under tmp_path), for the tests whose
    claim is an equality between two ways of tracing the same model (by depth or whole, a stream
    written or traced) and holds at any depth past ``depth.MIN_BLOCKS``: a trace on fake tensors
    costs by the op, so by the block, not by the width."""
    import json

    from batchfit.zoo.hf import CONFIGS

    def spec(shipped: str, blocks: int) -> str:
        name = shipped.removeprefix("hf:")
        config = dict(CONFIGS[name])
        key = "n_layer" if "n_layer" in config else "num_hidden_layers"
        config[key] = blocks
        path = tmp_path / f"{name}-{blocks}-blocks.json"
        path.write_text(json.dumps(config))
        return f"hf:{path}"

    return spec


@pytest.fixture
def standin(monkeypatch) -> types.SimpleNamespace:
    """The stand-in tracer of tests/standin.py, whose numbers are known: ``standin.tracer`` is plan's
    ``trace=``, ``replay=`` and ``parse=`` for it, and the CLI's ``plan`` takes them for the test."""
    import functools

    from batchfit.plan.engine import plan
    from standin import parse_strategies, replay_sharded, trace_sharded

    tracer = dict(trace=trace_sharded, replay=replay_sharded, parse=parse_strategies)
    monkeypatch.setattr("batchfit.plan.engine.plan", functools.partial(plan, **tracer))
    return types.SimpleNamespace(parse_strategies=parse_strategies, trace_sharded=trace_sharded, tracer=tracer)
