"""`batchfit sweep` and `batchfit noise` as a user types them: reports and JSON keys; bad
input is one line, exit code 2, and the store is left as it was."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from batchfit.cli.app import app
from tiny import write_corpus, write_tiny

runner = CliRunner()


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture
def setup(tmp_path):
    return write_tiny(tmp_path), write_corpus(tmp_path / "stories.txt"), tmp_path


@pytest.fixture(scope="module")
def existing(tmp_path_factory):
    """A store that holds a finished sweep (batch 4), made once; each test gets a copy."""
    folder = tmp_path_factory.mktemp("existing")
    spec, corpus = write_tiny(folder), write_corpus(folder / "stories.txt")
    torch.set_num_threads(1)
    assert sweep(spec, corpus, folder, "--batch-sizes", "4").exit_code == 0
    return spec, corpus, folder


def sweep(spec, corpus, tmp_path, *extra, cache=None):
    args = ["sweep", spec, "--data", str(corpus), "--tokenizer", "bytes", "--batch-sizes", "2,4", "--tokens", "256",
            "--eval-samples", "4", "--store", str(tmp_path / "sweep.db"), "--cache-dir",
            str(cache or tmp_path / "cache"), "--device", "cpu", "--out", str(tmp_path / "report"), *extra]
    return runner.invoke(app, args)


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def test_sweep_writes_the_report_and_the_json(setup):
    spec, corpus, tmp_path = setup
    result = sweep(spec, corpus, tmp_path, "--lrs", "1e-3,3e-3", "--json", str(tmp_path / "s.json"))
    assert result.exit_code == 0, result.output
    assert {p.name for p in (tmp_path / "report").iterdir()} == {"report.md", "sweep.json", "loss_vs_batch.png",
                                                                 "curves.png"}
    data = json.loads((tmp_path / "s.json").read_text())
    assert len(data["runs"]) == 4  # 2 batch sizes x 2 learning rates
    for run in data["runs"]:
        assert {"batch_size", "lr", "status", "steps", "tokens", "micro_batch", "accumulation_steps",
                "initial_val_loss", "final_train_loss", "final_val_loss", "best_val_loss", "seconds"} <= set(run)
        assert run["tokens"] == 256 and run["steps"] * run["batch_size"] * 16 == 256
    assert data["best_batch_size"] in (2, 4)
    report = (tmp_path / "report" / "report.md").read_text()
    assert "| Batch Size | Status | Steps | Tokens | Training Time | Final Train Loss | Final Val Loss | " \
           "Best Val Loss | Learning Rate |" in report
    assert "Best for quality: batch size" in report
    assert (tmp_path / "report" / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_noise_json_keys(setup):
    spec, corpus, tmp_path = setup
    result = runner.invoke(app, ["noise", spec, "--data", str(corpus), "--tokenizer", "bytes", "--batch-sizes", "2,8",
                                 "--steps", "3", "--cache-dir", str(tmp_path / "cache"), "--device", "cpu",
                                 "--json", "-", "--out", str(tmp_path / "noise")])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert {"b_simple", "b_simple_interval", "measurements"} <= set(data)
    assert len(data["b_simple_interval"]) == 2 and len(data["measurements"]) == 3
    assert data["batch_sizes"] == [2, 8]


BAD = [
    (["sweep", "gpt-tinystories-22m", "--batch-sizes", "1,2", "--tokens", "1M"], "give --data"),
    (["--tokens", "0"], "--tokens must be 1 or more"),
    (["--batch-sizes", "2,64"], "batch size 64 is above the budget"),
    (["--tokens", "100"], "not a whole number of steps"),
    (["--executor", "slurm"], "unknown --executor 'slurm'"),
    (["--tokens", "512"], "holds a different sweep (it differs in tokens)"),
    (["--batch-sizes", "2"], "already holds this sweep: add --resume"),
    (["noise", "gpt-tinystories-22m", "--batch-sizes", "8,128"], "give --data"),
    (["noise", "SPEC", "--batch-sizes", "8,100"], "must be a multiple of the small one"),
]


@pytest.mark.parametrize("extra, message", BAD)
def test_bad_input_is_one_line_exit_2_and_the_store_is_untouched(existing, tmp_path, extra, message):
    spec, corpus, folder = existing
    store = tmp_path / "sweep.db"
    shutil.copy(folder / "sweep.db", store)
    before = digest(store)
    if extra[0] in ("sweep", "noise"):
        args = [a.replace("SPEC", spec) for a in extra] + ["--store", str(store)] * (extra[0] == "sweep")
        result = runner.invoke(app, args + ["--device", "cpu", "--cache-dir", str(folder / "cache")])
    else:
        result = sweep(spec, corpus, tmp_path, *extra, cache=folder / "cache")
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in result.output.replace("\n", " "), result.output
    assert "Traceback" not in result.output
    assert digest(store) == before


def test_a_sweep_where_every_run_failed_exits_1_and_prints_the_error(tmp_path):
    # The workload raises at batch size 2; validation runs in pieces of the smallest micro-batch (2),
    # so both batch sizes fail, before any training step.
    spec, corpus = write_tiny(tmp_path, fail_at=2), write_corpus(tmp_path / "stories.txt")
    result = sweep(spec, corpus, tmp_path, "--json", str(tmp_path / "s.json"))
    assert result.exit_code == 1, result.output
    output = result.output.replace("\n", " ")
    assert "error: no run finished: 2 of 2 failed; batch 2, lr 0.0003: error: ValueError: this workload cannot " \
           "train at batch size 2" in output
    assert "Traceback" not in result.output
    data = json.loads((tmp_path / "s.json").read_text())  # the report and the JSON are still written
    assert [r["status"] for r in data["runs"]] == ["error", "error"]
    assert (tmp_path / "report" / "report.md").exists()


def noise(spec, corpus, tmp_path, *extra):
    return runner.invoke(app, ["noise", spec, "--data", str(corpus), "--tokenizer", "bytes", "--batch-sizes", "2,8",
                               "--steps", "0", "--repeats", "2", "--cache-dir", str(tmp_path / "cache"),
                               "--out", str(tmp_path / "noise"), *extra])


def test_noise_takes_gpu_as_every_command_does(setup):
    # --gpu: the micro-batch of the small size must fit that GPU (traced); the gradients are real (CPU here).
    spec, corpus, tmp_path = setup
    result = noise(spec, corpus, tmp_path, "--gpu", "t4-16gb", "--json", str(tmp_path / "n.json"))
    assert result.exit_code == 0, result.output
    assert len(json.loads((tmp_path / "n.json").read_text())["measurements"]) == 2
    result = noise(spec, corpus, tmp_path, "--gpu-memory", "577MiB")  # 1 MiB after the CUDA context and cuBLAS
    assert result.exit_code == 2, result.output
    assert "error: not even one sample fits" in result.output and "Traceback" not in result.output


def test_noise_with_a_workload_that_raises_is_one_line(tmp_path):
    spec, corpus = write_tiny(tmp_path, fail_at=2), write_corpus(tmp_path / "stories.txt")
    result = noise(spec, corpus, tmp_path, "--device", "cpu")
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    output = result.output.replace("\n", " ")
    assert "error: tiny-gpt failed while measuring the noise scale at " in output
    assert "tiny_gpt.py:18: ValueError: this workload cannot train at batch size 2" in output
    assert "BATCHFIT_DEBUG=1" in output


@pytest.mark.parametrize("content, message", [
    (bytes(range(256)) * 64, "is not text (it holds NUL bytes"),
    (bytes(range(128, 256)) * 128, "is not UTF-8 text (16,384 invalid UTF-8 sequences in its first 16,384 bytes)"),
], ids=["nul-bytes", "not-utf8"])
def test_binary_data_is_refused_in_one_line(setup, content, message):
    spec, corpus, tmp_path = setup
    binary = tmp_path / "weights.bin"
    binary.write_bytes(content)
    result = sweep(spec, binary, tmp_path)
    assert result.exit_code == 2, result.output
    assert f"error: --data {binary} {message}" in result.output.replace("\n", " ")
    assert not (tmp_path / "sweep.db").exists()
