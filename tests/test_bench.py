"""bench on CPU: timed CPU steps, traced memory and reserved memory, phases, leaks, tiers, report."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from batchfit.bench.engine import BenchRow, bench, breakpoints, leak_check, tiers
from batchfit.cli.app import app
from batchfit.errors import OptionError
from batchfit.specs import load_workload
from batchfit.targets import parse_target
from batchfit.workload import StepOptions, Workload

GiB = 2**30


def test_virtual_bench_traces_memory_reserved_and_flops():
    result = bench(load_workload("gpt-tinystories-22m", seq_len=32), target=parse_target("virtual:t4-16gb"),
                   batch_sizes=[4, 8])
    small, large = result.rows
    assert small.source == "traced" and small.step_time_s is None  # nothing timed, nothing invented
    assert small.peak_reserved_bytes >= small.peak_allocated_bytes
    # FLOPs are linear in the batch at a fixed sequence length
    assert large.flops_per_step == pytest.approx(2 * small.flops_per_step, rel=0.01)
    keys = {"batch_size", "step_time_s", "samples_per_s", "tokens_per_s", "flops_per_step", "mfu",
            "peak_allocated_bytes", "peak_reserved_bytes", "source"}
    assert keys <= set(result.to_json()["rows"][0])


def test_flops_of_a_linear_layer_by_hand():
    work = Workload(name="linear", build_model=lambda: nn.Linear(256, 512, bias=False),
                    make_batch=lambda b, device: torch.randn(b, 256, device=device),
                    loss_fn=lambda model, x: model(x).sum())
    row = bench(work, target=parse_target("virtual:t4-16gb"), batch_sizes=[32]).rows[0]
    # forward 2*B*in*out; backward: only the weight gradient (x does not need one): 2*B*in*out
    assert row.flops_per_step == 2 * (2 * 32 * 256 * 512)


def test_cpu_bench_times_real_steps():
    result = bench(load_workload("gpt-tinystories-22m", seq_len=32), target=parse_target("cpu"), batch_sizes=[2],
                   steps=2, warmup=1)
    row = result.rows[0]
    assert row.source == "cpu time, traced memory" and row.step_time_min_s <= row.step_time_s <= row.step_time_max_s
    assert row.tokens_per_s == pytest.approx(2 * 32 / row.step_time_s)
    assert {"forward", "backward", "optimizer"} <= set(row.phase_time_s)


def test_cpu_bench_fills_traced_memory_and_flops(mlp):
    """On --device cpu the memory columns are the CPU step's traced peak (no allocator, so no
    reserved figure) and FLOPs come from the traced step: both worked out by hand."""
    row = bench(mlp, target=parse_target("cpu"), batch_sizes=[8], steps=1, warmup=0).rows[0]
    # Linear(1024, 4096) -> ReLU -> Linear(4096, 1024): forward 2 x 2*B*1024*4096; backward:
    # both weight gradients (2 x 2*B*1024*4096) and the hidden activation's (2*B*4096*1024);
    # the input needs no gradient.
    assert row.flops_per_step == 10 * 8 * 1024 * 4096
    params = 1024 * 4096 * 2 + 4096 + 1024
    # peak in the optimizer step of fp32 AdamW (CPU: per-parameter loop, no 512 B rounding):
    # parameters, gradients and two moments, at least
    assert row.peak_allocated_bytes >= 4 * params * 4
    assert row.peak_reserved_bytes is None


def test_throughput_counts_every_micro_batch(mlp):
    """A step of N accumulated micro-batches processes N x batch samples (issue: N times too low)."""
    row = bench(mlp, target=parse_target("cpu"), batch_sizes=[4], steps=2, warmup=0,
                options=StepOptions(accumulation_steps=3)).rows[0]
    assert row.samples_per_s == pytest.approx(4 * 3 / row.step_time_s)
    assert row.flops_per_step == 3 * 10 * 4 * 1024 * 4096


def test_generation_phase_and_group_size():
    grpo = load_workload("grpo-gpt2-124m", seq_len=4)  # 4 new tokens keep the test quick
    row = bench(grpo, target=parse_target("virtual:a100-40gb"), batch_sizes=[8]).rows[0]
    assert row.status == "ok" and "generate" in row.phase_peak_bytes
    with pytest.raises(OptionError, match="group size 8"):
        bench(grpo, target=parse_target("virtual:a100-40gb"), batch_sizes=[12])


def leaky(keep: bool) -> Workload:
    kept = []

    def loss_fn(model, x):
        loss = model(x).pow(2).mean()
        if keep:
            kept.append(loss)  # the classic leak: summing losses as tensors, not .item()
        return loss

    return Workload(name="leaky" if keep else "tidy", build_model=lambda: nn.Linear(64, 64),
                    make_batch=lambda b, device: torch.randn(b, 64, device=device), loss_fn=loss_fn)


@pytest.mark.parametrize("keep", [True, False])
def test_leak_verdicts_both_ways(keep):
    leak = leak_check(leaky(keep), StepOptions(), parse_target("virtual:t4-16gb"), 8, steps=8)
    assert leak.leaking is keep
    if keep:
        assert leak.bytes_per_step == pytest.approx(512)  # one loss scalar, one 512-byte block a step
        assert leak.where[0]["phase"] == "forward"
    else:
        assert leak.bytes_per_step == 0


def row(b: int, allocated: float, reserved: float | None = None, phase: str = "backward") -> BenchRow:
    return BenchRow(b, "ok", "traced", peak_allocated_bytes=int(allocated * GiB),
                    peak_reserved_bytes=int(reserved * GiB) if reserved else None,
                    phase_peak_bytes={phase: int(allocated * GiB)})


def test_tiers_pick_the_largest_benched_batch_under_each_line():
    rows = [row(8, 2, 3), row(16, 4, 5), row(32, 8, 9), row(64, 16, 17)]
    picked = {t.name: t.batch_size for t in tiers(rows, capacity=int(18 * GiB))}
    # reserved 17 GiB <= 0.95 x 18 = 17.1; 9 <= 0.85 x 18 = 15.3 and 9 <= 0.70 x 18 = 12.6
    assert picked == {"maximum": 64, "aggressive": 64, "default": 32, "conservative": 32}
    assert tiers(rows, capacity=int(2.5 * GiB)) == []  # even batch 8 reserves 3 GiB


def test_breakpoint_where_memory_per_sample_jumps():
    rows = [row(8, 2, phase="optimizer"), row(16, 2.1, phase="optimizer"), row(32, 2.3, phase="optimizer"),
            row(48, 6, phase="generate"), row(64, 10, phase="generate")]
    found = breakpoints(rows)
    assert found and found[0]["at"] == 32 and found[0]["phase_after"] == "generate"


def test_bench_cli_writes_the_report(tmp_path):
    result = CliRunner().invoke(app, ["bench", "gpt-tinystories-22m", "--seq-len", "32", "--device", "virtual:t4-16gb",
                                      "--batch-sizes", "2,4", "--leak-check", "--steps", "4", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert {p.name for p in tmp_path.iterdir()} == {"report.md", "throughput.png", "bench.json"}
    data = json.loads((tmp_path / "bench.json").read_text())
    assert set(data["leak"]) >= {"bytes_per_step", "leaking"} and data["tiers"]
    assert "## Tiers" in (tmp_path / "report.md").read_text()
    # a traced bench leaves step s, tokens/s and MFU empty ('—'), and says why and what fills them
    said = " ".join(result.output.split())
    assert "step s, tokens/s, MFU: measured only, and nothing ran on a GPU here" in said and "--device cuda" in said
