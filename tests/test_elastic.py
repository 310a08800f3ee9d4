"""ElasticStep: the same update as one full-batch step, however many OOMs cut the batch.

The OOMs are forced: a forward hook raises ``torch.OutOfMemoryError`` when a micro-batch holds
more samples than a limit, as a GPU would at some size. The model is float64 and the optimizer
plain SGD, so "the same parameters" is checked to 1e-12, not to a loose tolerance.

Checked against torch's own code running for real: one full-batch SGD step on real tensors, and
DDP / FSDP2 ranks over gloo.
"""

from __future__ import annotations

import collections
import datetime
import gc
import logging
import os
import weakref
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

from batchfit.errors import OptionError
from batchfit.integrations.elastic import ElasticStep, predict_micro_batch
from batchfit.integrations.elastic_split import batch_size, divide_global_batch, split_batch, take_samples
from cpu_truth import spawn_profiled_gloo
from tiny import load_example

SAMPLES = 60
LR = 0.1


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def make_batches(steps: int, samples: int = SAMPLES, seed: int = 1) -> list[tuple[torch.Tensor, ...]]:
    """(x, y, sample ids): the ids let a test count which samples reached the loss."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(samples, 4, generator=g, dtype=torch.float64),
             torch.randn(samples, 1, generator=g, dtype=torch.float64),
             torch.arange(s * samples, (s + 1) * samples)) for s in range(steps)]


def mse(model: nn.Module, batch) -> torch.Tensor:
    x, y, _ = batch
    return (model(x) - y).pow(2).mean()


def full_batch_params(batches, model: nn.Module | None = None) -> list[torch.Tensor]:
    """The reference: one plain step per batch on all its samples at once."""
    model = model or make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for batch in batches:
        mse(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


class ForcedOOM:
    """A forward pre-hook that runs out of memory above ``limit`` samples (or on chosen calls)."""

    def __init__(self, model: nn.Module, limit: int | None = None, on_calls: tuple[int, ...] = ()) -> None:
        self.limit, self.on_calls, self.calls = limit, on_calls, 0
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, module, args):
        self.calls += 1
        n = args[0].shape[0]
        if (self.limit is not None and n > self.limit) or self.calls in self.on_calls:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {n * 8} bytes (forced)")


class Recorder:
    """The loss function, noting the ids of every micro-batch whose forward ran."""

    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def __call__(self, model, batch):
        loss = mse(model, batch)
        self.seen.append(batch[2].tolist())
        return loss


def test_forced_ooms_shrink_and_the_parameters_are_the_full_batch_steps():
    batches = make_batches(3)
    model = make_model()
    ForcedOOM(model, limit=20)
    loss_fn = Recorder()
    step = ElasticStep(model, torch.optim.SGD(model.parameters(), lr=LR), loss_fn, micro_batch=32)
    infos = []
    for batch in batches:
        before = len(loss_fn.seen)
        infos.append(step(batch))
        used = collections.Counter(i for ids in loss_fn.seen[before:] for i in ids)
        assert used == collections.Counter(batch[2].tolist())  # each of the 60 samples exactly once
    # 32 ran out; halved to 16: 16 + 16 + 16 + 12 = 60
    assert [(i.micro_batch, i.accumulation_steps, i.oom_events, i.failed_micro_batches) for i in infos] == [
        (16, 4, 1, (32,)), (16, 4, 0, ()), (16, 4, 0, ())]
    assert step.micro_batch == 16
    expected = full_batch_params(batches)
    for got, want in zip(model.parameters(), expected):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=1e-12)
    # the loss it reports is the full batch's mean loss before the step
    reference = make_model()
    assert infos[0].loss == pytest.approx(mse(reference, batches[0]).item(), rel=1e-12)


def test_an_oom_midway_redoes_the_whole_batch_and_steps_once():
    """Micro-batch 1 of 16 ran (its gradient accumulated), micro-batch 2 ran out: the pass is
    dropped and redone at 8; the optimizer steps once, on each sample once."""
    batches = make_batches(2)
    model = make_model()
    oom = ForcedOOM(model, on_calls=(2,))
    loss_fn = Recorder()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    steps = []
    optimizer.register_step_post_hook(lambda *args: steps.append(1))
    step = ElasticStep(model, optimizer, loss_fn, micro_batch=16)
    info = step(batches[0])
    assert (info.micro_batch, info.accumulation_steps, info.oom_events) == (8, 8, 1)  # 7 x 8 + 4
    assert oom.calls == 2 + 8 and len(steps) == 1
    assert loss_fn.seen[0] == list(range(16))  # the dropped pass
    assert collections.Counter(i for ids in loss_fn.seen[1:] for i in ids) == collections.Counter(range(60))
    step(batches[1])
    for got, want in zip(model.parameters(), full_batch_params(batches)):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=1e-12)


def test_a_non_oom_error_propagates_unchanged_with_no_retry():
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    raised = ValueError("my data has a NaN label")
    calls = []

    def loss_fn(model, batch):
        calls.append(1)
        raise raised

    step = ElasticStep(model, torch.optim.SGD(model.parameters(), lr=LR), loss_fn, micro_batch=16)
    with pytest.raises(ValueError) as caught:
        step(make_batches(1)[0])
    assert caught.value is raised and len(calls) == 1 and step.micro_batch == 16
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_a_runtime_error_that_is_not_an_oom_is_not_retried():
    model = make_model()
    ForcedOOM(model)

    def loss_fn(model, batch):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)")

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        ElasticStep(model, torch.optim.SGD(model.parameters(), lr=LR), loss_fn, micro_batch=16)(make_batches(1)[0])


def test_nothing_from_the_failed_micro_batch_stays_alive():
    model = make_model()
    refs: list[weakref.ref] = []

    def record_and_fail(module, args, output):
        if args[0].shape[0] > 20:
            refs.extend([weakref.ref(args[0]), weakref.ref(output)])  # the micro-batch, an activation
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (forced)")

    model[0].register_forward_hook(record_and_fail)
    step = ElasticStep(model, torch.optim.SGD(model.parameters(), lr=LR), mse, micro_batch=32)
    gc.disable()  # prove it is ElasticStep's own cleanup (no exception kept, no cycle) that frees them
    try:
        info = step(make_batches(1)[0])
        assert info.oom_events == 1 and len(refs) == 2
        assert all(ref() is None for ref in refs)
    finally:
        gc.enable()


def test_the_smallest_micro_batch_running_out_is_an_oom_that_says_what_to_do():
    model = make_model()
    ForcedOOM(model, limit=0)
    step = ElasticStep(model, torch.optim.SGD(model.parameters(), lr=LR), mse, micro_batch=4)
    with pytest.raises(torch.OutOfMemoryError, match="even a micro-batch of 1 samples"):
        step(make_batches(1)[0])


def test_multiple_of_is_respected_when_shrinking():
    model = make_model()
    ForcedOOM(model, limit=20)
    step = ElasticStep(model, torch.optim.SGD(model.parameters(), lr=LR), mse, micro_batch=36, multiple_of=12)
    info = step(make_batches(1)[0])
    assert (info.micro_batch, info.failed_micro_batches) == (12, (36,))  # 36 // 2 = 18, down to 12


def test_grows_back_after_clean_steps_and_not_by_default():
    model = make_model()
    oom = ForcedOOM(model, limit=20)
    step = ElasticStep(model, torch.optim.SGD(model.parameters(), lr=LR), mse, micro_batch=32, grow_after=2)
    batches = make_batches(4)
    assert [step(b).micro_batch for b in batches[:3]] == [16, 16, 16]
    oom.limit = 40  # memory freed up
    info = step(batches[3])
    assert (info.grew_to, info.micro_batch, info.oom_events) == (32, 32, 0)
    fixed = ElasticStep(make_model(), torch.optim.SGD(make_model().parameters(), lr=LR), mse, micro_batch=8)
    assert [fixed(b).grew_to for b in batches] == [None] * 4


def test_predicted_shrink_is_the_line_through_the_measured_peaks():
    # peaks 1000 + 100 b bytes: under 0.9 x 4000 = 3600 the line allows (3600 - 1000) / 100 = 26
    peaks = {8: 1800, 16: 2600}
    assert predict_micro_batch(peaks, 4000, failed=64, target_util=0.9) == 26
    assert predict_micro_batch(peaks, 4000, failed=20, target_util=1.0) == 19  # never the size that failed
    assert predict_micro_batch({8: 1800}, 4000, failed=64) is None  # one size: no line, so halve


def test_without_a_micro_batch_it_is_estimated_for_the_named_gpu_or_says_which_it_assumed(caplog):
    model = make_model()
    with caplog.at_level(logging.INFO, logger="batchfit"):
        step = ElasticStep(model, torch.optim.SGD(model.parameters(), lr=LR), mse)
        info = step(make_batches(1)[0])
    assert info.micro_batch == 60 and info.oom_events == 0  # a 49-parameter MLP: the whole batch fits an H100
    if not torch.cuda.is_available():
        assert "no GPU here: tracing a virtual h100-80gb" in caplog.text
    named = ElasticStep(make_model(), torch.optim.SGD(make_model().parameters(), lr=LR), mse, gpu="t4-16gb")
    assert named(make_batches(1)[0]).micro_batch == 60


class Pair(NamedTuple):
    x: torch.Tensor
    names: list


def test_split_keeps_the_batch_structure_and_every_sample_once():
    batch = {"input_ids": torch.arange(10).view(5, 2), "mask": torch.ones(5, 2), "scale": torch.tensor(2.0),
             "pair": Pair(torch.arange(5), ["a", "b", "c", "d", "e"]), "tag": "train"}
    parts = split_batch(batch, 2)
    assert [batch_size(p) for p in parts] == [2, 2, 1]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts]), batch["input_ids"])
    assert [p["pair"].names for p in parts] == [["a", "b"], ["c", "d"], ["e"]]
    assert isinstance(parts[0]["pair"], Pair) and parts[2]["tag"] == "train" and parts[1]["scale"].item() == 2.0
    assert parts[0]["input_ids"].data_ptr() == batch["input_ids"].data_ptr()  # a view, no copy
    assert batch_size(take_samples(batch, 7)) == 7
    with pytest.raises(OptionError, match=r"batch\['b'\] has 3"):
        batch_size({"a": torch.zeros(4), "b": torch.zeros(3)})


def test_split_batch_encoding():
    transformers = pytest.importorskip("transformers")
    encoding = transformers.BatchEncoding({"input_ids": torch.arange(12).view(6, 2),
                                           "attention_mask": torch.ones(6, 2)})
    parts = split_batch(encoding, 4)
    assert [type(p) for p in parts] == [transformers.BatchEncoding] * 2
    assert [p["input_ids"].shape[0] for p in parts] == [4, 2]


def test_global_batch_is_micro_times_accumulation_times_ranks():
    assert divide_global_batch(512, 100) == (64, 8)
    assert divide_global_batch(512, 100, world_size=2) == (64, 4)
    assert divide_global_batch(512, 1000, world_size=4) == (128, 1)
    assert divide_global_batch(96, 50, multiple_of=16) == (48, 2)
    with pytest.raises(OptionError, match="multiple of 3"):
        divide_global_batch(512, 100, world_size=3)
    with pytest.raises(OptionError, match="multiple of 16"):
        divide_global_batch(100, 64, multiple_of=16)


# -- two ranks over gloo -------------------------------------------------------------------------


def _ddp_main(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    model = nn.parallel.DistributedDataParallel(make_model())
    # Only rank 1 runs out, once, in the forward of its last (gradient-syncing) micro-batch of 28.
    if rank == 1:
        ForcedOOM(model.module, on_calls=(2,))
    step = ElasticStep(model, torch.optim.SGD(model.parameters(), lr=LR), mse, micro_batch=32)
    infos = [step(batch) for batch in make_batches(2, seed=10 + rank)]
    torch.save({"infos": [(i.micro_batch, i.accumulation_steps, i.oom_events) for i in infos],
                "params": [p.detach().clone() for p in model.module.parameters()]},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def test_two_ddp_ranks_agree_when_only_one_runs_out(tmp_path):
    spawn_profiled_gloo(_ddp_main, lambda port: (port, str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    # both ranks redid the batch at 16 (16 + 16 + 16 + 12) and stayed there
    assert [r["infos"] for r in ranks] == [[(16, 4, 1), (16, 4, 0)]] * 2
    # DDP averages the ranks' mean-loss gradients: one step on both ranks' 120 samples at once
    both = [tuple(torch.cat([a, b]) for a, b in zip(b0, b1))
            for b0, b1 in zip(make_batches(2, seed=10), make_batches(2, seed=11))]
    expected = full_batch_params(both)
    for r in ranks:
        for got, want in zip(r["params"], expected):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_the_elastic_loop_example_runs_and_recovers_once():
    infos = load_example("elastic_loop").main(steps=3)
    assert [(i.micro_batch, i.accumulation_steps, i.oom_events) for i in infos] == [
        (16, 6, 1), (16, 6, 0), (16, 6, 0)]


def test_an_oom_at_the_smallest_micro_batch_leaves_the_gradients_clean():
    model = make_model()
    ForcedOOM(model, limit=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with pytest.raises(torch.OutOfMemoryError, match="bf16-mixed"):
        ElasticStep(model, optimizer, mse, micro_batch=2)(make_batches(1)[0])
    assert all(p.grad is None for p in model.parameters())


def test_a_step_the_grad_scaler_skips_is_not_an_oom():
    """fp16 autocast, Linear(4, 1) at weight 0.5 on ones, loss mean(y) x 2**10, micro-batches
    of 16 (32 runs out once). Each micro-batch's fp16 weight gradient is 2**8 x scale: inf until
    the scale has halved from 2**16 to 2**7, so the GradScaler skips 9 steps. Those are neither
    OOMs nor shrinks; the 10th steps by lr x 2**10 (the whole batch's gradient)."""
    model = nn.Linear(4, 1, bias=False)
    nn.init.constant_(model.weight, 0.5)
    ForcedOOM(model, limit=16)

    def fp16_loss(model, x):
        with torch.autocast("cpu", dtype=torch.float16):
            y = model(x)
        return y.float().mean() * 2.0**10

    step = ElasticStep(model, torch.optim.SGD(model.parameters(), lr=2.0**-20), fp16_loss, micro_batch=32,
                       scaler=torch.amp.GradScaler("cpu"))
    infos = [step(torch.ones(64, 4)) for _ in range(10)]
    assert [i.scaler_skipped for i in infos] == [True] * 9 + [False]
    assert [i.oom_events for i in infos] == [1] + [0] * 9
    assert {i.micro_batch for i in infos} == {16} and step.micro_batch == 16
    assert model.weight.detach().tolist() == [[0.5 - 2.0**-10] * 4]



def _fsdp_main(rank: int, port: int, out_dir: str, oom_call: int) -> None:
    from torch.distributed.fsdp import fully_shard

    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    model = make_model()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    calls = collections.Counter()

    def loss_fn(m, batch):  # rank 1 runs out once, in the loss of micro-batch ``oom_call``
        loss = mse(m, batch)
        calls["loss"] += 1
        if rank == 1 and calls["loss"] == oom_call:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 byte (forced)")
        return loss

    step = ElasticStep(model, torch.optim.SGD(model.parameters(), lr=LR), loss_fn, micro_batch=32)
    outcome = [(i.micro_batch, i.accumulation_steps, i.oom_events)
               for i in (step(batch) for batch in make_batches(2, seed=10 + rank))]
    params = [p.full_tensor().detach().clone() for p in model.parameters()]
    torch.save({"outcome": outcome, "params": params}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_fsdp2_ranks_agree_when_only_one_runs_out(tmp_path):
    both = [tuple(torch.cat([a, b]) for a, b in zip(b0, b1))
            for b0, b1 in zip(make_batches(2, seed=10), make_batches(2, seed=11))]
    expected = full_batch_params(both)  # FSDP2 reduce-scatters the mean: one step on 120 samples
    # rank 1 runs out in the loss of its first micro-batch (before any backward), then of its
    # last (after one backward accumulated unsynced gradients that must not count twice)
    for oom_call in (1, 2):
        spawn_profiled_gloo(_fsdp_main, lambda port: (port, str(tmp_path), oom_call), nprocs=2)
        for r in (0, 1):
            run = torch.load(tmp_path / f"rank{r}.pt")
            assert run["outcome"] == [(16, 4, 1), (16, 4, 0)], oom_call
            for got, want in zip(run["params"], expected):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
