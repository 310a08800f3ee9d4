"""Several ranks: each rank on its own GPU, and the probe wraps the model as DDP / FSDP2 would.

Truth without a GPU: two real processes on the CPU over gloo. A wrapped step is real DDP
(or FSDP2) when, after one SGD step on different data per rank, every rank holds the
parameters that one process gets from one step on the two batches concatenated (the
gradient of the mean over the whole batch is the mean of the ranks' gradients).

Checked against torch's own DDP and FSDP2 running for real over gloo (the same parameters as one process stepping on
the whole batch).
"""

from __future__ import annotations

import datetime
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from typer.testing import CliRunner

from batchfit.cli.app import app
from batchfit.distributed import wrap as parallel
from batchfit.errors import OptionError
from batchfit.probe import ranks
from batchfit.probe.find import find_max_batch
from batchfit.targets import Target, parse_target
from batchfit.train.step import TrainingStep
from batchfit.workload import StepOptions, Workload
from batchfit.zoo.transformer import Transformer, TransformerConfig
from cpu_truth import spawn_profiled_gloo

CFG = TransformerConfig(vocab_size=64, seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ff=32)
SAMPLES_PER_RANK = 2
SGD = StepOptions(optimizer="sgd")  # p - lr * grad: the update is linear in the gradient


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    n = 2 * SAMPLES_PER_RANK
    return (torch.randint(0, CFG.vocab_size, (n, CFG.seq_len), generator=g),
            torch.randint(0, CFG.vocab_size, (n, CFG.seq_len), generator=g))


def transformer_workload(rows: slice) -> Workload:
    """A 2-block transformer trained on the fixed samples ``rows`` (a rank's share, or all)."""
    x, y = _tokens()

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        logits = model(batch[0])
        return F.cross_entropy(logits.view(-1, logits.size(-1)), batch[1].view(-1))

    return Workload(name="tiny-transformer", build_model=lambda: Transformer(CFG),
                    make_batch=lambda b, device: (x[rows].to(device), y[rows].to(device)),
                    loss_fn=loss_fn, tokens_per_sample=CFG.seq_len)


def _join(rank: int, port: int) -> None:
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    # Joined here with a bounded timeout, so a broken collective fails the test instead of hanging it.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))


def _leave() -> None:
    dist.barrier()  # neither rank tears the group down while the other still uses it
    dist.destroy_process_group()


def _one_step_main(rank: int, port: int, strategy: str, out_dir: str) -> None:
    _join(rank, port)
    torch.manual_seed(0)  # the same initial weights on both ranks, as a real run loads them
    rows = slice(rank * SAMPLES_PER_RANK, (rank + 1) * SAMPLES_PER_RANK)
    # FSDP2 with checkpointed blocks: the wrap comes after checkpointing patched the blocks, and
    # recomputing a block in backward must find its parameters gathered (the numbers do not change).
    options = StepOptions(optimizer="sgd", checkpointing="full") if strategy == "fsdp" else SGD
    step = TrainingStep(transformer_workload(rows), options, torch.device("cpu"),
                        wrap=parallel.step_wrapper(strategy, torch.device("cpu")))
    step.run(SAMPLES_PER_RANK)
    model = step.model.module if strategy == "ddp" else step.model
    params = {name: p.full_tensor() if strategy == "fsdp" else p.detach().clone()
              for name, p in model.named_parameters()}
    local_elements = sum((p.to_local() if strategy == "fsdp" else p).numel() for p in model.parameters())
    torch.save({"params": params, "local_elements": local_elements, "wrapped": type(step.model).__name__},
               os.path.join(out_dir, f"rank{rank}.pt"))
    _leave()


