"""What a new user trips over (issue 8): output paths, markup, folders, --help, progress, warnings."""

from __future__ import annotations

import importlib
import io
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from batchfit.cli import common
from batchfit.cli.app import app
from batchfit.targets import parse_target
from batchfit.workload import StepOptions

runner = CliRunner()
MODEL = ["gpt-tinystories-22m", "--seq-len", "16"]


def _no_work(monkeypatch):
    """Fail loudly if any engine starts: the bad path must be refused before the work."""
    def boom(*args, **kwargs):
        raise AssertionError("the engine ran before the output paths were checked")

    # the commands import their engine when they run (--help loads no torch): patch it at home
    for module, name in (("batchfit.estimator.engine", "estimate"), ("batchfit.probe.find", "find_max_batch"),
                         ("batchfit.bench.engine", "bench")):
        monkeypatch.setattr(importlib.import_module(module), name, boom)


@pytest.mark.parametrize("command", ["estimate", "probe", "bench"])
def test_output_paths_are_checked_before_any_work(command, tmp_path, monkeypatch):
    _no_work(monkeypatch)
    device = ["--gpu", "t4-16gb"]
    missing = runner.invoke(app, [command, *MODEL, *device, "--json", str(tmp_path / "no" / "x.json")])
    assert missing.exit_code == 2 and "does not exist" in missing.output
    a_file = tmp_path / "file.txt"
    a_file.write_text("mine")
    clash = runner.invoke(app, [command, *MODEL, *device, "--out", str(a_file)])
    assert clash.exit_code == 2 and "is a file" in clash.output and a_file.read_text() == "mine"


def test_markup_in_messages_is_printed_as_written(monkeypatch):
    from batchfit.errors import ModelSpecError

    def refuse(*args, **kwargs):
        raise ModelSpecError("hf: models need the transformers package: pip install 'batchfit[hf]'")

    monkeypatch.setattr("batchfit.trace.deferred.load_deferred", refuse)  # estimate loads its model through it
    result = runner.invoke(app, ["estimate", "hf:gpt2-124m", "--gpu", "t4"])
    assert result.exit_code == 2 and "pip install 'batchfit[hf]'" in result.output


def test_report_folders_differ_by_options():
    target = parse_target("virtual:24GiB")
    plain = common.report_folder(None, "estimate", "gpt2-124m", target, StepOptions())
    mixed = common.report_folder(None, "estimate", "gpt2-124m", target, StepOptions(precision="fp16-mixed"))
    assert plain == Path("reports/estimate-gpt2-124m-24GiB")
    assert mixed == Path("reports/estimate-gpt2-124m-24GiB-fp16-mixed")
    ckpt = common.report_folder(None, "probe", "hf:llama-3.1-8b", parse_target("virtual:h100-80gb"),
                                StepOptions(checkpointing="full", accumulation_steps=4), seq_len=8192)
    assert ckpt == Path("reports/probe-hf_llama-3.1-8b-h100-80gb-seq8192-ckpt-full-accum4")
    gathered = common.report_folder(None, "plan", "hf:llama-3.1-70b", parse_target("virtual:h100-80gb"),
                                    StepOptions(tp_loss="gathered"))
    assert gathered == Path("reports/plan-hf_llama-3.1-70b-h100-80gb-tp-loss-gathered")  # not the sharded run's


def test_report_folders_differ_by_the_trainers_rollout():
    """Two GRPOConfigs of one model (plain, then with temperature and top_k) wrote the same folder, the second
    report over the first; seed 003's zoo step (no --trainer, no rollout) keeps its folder."""
    from batchfit.options import Rollout

    target, name = parse_target("virtual:1GiB"), "grpo hf:qwen2.json"
    plain = Rollout(prompt_len=16, new_tokens=8, group_size=4)
    sampled = Rollout(prompt_len=16, new_tokens=8, group_size=4, sampling=(("temperature", 0.7), ("top_k", 50)))
    folders = [common.report_folder(None, "estimate", name, target, StepOptions(), rollout=r) for r in (plain, sampled)]
    assert folders[0] != folders[1]
    assert all(str(f).startswith("reports/estimate-grpo_hf_qwen2.json-1GiB-rl-p16-c8-g4-") for f in folders)
    assert common.report_folder(None, "estimate", name, target, StepOptions(), rollout=plain) == folders[0]
    seed_003 = common.report_folder(None, "estimate", "grpo-gpt2-124m", parse_target("virtual:rtx4090-24gb"),
                                    StepOptions())
    assert seed_003 == Path("reports/estimate-grpo-gpt2-124m-rtx4090-24gb")


@pytest.mark.parametrize("command,files", [("estimate", "estimate.json"), ("probe", "probe.json"),
                                           ("bench", "throughput.png")])
def test_help_teaches_and_names_the_files(command, files):
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    flags = [line for line in result.output.splitlines() if line.strip("│ ").startswith("--") and "--help" not in line]
    assert not any("<bool>" in line for line in flags)
    assert files in result.output and "my_grpo.py" not in result.output


