"""What a new user still tripped over (issue 35): paths every command checks the same way,
contradictions refused, no-ops said, the right cause named, failed starts that leave nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from batchfit.cli.app import app

runner = CliRunner()
TINY = ["gpt-tinystories-22m", "--seq-len", "16"]
README = Path(__file__).resolve().parents[1] / "README.md"  # a regular file


def _error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error:")]


def test_more_chunks_than_the_sequence_is_refused_not_traced(tmp_path, monkeypatch):
    """The issue's command as written: 100,000 chunks of a 256-token sequence hung at 'tracing batch size 1'."""
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["estimate", "gpt-tinystories-22m", "--gpu", "t4", "--loss", "chunked:100000"])
    assert result.exit_code == 2 and "use chunked:N with N at most 256" in _error_lines(result.output)[0], result.output