def _one_step_on_two_ranks(strategy: str, tmp_path) -> tuple[list[dict], dict[str, torch.Tensor], int]:
    spawn_profiled_gloo(_one_step_main, lambda port: (port, strategy, str(tmp_path)), nprocs=2)
    per_rank = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    torch.manual_seed(0)
    alone = TrainingStep(transformer_workload(slice(None)), SGD, torch.device("cpu"))
    total_elements = sum(p.numel() for p in alone.model.parameters())  # the tied head counted once
    initial = {n: p.detach().clone() for n, p in alone.model.named_parameters()}
    alone.run(2 * SAMPLES_PER_RANK)
    expected = {n: p.detach() for n, p in alone.model.named_parameters()}
    assert any(not torch.equal(initial[n], expected[n]) for n in expected)  # the step moved the weights
    return per_rank, expected, total_elements


@pytest.mark.slow
def test_ddp_step_is_one_step_on_the_whole_batch(tmp_path):
    per_rank, expected, total = _one_step_on_two_ranks("ddp", tmp_path)
    for got in per_rank:
        assert got["wrapped"] == "DistributedDataParallel"
        assert got["params"].keys() == expected.keys()
        for name, tensor in expected.items():
            torch.testing.assert_close(got["params"][name], tensor, msg=name)
        assert got["local_elements"] == total  # DDP: every rank keeps the whole model


def test_fsdp_step_is_one_step_on_the_whole_batch_and_each_rank_holds_half(tmp_path):
    per_rank, expected, total = _one_step_on_two_ranks("fsdp", tmp_path)
    for got in per_rank:
        assert got["wrapped"].startswith("FSDP")
        for name, tensor in expected.items():
            torch.testing.assert_close(got["params"][name], tensor, msg=name)
        # Every parameter's first dimension is even (see CFG), so the shards are exact halves.
        assert got["local_elements"] * 2 == total


def _probe_main(rank: int, port: int, out_dir: str) -> None:
    _join(rank, port)
    seen: set[str] = set()  # the class of the model the loss is computed through, on this rank

    def loss_fn(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        seen.add(type(model).__name__)
        return model(x).pow(2).mean()

    workload = Workload(name="mlp", build_model=lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)),
                        make_batch=lambda b, device: torch.randn(b, 8, device=device), loss_fn=loss_fn,
                        tokens_per_sample=None)
    result = find_max_batch(workload, target=parse_target("cpu"), policy="binsearch", largest=8)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"result": result.to_json(), "seen": sorted(seen)}, f)
    _leave()


def test_probe_under_two_ranks_wraps_in_ddp_and_the_ranks_agree(tmp_path):
    spawn_profiled_gloo(_probe_main, lambda port: (port, str(tmp_path)), nprocs=2)
    per_rank = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for got in per_rank:
        assert got["seen"] == ["DistributedDataParallel"]  # the default under torchrun
        j = got["result"]
        assert (j["strategy"], j["world_size"], j["max_batch_size"]) == ("ddp", 2, 8)
    trials = [[(t["batch_size"], t["status"]) for t in got["result"]["trials"]] for got in per_rank]
    assert trials[0] == trials[1]


def test_strategies_are_checked_before_anything_runs():
    with pytest.raises(OptionError, match="use one of ddp, fsdp"):
        parallel.step_wrapper("zero3", torch.device("cpu"))
    with pytest.raises(OptionError, match="drop `strategy`"):  # fake tensors cannot join a process group
        parallel.choose_strategy("fsdp", virtual=True, world_size=2)
    with pytest.raises(OptionError, match="torchrun"):
        parallel.choose_strategy("ddp", virtual=False, world_size=1)
    with pytest.raises(OptionError, match="drop `isolate`"):
        parallel.choose_strategy(None, virtual=False, world_size=2, isolate=True)
    assert parallel.choose_strategy(None, virtual=False, world_size=2) == "ddp"
    assert parallel.choose_strategy(None, virtual=True, world_size=2) is None  # each rank traces, as before
    assert parallel.choose_strategy(None, virtual=False, world_size=1) is None
    assert parallel.step_wrapper(None, torch.device("cpu")) is None
    with pytest.raises(OptionError, match="virtual device"):
        find_max_batch(transformer_workload(slice(None)), target=parse_target("virtual:1GiB"), strategy="ddp")


