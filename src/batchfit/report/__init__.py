"""Rendering results: pure functions from a result to Markdown text and PNG files."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from batchfit.report.bench_markdown import bench_markdown
from batchfit.report.markdown import estimate_markdown
from batchfit.report.probe_markdown import probe_markdown
from batchfit.report.write import StagedFiles, staged_files


def write_report(out_dir: Path, json_name: str, data: dict, markdown: Callable[[], str],
                 plot: Callable[[Path], None] | None, plot_name: str = "memory.png",
                 files: StagedFiles | None = None) -> dict[str, Path]:
    """Write report.md, the plot (when there is one) and ``json_name`` into ``out_dir``, all
    or none (``report.write``); with ``files``, they join the caller's set (its other
    outputs, e.g. --json and --emit, are then renamed into place with them)."""
    if files is None:
        with staged_files() as files:
            return write_report(out_dir, json_name, data, markdown, plot, plot_name, files)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / json_name, "md": out_dir / "report.md"}
    files.text(paths["md"], markdown())
    if plot is not None:
        paths["png"] = files.write(out_dir / plot_name, plot)
    files.text(paths["json"], json.dumps(data, indent=2) + "\n")
    return paths


def write_estimate_report(result, out_dir: Path, files: StagedFiles | None = None,
                          trainer: dict | None = None) -> dict[str, Path]:
    """``trainer``: the ``--trainer`` section (``config/trainer.py``), added to the JSON and the report."""
    from batchfit.report.plots import memory_plot  # matplotlib: not for --help (report.write is used there)
    from batchfit.report.run_markdown import eval_markdown, lengths_plot, rl_markdown, run_markdown
    from batchfit.report.trainer_markdown import trainer_markdown

    if files is None:  # one set: the length histogram joins the others
        with staged_files() as files:
            return write_estimate_report(result, out_dir, files, trainer)
    run = getattr(result, "run", None)  # --data --batching: the run's section and the length histogram
    data = result.to_json() if trainer is None else {**result.to_json(), "trainer": trainer}
    paths = write_report(out_dir, "estimate.json", data,
                         lambda: estimate_markdown(result) + rl_markdown(result)
                         + (run_markdown(result) if run is not None else "")
                         + (eval_markdown(result.eval_phase) if getattr(result, "eval_phase", None) else "")
                         + ("\n" + trainer_markdown(trainer) if trainer else ""),
                         lambda path: memory_plot(result, path), files=files)
    if run is not None:
        paths["lengths"] = files.write(out_dir / "lengths.png", lambda path: lengths_plot(run, path))
    return paths


def write_probe_report(result, out_dir: Path, files: StagedFiles | None = None,
                       trainer: dict | None = None) -> dict[str, Path]:
    from batchfit.report.plots import probe_plot
    from batchfit.report.trainer_markdown import trainer_markdown

    plot = (lambda path: probe_plot(result, path)) if result.target.device is not None else None
    data = result.to_json() if trainer is None else {**result.to_json(), "trainer": trainer}
    return write_report(out_dir, "probe.json", data,
                        lambda: probe_markdown(result) + ("\n" + trainer_markdown(trainer) if trainer else ""), plot,
                        files=files)


def write_bench_report(result, out_dir: Path, files: StagedFiles | None = None,
                       trainer: dict | None = None) -> dict[str, Path]:
    from batchfit.report.plots import throughput_plot
    from batchfit.report.trainer_markdown import trainer_markdown

    data = result.to_json() if trainer is None else {**result.to_json(), "trainer": trainer}
    return write_report(out_dir, "bench.json", data,
                        lambda: bench_markdown(result) + ("\n" + trainer_markdown(trainer) if trainer else ""),
                        lambda path: throughput_plot(result, path), plot_name="throughput.png", files=files)