def test_progress_is_a_line_per_stage_in_a_log():
    stream = io.StringIO()
    console = Console(file=stream, force_terminal=False, width=200)
    with common.progress_line(total=2, stream=console) as say:
        say("batch size 8 (traced)")
        say("batch size 16 (traced)")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].endswith("batch size 8 (traced) [1/2]") and "[2/2, ETA" in lines[1]


def test_bf16_on_a_t4_warns_once(monkeypatch):
    _no_work(monkeypatch)  # the warning comes before the work (which then fails in the fake engine)
    result = runner.invoke(app, ["estimate", *MODEL, "--gpu", "t4", "--precision", "bf16-mixed"])
    assert result.output.count("no bf16 tensor cores") == 1


def test_probe_without_a_device_says_which_it_chose(tmp_path):
    result = runner.invoke(app, ["probe", *MODEL, "--max", "4", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "no --gpu or --device given" in result.output and "h100-80gb" in result.output


def test_freeze_with_train_only_says_which_wins(tmp_path):
    result = runner.invoke(app, ["estimate", *MODEL, "--gpu", "t4", "--train-only", "blocks.*",
                                 "--freeze", "blocks.0.*", "--max-batch", "2", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "--train-only picks the parameters that train; --freeze then freezes some" in result.output


def _help_texts() -> dict[str, list[str]]:
    """Each command's own help texts, as written: its docstring, epilog and options' help."""
    import typer

    group = typer.main.get_command(app)
    texts = {"": [group.help or ""]}
    for name, command in group.commands.items():
        texts[name] = [command.help or "", command.epilog or "",
                       *(p.help for p in command.params if getattr(p, "help", None))]
    return texts


def test_no_help_drops_a_bracketed_word():
    """Rich markup read '[quant]' in "Needs batchfit[quant]." as a style tag and dropped it; every
    bracketed word a help text holds (what rich would take for a tag) is printed."""
    import re

    seen = 0
    for name, texts in _help_texts().items():
        result = runner.invoke(app, [*([name] if name else []), "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        printed = re.sub(r"\s+", " ", re.sub(r"[│╭╮╰╯─]", " ", result.output))
        for text in texts:
            for tag in re.findall(r"\\?\[[a-z#/@][^\[\]]*\]", text):
                tag = tag.removeprefix("\\")
                seen += 1
                assert re.sub(r"\s+", " ", tag) in printed, (name, tag)
    assert seen >= 3  # batchfit[quant] (twice), torchtitan's [training] section, ...


def test_torchaos_import_notes_are_filtered_and_nothing_else():
    """The records torchao 0.18's import logs (torchao/__init__.py) and torch 2.13's pytree note on
    its enums (torch/utils/_pytree.py), as they log them: dropped; the same loggers' other records
    and the same note on any other enum pass."""
    import enum
    import logging

    import batchfit  # noqa: F401 - installs the filters

    class Kept(logging.Handler):  # on the loggers themselves: torch's do not propagate to the root
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage()[:23])

    KernelPreference = enum.Enum("KernelPreference", "AUTO")
    KernelPreference.__module__ = "torchao.quantization.quantize_.common.kernel_preference"
    note = ("%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type. "
            "Calling register_constant() on Enum subclasses is deprecated and will be an error in a future release.")
    kept = Kept()
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    for logger in loggers:
        logger.addHandler(kept)
    try:
        loggers[0].warning("Failed to load /site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: "
                           "Could not load this library: /site-packages/torchao/_C_mxfp8.so")
        loggers[1].warning(note, KernelPreference)
        assert kept.messages == []
        loggers[0].warning("another torchao warning")
        loggers[1].warning(note, enum.Enum("Mine", "A"))
    finally:
        for logger in loggers:
            logger.removeHandler(kept)
    assert kept.messages == ["another torchao warning", "<enum 'Mine'> is an Enu"]


@pytest.mark.slow
def test_torchaos_import_notes_stay_off_the_terminal():
    """transformers imports torchao whenever it is installed, so hf: models and LoRA did too, and each
    command printed torchao's "Failed to load .../_C_mxfp8...so" lines and torch's "<enum
    'KernelPreference'> is an Enum subclass ..." notes. Those (only) are filtered on their loggers."""
    import subprocess
    import sys

    pytest.importorskip("torchao")
    script = ("import logging, batchfit, torchao; "
              "logging.getLogger('torchao').warning('another torchao warning'); "
              "logging.getLogger('torch.utils._pytree').warning('%s is an Enum subclass and ...', logging.Logger)")
    err = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stderr
    assert "Failed to load" not in err and "KernelPreference" not in err and "ScaleCalculationMode" not in err, err
    assert "another torchao warning" in err and "<class 'logging.Logger'> is an Enum subclass" in err  # not torchao's


def test_plan_help_says_auto_sets_candidates_aside_by_a_bound():
    """auto traces in the order of each candidate's tokens/s bound and leaves one below the best traced row as a
    'not traced' row (docs/tracing/auto.md); the help said only 'at most 15 traced on 8'."""
    import re

    result = runner.invoke(app, ["plan", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    printed = re.sub(r"\s+", " ", re.sub(r"[│╭╮╰╯─]", " ", result.output))
    assert ("one whose bound is below the best traced row is a 'not traced' row with its bound and formula, never a "
            "traced figure (docs/tracing/auto.md)") in printed
    assert "15 traced on 8" not in printed
