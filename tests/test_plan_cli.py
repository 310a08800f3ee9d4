"""`batchfit plan` as a user runs it, on the stand-in tracer: report, JSON, emitted configs,
bad input as one line and exit code 2.

On an H100 (81,047 MiB usable, 64 MiB cuBLAS workspace), 4 GPUs, global batch 512, target 90%
(72,942 MiB), the stand-in gives (MiB): ddp 16384 + 1024 b + 64 -> max local 63, micro 32 x 4;
fsdp 4096 + 1024 b + 64 -> max local 75, micro 64 x 2.
"""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from batchfit.cli.app import app

runner = CliRunner()
MODEL = "gpt-tinystories-22m"  # the stand-in only reads its tokens per sample (256)


def run(*args: str):
    return runner.invoke(app, list(args))


def test_plan_writes_the_report_json_and_configs(standin, tmp_path):
    out = tmp_path / "report"
    result = run("plan", MODEL, "--gpu", "h100-80gb", "--gpus", "4", "--strategies", "ddp,fsdp", "--precision",
                 "bf16-mixed", "--global-batch", "512", "--tokens", "chinchilla", "--out", str(out),
                 "--json", str(tmp_path / "plan.json"), "--emit", str(tmp_path / "config.yaml"),
                 "--emit", f"accelerate:{tmp_path / 'accelerate.yaml'}")
    assert result.exit_code == 0, result.output
    assert {p.name for p in out.iterdir()} == {"report.md", "plan.png", "plan-ranking.png", "plan.json"}
    assert (out / "plan.png").read_bytes()[:4] == b"\x89PNG"
    data = json.loads((tmp_path / "plan.json").read_text())
    assert {"params", "tokens", "strategies", "recommended"} <= set(data)
    rows = {s["strategy"]: s for s in data["strategies"]}
    assert set(rows["fsdp"]) >= {"strategy", "gpus", "nodes", "dp", "tp", "points", "max_local_batch",
                                 "max_global_batch", "micro_batch", "accumulation_steps", "peak_bytes_at_micro",
                                 "step_time_s", "tokens_per_s", "days", "source"}
    assert set(rows["fsdp"]["points"][0]) >= {"local_batch", "peak_bytes", "breakdown"}
    assert [(rows[n]["max_local_batch"], rows[n]["micro_batch"], rows[n]["accumulation_steps"])
            for n in ("ddp", "fsdp")] == [(63, 32, 4), (75, 64, 2)]
    assert rows["fsdp"]["peak_bytes_at_micro"] == (4096 + 64 * 1024 + 64) * 2**20
    assert data["tokens"] == 20 * 10**9
    best = data["recommended"][0]
    config = yaml.safe_load((tmp_path / "config.yaml").read_text())["training"]["batch_config"]["h100_4gpu"]
    assert (config["batch_size"], config["gradient_accumulation_steps"], config["effective_batch_size"],
            config["world_size"], config["strategy"]) == (best["micro_batch"], best["accumulation_steps"], 512, 4,
                                                          best["strategy"])
    assert config["launch"].startswith("torchrun --standalone --nnodes 1 --nproc-per-node 4")
    accelerate = yaml.safe_load((tmp_path / "accelerate.yaml").read_text())
    assert accelerate["num_processes"] == 4 and accelerate["mixed_precision"] == "bf16"
    assert accelerate["gradient_accumulation_steps"] == best["accumulation_steps"]
    text = (out / "report.md").read_text()
    for heading in ("## Recommended configuration", "## Max batch by strategy", "## Time (computed)",
                    "## Peak memory per GPU by local batch (traced, rank 0)", "## Known limits"):
        assert heading in text
    assert "MFU: 0.40, assumed" in text and "NVLink 4, 900 GB/s bidirectional" in text


def test_a_table_by_gpu_count_as_seed_001_wrote(standin, tmp_path):
    result = run("plan", MODEL, "--gpu", "h100-80gb", "--gpus", "1,2,3,4", "--strategies", "ddp",
                 "--target-util", "0.8", "--out", str(tmp_path), "--emit", str(tmp_path / "config.yaml"),
                 "--json", "-")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [(r["gpus"], r["global_batch"]) for r in data["recommended"]] == [(g, 47 * g) for g in (1, 2, 3, 4)]
    entries = yaml.safe_load((tmp_path / "config.yaml").read_text())["training"]["batch_config"]
    assert list(entries) == ["h100_1gpu", "h100_2gpu", "h100_3gpu", "h100_4gpu"]
    assert entries["h100_3gpu"]["elastic_target_util"] == 0.8


