"""Rendering results: pure functions from a result to Markdown text and PNG files."""

from __future__ import annotations

import json
from pathlib import Path

from batchfit.report.markdown import estimate_markdown
from batchfit.report.plots import memory_plot


def write_estimate_report(result, out_dir: Path) -> dict[str, Path]:
    """Write report.md, memory.png and estimate.json into ``out_dir``; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "estimate.json", "png": out_dir / "memory.png",
             "md": out_dir / "report.md"}
    paths["json"].write_text(json.dumps(result.to_json(), indent=2) + "\n")
    memory_plot(result, paths["png"])
    paths["md"].write_text(estimate_markdown(result, plot_name=paths["png"].name))
    return paths
