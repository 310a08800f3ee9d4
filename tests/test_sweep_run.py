"""One run and one in-process sweep: exact accounting in the store, accumulation that gives
the full batch's gradient, and a failing run recorded while the sweep goes on.

Checked against torch's own code running for real (one SGD step on the full batch on the CPU) and
counts worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from batchfit import load_workload
from batchfit.runs.budget import micro_batch_for
from batchfit.runs.data import BatchSource, lm_format, tokenize
from batchfit.sweep import SweepConfig, plan_sweep, run_sweep
from batchfit.train.step import TrainingStep
from batchfit.workload import StepOptions
from tiny import write_corpus, write_tiny

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture
def tiny(tmp_path):
    spec = write_tiny(tmp_path)
    return spec, load_workload(spec), write_corpus(tmp_path / "stories.txt")


def config(tmp_path, spec, corpus, **changes) -> SweepConfig:
    base = dict(model=spec, batch_sizes=[2, 4, 8], tokens=512, data=str(corpus), tokenizer="bytes",
                lrs=[3e-3], eval_every="25%", eval_samples=8, store=tmp_path / "sweep.db", cache_dir=tmp_path / "cache",
                device="cpu")
    return SweepConfig(**{**base, **changes})


def test_micro_batch_is_the_largest_divisor_that_fits():
    assert micro_batch_for(8, None) == 8
    assert micro_batch_for(12, 5) == 4
    assert micro_batch_for(7, 3) == 1
    assert micro_batch_for(8, 0) == 0
    assert micro_batch_for(8, 100) == 8


def test_accumulated_micro_batches_give_the_full_batch_gradient(tiny, tmp_path):
    _, workload, corpus = tiny
    tokens = tokenize(str(corpus), tokenizer="bytes", vocab_size=320, cache_dir=tmp_path / "cache")
    source = BatchSource(workload, seed=0, tokens=tokens)
    cpu = torch.device("cpu")
    batch = source.train(0, 8, cpu)
    pieces = [(2, source.train(i * 2, 2, cpu)) for i in range(4)]
    assert torch.equal(torch.cat([p[1][0] for p in pieces]), batch[0])  # the same 8 samples
    grads, losses = [], []
    for micro_batches in ([(8, batch)], pieces):  # one step each, from the same initial model
        torch.manual_seed(0)
        trainer = TrainingStep(workload, StepOptions(optimizer="sgd"), cpu)
        before = [p.detach().clone() for p in trainer.model.parameters()]
        result = trainer.step(micro_batches, 8, lr=1.0)
        assert result.stepped
        losses.append(result.loss)
        # SGD at lr 1 moves each parameter by minus its gradient
        grads.append([b - p.detach() for b, p in zip(before, trainer.model.parameters())])
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_every_run_trains_on_exactly_the_budget(tiny, tmp_path):
    spec, workload, corpus = tiny
    result = run_sweep(plan_sweep(config(tmp_path, spec, corpus), workload))
    # 512 tokens / (b x 16) steps: 16 at batch 2, 8 at batch 4, 4 at batch 8
    rows = {r["batch_size"]: r for r in result.runs}
    assert {b: r["steps"] for b, r in rows.items()} == {2: 16, 4: 8, 8: 4}
    for b, r in rows.items():
        assert r["status"] == "done"
        assert r["steps"] * b * 16 == r["tokens"] == 512
        assert r["samples"] == 32
        val = r["curve"]["val"]
        assert [p["tokens"] for p in val] == [0, 128, 256, 384, 512]  # evaluations every 25% of the budget
        assert val[-1]["loss"] == r["final_val_loss"]
        assert r["best_val_loss"] == min(p["loss"] for p in val)
        assert r["initial_val_loss"] == val[0]["loss"]
    # the same initial model for every run: the same initial validation loss
    assert len({r["initial_val_loss"] for r in rows.values()}) == 1
    data = result.to_json()
    for key in ("batch_size", "lr", "status", "steps", "tokens", "micro_batch", "accumulation_steps",
                "initial_val_loss", "final_train_loss", "final_val_loss", "best_val_loss", "seconds"):
        assert all(key in run for run in data["runs"])


def test_an_accumulated_run_matches_the_full_batch_run(tiny, tmp_path):
    spec, workload, corpus = tiny
    full = run_sweep(plan_sweep(config(tmp_path, spec, corpus, batch_sizes=[8]), workload))
    plan = plan_sweep(config(tmp_path, spec, corpus, batch_sizes=[8], store=tmp_path / "micro.db"), workload)
    plan.micro_batches = {8: 2}  # as if the estimator said 2 fit: 4 accumulated micro-batches
    micro = run_sweep(plan)
    a, b = full.runs[0], micro.runs[0]
    assert (a["micro_batch"], a["accumulation_steps"]) == (8, 1)
    assert (b["micro_batch"], b["accumulation_steps"]) == (2, 4)
    assert b["final_val_loss"] == pytest.approx(a["final_val_loss"], rel=1e-5)
    assert b["final_train_loss"] == pytest.approx(a["final_train_loss"], rel=1e-5)


def test_a_failing_run_is_recorded_and_the_sweep_goes_on(tmp_path):
    spec = write_tiny(tmp_path, "failing", fail_at=4)
    corpus = write_corpus(tmp_path / "stories.txt")
    result = run_sweep(plan_sweep(config(tmp_path, spec, corpus), load_workload(spec)))
    status = {r["batch_size"]: r["status"] for r in result.runs}
    assert status == {2: "done", 4: "error", 8: "done"}
    failed = next(r for r in result.runs if r["batch_size"] == 4)
    assert failed["error"].startswith("ValueError: this workload cannot train at batch size 4")
    assert "failing.py:" in failed["error"]  # the line that raised
    assert result.best_batch_size() in (2, 8)


def test_synthetic_batches_without_data_are_said_to_be_synthetic(tiny, tmp_path):
    spec, workload, _ = tiny
    result = run_sweep(plan_sweep(config(tmp_path, spec, None, data=None, batch_sizes=[4]), workload))
    assert result.data_kind == "synthetic"
    assert any("synthetic" in n for n in result.notes)
    assert result.runs[0]["steps"] == 8


def test_lm_format_reads_the_model():
    fmt = lm_format(load_workload("gpt-tinystories-22m", seq_len=32))
    assert (fmt.vocab_size, fmt.seq_len) == (10000, 32)
    x, y = fmt.to_batch(torch.arange(33).view(1, 33))
    assert x[0, 0] == 0 and y[0, 0] == 1 and x.shape == (1, 32)


def test_bpe_trained_on_the_train_split_and_cached(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    write_corpus(folder / "a.txt", lines=200)
    (folder / "b.jsonl").write_text('{"text": "Mia made a boat."}\n{"text": "Ben lost a cake."}\n')
    said = []
    first = tokenize(str(folder), tokenizer="bpe", vocab_size=300, cache_dir=tmp_path / "cache", progress=said.append)
    assert any("training a byte-level BPE with 300 tokens" in s for s in said)
    assert first.vocab_size <= 300 and first.tokenizer == "bpe-300"
    assert int(max(first.train.max(), first.val.max())) < first.vocab_size
    said.clear()
    again = tokenize(str(folder), tokenizer="bpe", vocab_size=300, cache_dir=tmp_path / "cache", progress=said.append)
    assert said == [f"tokens from the cache {tmp_path / 'cache' / first.key}"]
    assert (again.key, len(again.train), len(again.val)) == (first.key, len(first.train), len(first.val))
    assert len(first.val) < len(first.train) / 50  # 1% of the text is validation


def test_a_run_whose_loss_diverges_says_so_and_keeps_its_curve(tmp_path):
    """SGD at lr 1 without clipping on a regression whose targets grow with the inputs: the loss goes
    to inf in a few steps. SQLite stores a NaN or inf as NULL, which the curve refused (an
    IntegrityError): the run now stops with the loss it saw, keeping what was measured before."""
    from torch import nn

    from batchfit import Workload

    diverging = Workload(name="diverging", build_model=lambda: nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 1)),
                         make_batch=lambda b, device: torch.randn(b, 8, device=device),
                         loss_fn=lambda m, x: (m(x).squeeze(-1) - x.sum(-1)).pow(2).mean(),
                         build_optimizer=lambda params: torch.optim.SGD(params, lr=1.0))
    settings = SweepConfig(model="diverging", batch_sizes=[2], samples=40, lrs=[1.0], grad_clip=None, eval_every="5%",
                           eval_samples=4, store=tmp_path / "sweep.db", device="cpu")
    (run,) = run_sweep(plan_sweep(settings, diverging)).runs
    assert run["status"] == "error" and run["error"].startswith("NonFiniteLoss: the ")  # validation loss, here
    assert "loss is not finite (inf) at step" in run["error"] and "lower `lrs`" in run["error"]
    from batchfit.runs.store import Store

    with Store(tmp_path / "sweep.db") as store:
        kept = store.points(run["id"])
    assert 0 < run["steps_done"] < run["steps"] and run["seconds"] > 0
    assert kept and max(p["step"] for p in kept) == run["steps_done"]
    assert all(math.isfinite(p["loss"]) for p in kept)
