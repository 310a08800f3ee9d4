"""estimate --global-batch N: the largest micro-batch under the target that divides N, with
N / micro-batch accumulation steps, each candidate traced with its own accumulation (plan's
rule, ``search.choose_micro``); in the terminal, report.md and the JSON.

Checked against batchfit's own traces at each candidate (checks the rule, not the fidelity to a GPU)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from batchfit.cli.app import app


def test_global_batch_is_split_with_traced_accumulation(tmp_path):
    out = tmp_path / "report"
    result = CliRunner().invoke(app, ["estimate", "gpt-tinystories-22m", "--seq-len", "16", "--gpu-memory", "1.1GiB",
                                      "--global-batch", "64", "--limit", "allocated",
                                      "--json", str(tmp_path / "e.json"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "e.json").read_text())
    micro, steps = data["micro_batch"], data["accumulation_steps"]
    assert data["global_batch"] == 64 and micro * steps == 64
    # 32 fits under the target alone (the answer at 90% is above it), but not accumulating: the
    # first micro-batch's gradients stay alive through the second's forward; 16 x 4 does
    assert data["max_batch_size_at_target"] >= 32
    assert (micro, steps) == (16, 4)
    assert data["split"]["peak_bytes"] <= data["target_bytes"] and not data["split"]["above_target"]
    assert "global batch 64 = micro-batch 16 x 4 accumulation steps" in result.output
    assert "micro-batch 16 x 4 accumulation steps" in (out / "report.md").read_text()
