"""docs/accuracy.md is generated from benchmarks/results/ and matches it; the ledger's arithmetic
is checked on a results folder written here by hand."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _accuracy():
    spec = importlib.util.spec_from_file_location("accuracy", ROOT / "benchmarks" / "accuracy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_doc_matches_the_results_files():
    accuracy = _accuracy()
    assert (ROOT / "docs" / "accuracy.md").read_text() == accuracy.render(accuracy.latest_results()), \
        "docs/accuracy.md is stale: run python benchmarks/accuracy.py"


def test_the_ledger_by_hand(tmp_path):
    accuracy = _accuracy()
    rows = [{"recipe": "a", "traced_bytes": 99, "cpu_truth_bytes": 100},   # -1%: far below
            {"recipe": "b", "traced_bytes": 102, "cpu_truth_bytes": 100},  # +2%
            {"recipe": "c", "traced_bytes": 100, "cpu_truth_bytes": 100}]  # 0%
    (tmp_path / "x-2026-01-02.json").write_text(json.dumps({"command": "python x.py", "rows": rows}))
    (tmp_path / "x-2026-01-01.json").write_text(json.dumps({"rows": [{"traced_bytes": 1, "gloo_bytes": 2}]}))
    (tmp_path / "x-before-fix-2026-01-03.json").write_text(json.dumps({"rows": rows[:1]}))
    files = accuracy.latest_results(tmp_path)
    assert [f.name for f in files] == ["x-2026-01-02.json"]  # the newest of its name; "before" left out
    [row] = accuracy.ledger_rows(files)
    assert (row["rows"], row["min"], row["median"], row["max"]) == (3, -0.01, 0.0, 0.02)
    assert (row["below"], row["far_below"], row["worst_low"]["label"]) == (1 / 3, 1, "recipe a")
    assert "**3 checks in 1 files; 1 (33%) below parity, 1 (33%) more than 0.5% below.**" in accuracy.render(files)