BAD_INPUT = [
    (["--gpus", "0"], "every GPU count must be 1 or more"),
    (["--gpus", "8", "--global-batch", "100"], "use a multiple of 8, e.g. --global-batch 96"),
    (["--gpus", "4", "--tokens", "many"], "chinchilla"),
    (["--gpus", "4", "--mfu", "40"], "--mfu must be in (0, 1]"),
    (["--nodes", "2"], "needs --gpus-per-node"),
    (["--gpus", "4", "--emit", "nowhere/config.yaml"], "does not exist"),
    (["--gpus", "4", "--calibrate", "missing.json"], "cannot read it"),
    (["--gpus", "4", "--processes", "0"], "--processes must be 1 or more"),
]


@pytest.mark.parametrize("args,message", BAD_INPUT)
def test_bad_input_is_one_line_and_exit_code_2(standin, args, message):
    result = run("plan", MODEL, "--gpu", "h100-80gb", *args)
    assert result.exit_code == 2, result.output
    assert len([line for line in result.output.splitlines() if line.startswith("error:")]) == 1
    assert message in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("strategies,gpus", [("tp3", "4"), ("zero3", "4")])
def test_strategies_the_tracer_refuses_are_one_line(strategies, gpus):
    """With the real tracer's own parse_strategies (no stand-in)."""
    result = run("plan", MODEL, "--gpu", "h100-80gb", "--gpus", gpus, "--strategies", strategies)
    assert result.exit_code == 2, result.output
    assert len([line for line in result.output.splitlines() if line.startswith("error:")]) == 1
    assert strategies in result.output and "Traceback" not in result.output


def test_calibrate_takes_the_mfu_a_gpu_bench_measured(standin, tmp_path):
    bench = {"device": {"display_name": "NVIDIA H100 80GB HBM3"}, "options": {"precision": "bf16-mixed"},
             "rows": [{"batch_size": 4, "mfu": 0.3}, {"batch_size": 8, "mfu": 0.35}, {"batch_size": 16, "mfu": None}]}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    result = run("plan", MODEL, "--gpu", "h100-80gb", "--gpus", "2", "--strategies", "fsdp", "--precision",
                 "bf16-mixed", "--calibrate", str(tmp_path / "bench.json"), "--out", str(tmp_path), "--json", "-")
    assert result.exit_code == 0, result.output
    model = json.loads(result.stdout)["time_model"]
    assert model["mfu"] == 0.35
    assert "measured by batchfit bench on NVIDIA H100 80GB HBM3 at batch 8" in model["mfu_source"]
    cpu_bench = {"rows": [{"batch_size": 4, "mfu": None}]}
    (tmp_path / "cpu.json").write_text(json.dumps(cpu_bench))
    result = run("plan", MODEL, "--gpu", "h100-80gb", "--gpus", "2", "--calibrate", str(tmp_path / "cpu.json"))
    assert result.exit_code == 2 and "holds no measured MFU" in result.output


def test_the_real_tracer_end_to_end(tmp_path):
    """The real tracer through the engine, CLI and report."""
    result = run("plan", MODEL, "--seq-len", "16", "--gpu", "h100-80gb", "--gpus", "2", "--strategies", "ddp,fsdp",
                 "--max-batch", "8", "--global-batch", "8", "--out", str(tmp_path), "--json", "-")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    ddp, fsdp = data["strategies"]
    assert ddp["max_local_batch"] == fsdp["max_local_batch"] == 8  # the cap: a 22M model fits an H100
    assert (fsdp["micro_batch"], fsdp["accumulation_steps"]) == (4, 1)
    # FSDP holds half the parameters of DDP's rank (22,696,448 / 2 of an even split, give or take a row)
    assert abs(fsdp["params_per_rank"] - data["params"] / 2) < data["params"] / 100
    assert fsdp["time"]["communication_s"]["dp"] > 0 and ddp["time"]["communication_s"]["dp"] > 0


def test_an_emit_failure_writes_no_output(standin, tmp_path, monkeypatch):
    """Item 8: the report was written, then --emit failed and --json was never written. Now
    every output is written, or none (the previous run's files stay as they were)."""
    (tmp_path / "config.yaml").write_text("previous config\n")

    def half_written(kind, path, result):
        path.write_text("training:\n  batch_con")  # cut off mid-way, as by a full disk
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("batchfit.plan.emit.write_emit", half_written)
    result = run("plan", MODEL, "--gpu", "h100-80gb", "--gpus", "4", "--strategies", "fsdp", "--out",
                 str(tmp_path / "report"), "--json", str(tmp_path / "plan.json"), "--emit",
                 str(tmp_path / "config.yaml"))
    assert result.exit_code != 0
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["config.yaml", "report"]  # no JSON, no temporary
    assert (tmp_path / "config.yaml").read_text() == "previous config\n"
