"""Output paths (issue 19, items 8, 14, 15): every --json, --out, --emit and --store is checked
to be *writable* before any work, with the right reason; outputs are written all or none.

Tests run as root, where a chmod 555 folder is still writable: "read-only" is tested with
/proc (nobody can create a file there) and with ``os.access`` mocked to say no.
"""

from __future__ import annotations

import importlib
import os

import pytest
from typer.testing import CliRunner

from batchfit.cli.app import app
from batchfit.report.write import staged_files

runner = CliRunner()
MODEL = ["gpt-tinystories-22m", "--seq-len", "16"]
DEVICE = {"estimate": ["--gpu", "t4-16gb"], "probe": ["--device", "virtual:t4-16gb"],
          "bench": ["--device", "virtual:t4-16gb"], "plan": ["--gpu", "t4-16gb", "--gpus", "2"],
          "sweep": ["--batch-sizes", "2,4", "--samples", "8"]}
ENGINES = [("batchfit.estimator.engine", "estimate"), ("batchfit.probe.find", "find_max_batch"),
           ("batchfit.bench.engine", "bench"), ("batchfit.plan.engine", "plan"),
           ("batchfit.sweep.engine", "plan_sweep"), ("batchfit.sweep.engine", "run_sweep")]


@pytest.fixture
def no_work(monkeypatch):
    """Fail loudly if any engine starts: a bad path must be refused before the work."""
    def boom(*args, **kwargs):
        raise AssertionError("the engine ran before the output paths were checked")

    for module, name in ENGINES:
        monkeypatch.setattr(importlib.import_module(module), name, boom)


def refused(command: str, *args: str) -> str:
    result = runner.invoke(app, [command, *MODEL, *DEVICE[command], *args])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    return errors[0]


@pytest.mark.parametrize("command", ["estimate", "probe", "bench", "plan", "sweep"])
def test_unwritable_outputs_are_refused_with_the_reason_before_any_work(command, no_work, tmp_path):
    a_file = tmp_path / "file.txt"
    a_file.write_text("mine")
    # under a file: it was "the folder does not exist" for --json, a traceback after the work for --out
    assert "'" + str(a_file) + "' is a file, not a folder" in refused(command, "--json", f"{a_file}/r.json")
    assert "is a file, not a folder" in refused(command, "--out", f"{a_file}/report", "--json", "-")
    assert f"--json {tmp_path} is a folder" in refused(command, "--json", str(tmp_path))
    # nobody can create a file in /proc, root included
    assert "read-only" in refused(command, "--json", "/proc/r.json")
    assert "read-only" in refused(command, "--out", "/proc/report")
    assert a_file.read_text() == "mine"


@pytest.mark.parametrize("command", ["estimate", "plan"])
def test_a_read_only_folder_is_refused(command, no_work, tmp_path, monkeypatch):
    """A chmod 555 folder, as a user who is not root sees it (os.access mocked to say no)."""
    read_only = tmp_path / "ro"
    read_only.mkdir()
    real_access = os.access
    monkeypatch.setattr("batchfit.cli.common.os.access",
                        lambda path, mode: (False if os.path.abspath(path) == str(read_only)
                                            else real_access(path, mode)))
    line = refused(command, "--json", str(read_only / "r.json"))
    assert f"cannot write in '{read_only}' (read-only" in line
    assert "read-only" in refused(command, "--out", str(read_only / "report"))


def test_emit_and_store_are_checked_like_json(no_work, tmp_path):
    a_file = tmp_path / "file.txt"
    a_file.write_text("mine")
    assert "is a file, not a folder" in refused("plan", "--emit", f"{a_file}/config.yaml")
    assert "is a file, not a folder" in refused("plan", "--emit", f"accelerate:{a_file}/fsdp.yaml")
    assert "read-only" in refused("plan", "--emit", "/proc/config.yaml")
    assert "is a folder" in refused("sweep", "--store", str(tmp_path))
    assert "is a file, not a folder" in refused("sweep", "--store", f"{a_file}/sweep.db")
    assert "read-only" in refused("sweep", "--store", "/proc/sweep.db")


def test_staged_files_are_all_or_none_and_json_last(tmp_path, monkeypatch):
    (tmp_path / "report.md").write_text("old report")
    (tmp_path / "estimate.json").write_text("old json")
    with pytest.raises(KeyboardInterrupt), staged_files() as files:
        files.text(tmp_path / "estimate.json", "new json")
        files.text(tmp_path / "report.md", "new report")
        raise KeyboardInterrupt  # Ctrl-C before the PNG was written
    assert (tmp_path / "report.md").read_text() == "old report"
    assert (tmp_path / "estimate.json").read_text() == "old json"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["estimate.json", "report.md"]  # no temporary left
    renamed = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (renamed.append(os.path.basename(b)), real_replace(a, b)))
    with staged_files() as files:
        files.text(tmp_path / "estimate.json", "new json")
        files.text(tmp_path / "report.md", "new report")
        files.write(tmp_path / "memory.png", lambda path: path.write_bytes(b"\x89PNG"))
    assert renamed == ["report.md", "memory.png", "estimate.json"]
    assert (tmp_path / "estimate.json").read_text() == "new json"
