"""Seed 004's model in the zoo (issue 19, item 20: the README had no command for it)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from batchfit.cli.app import app
from batchfit.specs import load_workload
from batchfit.zoo import ZOO
from batchfit.zoo.enoki import enoki

README = Path(__file__).resolve().parents[1] / "README.md"


def by_hand(heads: int) -> int:
    """d = 64 h, 3h/4 blocks of attention (4 d^2, no bias), SwiGLU (3 d d_ff) and two RMSNorms
    (2 d); untied embedding and head (2 x 50,257 d); a final norm (d)."""
    d = 64 * heads
    d_ff = round(8 * d / 3 / 64) * 64
    return 2 * 50257 * d + 3 * heads // 4 * (4 * d * d + 3 * d * d_ff + 2 * d) + d


@pytest.mark.parametrize("heads,seed_says", [(28, "0.99B"), (48, "4.39B")])
def test_parameters_are_seed_004s(heads, seed_says):
    with torch.device("meta"):
        model = load_workload(f"enoki-{heads}h").build_model()
    params = sum(p.numel() for p in model.parameters())
    assert params == by_hand(heads)
    assert f"{params / 1e9:.2f}B" == seed_says
    assert by_hand(28) == 991_845_120  # benchmarks/seed004.py's figure


def test_the_readme_command_plans_the_model_at_tiny_size(tmp_path, monkeypatch):
    """The README's seed-004 command as written, run by the real tracer on the same model
    built at 4 heads and 16 tokens (d 256, 3 blocks) instead of 28 heads and 2048."""
    text = README.read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if re.match(r"\s*batchfit plan enoki-", line))
    argv = shlex.split(line)[1:]
    assert argv[:2] == ["plan", "enoki-28h"]
    monkeypatch.setitem(ZOO, "enoki-28h", lambda seq_len=None: enoki(4, seq_len=16))
    result = CliRunner().invoke(app, [*argv, "--max-batch", "8", "--processes", "1", "--out", str(tmp_path),
                                      "--json", "-"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [s["strategy"] for s in data["strategies"]] == ["fsdp", "fsdp+tp4"]
    assert data["params"] == by_hand(4)
    # global batch 512 over FSDP's 4 data-parallel ranks at the capped micro-batch 8: 16 accumulation
    # steps; FSDP+TP4 has one data-parallel rank: 64
    assert [(s["micro_batch"], s["accumulation_steps"]) for s in data["strategies"]] == [(8, 16), (8, 64)]
