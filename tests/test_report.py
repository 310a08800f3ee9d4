"""Reports say what is true: titles, words, pieces of the curve, plots without pyplot."""

from __future__ import annotations

import subprocess
import sys

import pytest

from batchfit import StepOptions, estimate, get_device, load_workload
from batchfit.bench.engine import bench
from batchfit.probe.find import find_max_batch
from batchfit.report import write_bench_report, write_estimate_report, write_probe_report
from batchfit.report.bench_markdown import bench_markdown
from batchfit.report.markdown import estimate_markdown
from batchfit.report.probe_markdown import probe_markdown
from batchfit.targets import parse_target


def tiny(seq_len: int = 16):
    return load_workload("gpt-tinystories-22m", seq_len=seq_len)


def test_reports_leave_the_matplotlib_backend_and_pyplot_alone(tmp_path):
    """`import batchfit` used to switch a notebook to Agg for the whole process."""
    code = f"""
import sys, matplotlib
matplotlib.use("svg")
from batchfit import estimate, get_device, load_workload
from batchfit.report import write_estimate_report
r = estimate(load_workload("gpt-tinystories-22m", seq_len=8), device=get_device("t4-16gb"), max_batch=4,
             limit="allocated")
write_estimate_report(r, __import__("pathlib").Path(r"{tmp_path}"))
assert matplotlib.get_backend() == "svg", matplotlib.get_backend()
assert "matplotlib.pyplot" not in sys.modules
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]
    assert (tmp_path / "memory.png").read_bytes()[:4] == b"\x89PNG"


@pytest.fixture(scope="module")
def fp16_estimate():
    return estimate(tiny(), device=get_device("t4-16gb"), options=StepOptions(precision="fp16-mixed"),
                    batch_sizes=[1, 2, 512], limit="allocated")


def test_titles_name_the_runs_precision(fp16_estimate):
    text = estimate_markdown(fp16_estimate)
    assert text.splitlines()[0] == "# Batch size estimate: gpt-tinystories-22m on NVIDIA Tesla T4, fp16-mixed"


def test_the_curve_is_reported_as_its_pieces(fp16_estimate):
    """At small batches the optimizer step's flat peak dominates, at large ones backward's."""
    text = estimate_markdown(fp16_estimate)
    assert "Fitted: peak =" not in text
    r = fp16_estimate
    pieces = r.curve.pieces(max(r.max_batch_size, r.points[-1].batch_size))  # the range the report covers
    assert len(pieces) >= 2 and pieces[0]["bytes_per_sample"] < pieces[-1]["bytes_per_sample"]
    for piece in pieces:
        assert f"| {piece['from_batch']}–{piece['to_batch']} | {piece['phase']} |" in text


def test_plots_have_whole_batch_sizes(fp16_estimate, tmp_path):
    from matplotlib.figure import Figure

    saved = {}
    original = Figure.savefig

    def keep(self, path, *args, **kwargs):
        saved["figure"] = self
        return original(self, path, *args, **kwargs)

    Figure.savefig = keep
    try:
        write_estimate_report(fp16_estimate, tmp_path)
    finally:
        Figure.savefig = original
    for ax in saved["figure"].axes:
        assert all(float(tick).is_integer() for tick in ax.get_xticks())


def test_probe_report_says_capped_and_traced(tmp_path):
    result = find_max_batch(tiny(), target=parse_target("virtual:t4-16gb"), largest=8, policy="binsearch")
    text = probe_markdown(result)
    assert "capped: the largest size allowed, --max" in text and "exact" not in text.split("## Configuration")[0]
    assert "traced peaks (virtual device)" in text and "measured peaks" not in text
    write_probe_report(result, tmp_path)


def test_bench_on_a_virtual_device_has_no_empty_panel_and_names_missing_tiers(tmp_path):
    from matplotlib.figure import Figure

    result = bench(tiny(), target=parse_target("virtual:t4-16gb"), batch_sizes=[2])
    text = bench_markdown(result)
    assert "gpt-tinystories-22m" in text
    saved = {}
    original = Figure.savefig
    Figure.savefig = lambda self, path, *a, **k: (saved.setdefault("figure", self), original(self, path, *a, **k))
    try:
        write_bench_report(result, tmp_path)
    finally:
        Figure.savefig = original
    assert len(saved["figure"].axes) == 1  # memory only: nothing was timed
    big = bench(tiny(), target=parse_target("virtual:t4-16gb"), batch_sizes=[2])
    big.tiers = [t for t in big.tiers if t.name == "maximum"]
    assert "no benched size fits under 70% of usable memory" in bench_markdown(big)


def test_an_interrupted_report_leaves_the_previous_one_whole(fp16_estimate, tmp_path, monkeypatch):
    """Item 15: Ctrl-C while the PNG was written left the new estimate.json beside the previous
    report.md and a truncated PNG. Files are written to temporary names and renamed together."""
    write_estimate_report(fp16_estimate, tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def interrupted(result, path):
        path.write_bytes(b"\x89PNG\r\n")  # a few bytes, then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr("batchfit.report.plots.memory_plot", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_estimate_report(fp16_estimate, tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_how_an_rl_steps_generation_loop_was_had_reads_the_right_way_round():
    """The warm-up step's loop is traced and the measured step's written from its record (docs/tracing/generation.md),
    not the other way round; the note points at that page."""
    from types import SimpleNamespace

    from batchfit.report.markdown import _written_note

    written = {"traced": [8, 16, 96], "repeated": [8, 16, 96], "line": [64, 88], "checked_at": [96]}
    note = _written_note(SimpleNamespace(written_generation=written))
    assert ("the generation loop traced at batch sizes 8, 16, 96, each measured step's loop written again from its "
            "warm-up step's record") in note
    assert "at 64, 88 written from the line" in note and note.endswith("(docs/tracing/generation.md)")
    assert _written_note(SimpleNamespace(written_generation=None)) == ""


def test_an_empty_reserved_cell_is_explained_only_where_one_is_shown():
    from types import SimpleNamespace

    from batchfit.report.markdown import _unreplayed_note

    point = lambda reserved, oom=None: SimpleNamespace(peak_reserved_bytes=reserved, reserved_oom=oom)  # noqa: E731
    seed_003 = SimpleNamespace(limit="reserved", points=[point(None), point(2**30), point(None, "CUDA out of memory")])
    assert "not replayed through the allocator model" in _unreplayed_note(seed_003)[1]
    every_size_replayed = SimpleNamespace(limit="reserved", points=[point(2**30), point(None, "CUDA out of memory")])
    assert _unreplayed_note(every_size_replayed) == []
    allocated = _unreplayed_note(SimpleNamespace(limit="allocated", points=[point(None)]))
    assert "(what had to fit is allocated memory)" in allocated[1]