def test_cli_says_strategy_is_for_real_devices():
    result = CliRunner().invoke(app, ["probe", "gpt-tinystories-22m", "--seq-len", "32", "--device", "virtual:1GiB",
                                      "--strategy", "ddp"])
    assert result.exit_code == 2 and "drop --strategy" in result.output


def _fake_gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(ranks, "detect_cuda_device", lambda index: f"gpu {index}")


def test_each_rank_probes_its_own_gpu(monkeypatch):
    _fake_gpus(monkeypatch, 4)
    cuda = Target("cuda", "gpu 0", "cuda", 0)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert ranks.local_target(cuda) == Target("cuda", "gpu 3", "cuda:3", 3)
    assert ranks.local_target(Target("cpu", None, "cpu")) == Target("cpu", None, "cpu")
    with pytest.raises(OptionError, match="pass `device` cuda"):
        ranks.local_target(Target("cuda", "gpu 1", "cuda:1", 1))
    _fake_gpus(monkeypatch, 1)  # a launcher that shows each rank one GPU
    with pytest.raises(OptionError, match="sees 1 CUDA device"):
        ranks.local_target(cuda)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert ranks.local_target(cuda) is cuda  # alone: the device the user typed


def test_nccl_group_is_bound_to_the_ranks_gpu(monkeypatch):
    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set_device", index)))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kwargs: calls.append((backend, kwargs.get("device_id"))))
    ranks.init_ranks(cuda=True)
    assert calls == [("set_device", 1), ("nccl", torch.device("cuda", 1))]


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return x


def _mixed_precision_probe_main(rank: int, port: int, out_dir: str) -> None:
    _join(rank, port)
    seen = {"forward": set(), "reduce": set(), "sharded": set()}
    reduce_scatter = dist.reduce_scatter_single  # FSDP2's gradient reduce-scatter (DefaultReduceScatter)

    def recording_reduce_scatter(output, input, *args, **kwargs):
        seen["reduce"].add(str(input.dtype))
        return reduce_scatter(output, input, *args, **kwargs)

    dist.reduce_scatter_single = recording_reduce_scatter

    def build():
        model = _Blocks()
        model.blocks[0].register_forward_pre_hook(lambda m, args: seen["forward"].add(str(m.weight.dtype)))
        return model

    def loss_fn(model, x):
        seen["sharded"].update(str(p.dtype) for p in model.parameters())
        return model(x).float().pow(2).mean()

    workload = Workload(name="blocks", build_model=build, make_batch=lambda b, device: torch.randn(b, 8, device=device),
                        loss_fn=loss_fn, tokens_per_sample=None)
    result = find_max_batch(workload, target=parse_target("cpu"), policy="binsearch", largest=2, strategy="fsdp",
                            options=StepOptions(precision="bf16-mixed", optimizer="sgd"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"strategy": result.strategy, **{k: sorted(v) for k, v in seen.items()}}, f)
    _leave()


@pytest.mark.slow
def test_probes_fsdp_gathers_bf16_parameters_and_reduces_in_fp32(tmp_path):
    """probe --strategy fsdp at bf16-mixed wraps with the mixed-precision policy plan traces
    (batchfit.distributed): the blocks run on bf16 copies of the fp32 shards, gradients are
    reduce-scattered in fp32. Without the policy FSDP2 gathers and reduces the fp32 shards."""
    spawn_profiled_gloo(_mixed_precision_probe_main, lambda port: (port, str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["strategy"] == "fsdp"
        assert got["sharded"] == ["torch.float32"]  # the parameters the optimizer steps stay fp32
        assert got["forward"] == ["torch.bfloat16"]  # what a block computes with: the gathered bf16 copy
        assert got["reduce"] == ["torch.float32"]
