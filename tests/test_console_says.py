"""What the console says beside its figures: the sequence length they are at, an answer that is
--max-batch's cap rather than memory's limit, and help texts that match what the commands do."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from batchfit.cli.app import app
from tiny import TINY_LLAMA_FILE

runner = CliRunner()


def said(*args: str) -> str:
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return " ".join(result.output.replace("│", " ").split())  # help panels wrap inside box lines


def test_estimate_says_the_sequence_and_the_cap(tmp_path):
    # a 1-layer d-64 model at 32 tokens: a T4 holds thousands of samples, so --max-batch 4 stops the search
    (tmp_path / "tiny.py").write_text(TINY_LLAMA_FILE)
    out = said("estimate", f"{tmp_path / 'tiny.py'}:workload", "--gpu", "t4", "--max-batch", "4",
               "--limit", "allocated", "--out", str(tmp_path / "report"))
    assert "tiny-llama on NVIDIA Tesla T4, fp32, sequence 32 tokens (traced)" in out
    assert "max batch size 4" in out
    assert "capped: 4 is --max-batch's cap, not where memory runs out: larger sizes were not traced" in out


def test_plan_says_the_sequence_and_which_strategy_the_cap_stopped(standin, tmp_path):
    # the stand-in on an H100 fits 63 (ddp) and 75 (fsdp) samples per GPU: --max-batch 16 caps both
    out = said("plan", "gpt-tinystories-22m", "--gpu", "h100-80gb", "--gpus", "4", "--strategies", "ddp,fsdp",
               "--max-batch", "16", "--out", str(tmp_path))
    assert "fp32, sequence 256 tokens (memory traced, time computed)" in out
    assert "capped: max local ddp, fsdp: 16 is --max-batch's cap, not where memory runs out" in out


def test_a_plan_below_the_cap_says_nothing_of_it(standin, tmp_path):
    out = said("plan", "gpt-tinystories-22m", "--gpu", "h100-80gb", "--gpus", "4", "--strategies", "ddp",
               "--out", str(tmp_path))
    assert "capped" not in out


@pytest.mark.parametrize("command", ["recommend", "sweep", "noise"])
def test_the_help_says_a_language_model_needs_data_and_where_tokens_are_cached(command):
    out = said(command, "--help")
    assert "Needed by a language model (zoo, hf:)" in out and "Without it: the workload's batches" not in out
    assert "$BATCHFIT_CACHE/tokens, else ~/.cache/batchfit/tokens" in out
