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


@pytest.mark.parametrize("command,args", [
    ("sweep", [*TINY, "--batch-sizes", "2,4", "--samples", "8"]),
    ("recommend", [*TINY, "--batch-sizes", "1,2", "--tokens", "1M"]),
])
@pytest.mark.parametrize("store,words", [
    (f"{README}/runs.db", "is a file, not a folder"),  # under a regular file: NotADirectoryError before
    ("/proc/runs.db", "cannot write in"),  # a folder nobody writes: OSError before
    ("/proc/batchfit/runs.db", "does not exist"),  # under /proc: FileNotFoundError before
], ids=["under-a-file", "read-only", "under-proc"])
def test_store_paths_are_checked_alike_before_any_work(command, args, store, words, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, [command, *args, "--store", store])
    said = _error_lines(result.output)
    assert result.exit_code == 2 and len(said) == 1, result.output
    assert said[0].startswith(f"error: --store {store}") and words in said[0], result.output


@pytest.mark.parametrize("command,device", [("estimate", ["--gpu", "t4"]), ("probe", ["--device", "virtual:t4"])])
def test_a_typed_default_that_contradicts_the_trainer_args_is_refused(command, device, tmp_path, monkeypatch):
    """--precision fp32 is the default, so it was taken for 'not typed' and the args' bf16 ran without a word."""
    monkeypatch.chdir(tmp_path)
    args = tmp_path / "args.json"
    args.write_text('{"bf16": true}')
    result = runner.invoke(app, [command, *TINY, *device, "--trainer", str(args), "--precision", "fp32"])
    said = _error_lines(result.output)
    assert result.exit_code == 2 and len(said) == 1, result.output
    assert "--precision fp32 contradicts --trainer" in said[0] and "bf16 -> --precision bf16-mixed" in said[0]


def test_trainer_py_whose_args_is_not_training_arguments_is_refused(tmp_path):
    """``args = 42`` was read as a dict of no fields: traced as the default TrainingArguments without a word."""
    from batchfit.errors import OptionError
    from batchfit.integrations.trainer_files import load_trainer_args

    for value, shown in (("42", "42 (type int)"), ("'bf16'", "'bf16' (type str)"), ("[1, 2]", "[1, 2] (type list)")):
        path = tmp_path / "args.py"
        path.write_text(f"args = {value}\n")
        with pytest.raises(OptionError, match="not TrainingArguments: define args = TrainingArguments") as refused:
            load_trainer_args(str(path))
        assert f"args is {shown}" in str(refused.value)
    path.write_text("args = {'bf16': True, 'per_device_train_batch_size': 4}\n")  # a dict of fields still reads
    assert load_trainer_args(str(path)).data == {"bf16": True, "per_device_train_batch_size": 4}


@pytest.mark.parametrize("option,words", [
    (["--routing", "worst"], "--routing worst changes nothing: gpt-tinystories-22m has no mixture-of-experts"),
    (["--checkpointing", "every:1000"], "--checkpointing every:1000 changes nothing: gpt-tinystories-22m has 4 blocks"),
])
def test_an_option_that_changes_nothing_says_so_everywhere(option, words, tmp_path, monkeypatch):
    """Both traced exactly the step without them, and said nothing."""
    import json

    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["estimate", *TINY, "--gpu", "t4", "--batch-sizes", "1", "--max-batch", "2",
                                 *option, "--out", "report", "--json", "e.json"])
    assert result.exit_code == 0, result.output
    assert any(line.startswith("notice: ") and words in line for line in result.output.splitlines()), result.output
    assert [n for n in json.loads(Path("e.json").read_text())["notices"] if words in n]
    assert f"> **Notice.** {words}" in Path("report/report.md").read_text()


def test_probe_says_the_options_that_change_nothing(tmp_path, monkeypatch):
    import json

    monkeypatch.chdir(tmp_path)
    probed = runner.invoke(app, ["probe", *TINY, "--device", "virtual:t4", "--max", "2", "--routing", "worst",
                                 "--checkpointing", "every:1000", "--json", "p.json", "--out", "probe"])
    assert probed.exit_code == 0 and probed.output.count("notice: ") == 2, probed.output
    assert len(json.loads(Path("p.json").read_text())["notices"]) == 2


def test_plan_says_the_options_that_change_nothing_before_it_plans(tmp_path, monkeypatch):
    from batchfit.errors import OptionError

    def stop(*args, **kwargs):  # the notices come first: the plan itself is not needed (minutes here)
        raise OptionError("stopped after the notices")

    monkeypatch.setattr("batchfit.plan.engine.plan", stop)
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["plan", *TINY, "--gpu", "h100", "--gpus", "2", "--strategies", "ddp", "--routing",
                                 "worst", "--checkpointing", "every:1000"])
    assert result.output.count("notice: ") == 2 and "stopped after the notices" in result.output, result.output


def test_options_that_change_something_say_nothing():
    from batchfit.specs import load_workload
    from batchfit.trace.noops import no_op_notices
    from batchfit.workload import StepOptions

    tiny = load_workload("gpt-tinystories-22m", seq_len=16)
    assert no_op_notices(tiny, StepOptions(checkpointing="every:4")) == []  # wraps block 3 of 4
    assert no_op_notices(tiny, StepOptions(checkpointing="full")) == []
    assert len(no_op_notices(tiny, StepOptions(checkpointing="every:5", routing="capacity:1.25"))) == 2


def test_sweep_resume_of_a_missing_store_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["sweep", *TINY, "--batch-sizes", "2,4", "--samples", "8", "--resume",
                                 "--store", "missing.db"])
    said = _error_lines(result.output)
    assert result.exit_code == 2 and len(said) == 1 and "nothing to resume" in said[0], result.output
    assert not Path("missing.db").exists()


def _short_text(tmp_path: Path) -> list[str]:
    text = tmp_path / "short.txt"
    text.write_text("Tom saw a cat. It was red.\n" * 20)  # 540 bytes: 33 samples of 16 tokens
    return ["--data", str(text), "--tokenizer", "bytes", "--cache-dir", str(tmp_path / "cache")]


def test_sweep_and_recommend_refuse_a_budget_the_data_holds_only_repeated_alike(tmp_path, monkeypatch):
    """sweep read 540 bytes 31 times over without a word while recommend refused the same data and budget."""
    monkeypatch.chdir(tmp_path)
    budget = ["--tokens", "16384", "--batch-sizes", "1,2"]
    lines = []
    for command in ("sweep", "recommend"):
        result = runner.invoke(app, [command, *TINY, *_short_text(tmp_path), *budget, "--store", f"{command}.db",
                                     "--device", "cpu"])
        said = _error_lines(result.output)
        assert result.exit_code == 2 and len(said) == 1, result.output
        lines.append(said[0])
        assert not Path(f"{command}.db").exists()  # a failed start leaves no store to block the rerun
    assert lines[0] == lines[1]
    assert "train split holds 33 samples of 16 tokens, the budget needs 1,024 (16,384 tokens)" in lines[0]
    assert "it would read the data 31.0 times" in lines[0]


def test_a_sweep_that_fails_to_start_leaves_no_store_and_the_rerun_runs(tmp_path, monkeypatch):
    """A validation split shorter than a sample was refused by the first run, after the store held the
    settings: the corrected rerun was refused as 'a different sweep (it differs in data)'."""
    from tiny import write_tiny

    monkeypatch.chdir(tmp_path)
    args = ["sweep", write_tiny(tmp_path), *_short_text(tmp_path), "--samples", "8", "--batch-sizes", "4",
            "--store", "s.db", "--device", "cpu", "--eval-samples", "1", "--out", "report"]
    failed = runner.invoke(app, args)
    assert failed.exit_code == 2 and "fewer than one sample of 17" in failed.output, failed.output
    assert not Path("s.db").exists()
    huge = runner.invoke(app,
                         [*args[:args.index("--samples")], "--tokens", "1e99", *args[args.index("--batch-sizes"):]])
    assert huge.exit_code == 2 and "--tokens '1e99' is too large" in huge.output and not Path("s.db").exists()
    rerun = runner.invoke(app, [*args, "--val-fraction", "0.1"])
    assert rerun.exit_code == 0, rerun.output


def test_an_hf_config_with_a_zero_size_is_bad_input(tmp_path):
    """hidden_size 0 failed deep in the model build (0.0 raised to a negative power): exit 1, not 2."""
    import json

    config = dict(model_type="llama", hidden_size=0, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    path = tmp_path / "zero.json"
    path.write_text(json.dumps(config))
    result = runner.invoke(app, ["estimate", f"hf:{path}", "--seq-len", "16", "--gpu", "t4", "--out",
                                 str(tmp_path / "report")])
    said = _error_lines(result.output)
    assert result.exit_code == 2 and len(said) == 1, result.output
    assert "hidden_size is 0 in" in said[0] and "a size must be 1 or more" in said[0]


@pytest.mark.parametrize("command,args", [("noise", ["--batch-sizes", "2,8"]),
                                          ("sweep", ["--batch-sizes", "2,4", "--samples", "8"])])
def test_a_missing_local_data_file_is_not_looked_up_on_the_hub(command, args, tmp_path, monkeypatch):
    import datasets

    def no_hub(*args, **kwargs):
        raise AssertionError("a local path went to datasets.load_dataset (the Hugging Face Hub)")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, [command, *TINY, *args, "--data", "fx/missing.txt", "--cache-dir", "cache"])
    said = _error_lines(result.output)
    assert result.exit_code == 2 and len(said) == 1, result.output
    assert "--data fx/missing.txt: no such file (the folder 'fx' does not exist)" in said[0]


def test_time_left_is_the_rest_at_the_rate_so_far():
    from batchfit.runs.budget import time_left

    assert time_left(10.0, 1, 4) == "ETA 30 s"  # 3 more at 10 s each
    assert time_left(60.0, 3, 13) == "ETA 3 min 20 s"
    assert time_left(3600.0, 1, 3) == "ETA 2 h 0 min"
    assert time_left(5.0, 0, 4) == "" and time_left(5.0, 4, 4) == ""  # no rate yet; nothing left


@pytest.mark.usefixtures("one_thread")
def test_sweep_and_noise_say_steps_done_and_the_time_left(tmp_path):
    """Both showed a spinner with no step count or ETA; noise's said 'tokens from the cache' while it trained."""
    from batchfit import load_workload
    from batchfit.runs.data import BatchSource
    from batchfit.sweep import SweepConfig, plan_sweep, run_sweep
    from batchfit.sweep.noise import gradient_noise_scale
    from tiny import write_corpus, write_tiny

    spec = write_tiny(tmp_path)
    workload = load_workload(spec)
    config = SweepConfig(model=spec, batch_sizes=[2, 4], tokens=256, data=str(write_corpus(tmp_path / "s.txt")),
                         tokenizer="bytes", lrs=[3e-3], eval_every="25%", eval_samples=4, store=tmp_path / "s.db",
                         cache_dir=tmp_path / "cache", device="cpu")
    said = []
    run_sweep(plan_sweep(config, workload), progress=said.append)
    counted = [line for line in said if "steps" in line and line.endswith("]")]
    assert "[0/12 steps]" in counted[0]  # 256 tokens of 16: 8 steps at batch 2, 4 at batch 4
    assert any(", ETA " in line for line in counted) and "[12/12 steps]" in said[-1], said
    said = []
    gradient_noise_scale(workload, BatchSource(workload, seed=0), small=2, big=4, steps=3, progress=said.append)
    assert said[0] == "noise scale: step 0/3 (batch sizes 2 and 4)"  # before the model is built
    assert said[1].startswith("noise scale: step 1/3") and ", ETA " in said[1], said


def test_a_traced_benchs_picture_shows_the_figure_and_the_limits_the_tiers_used(tmp_path, monkeypatch):
    """It drew allocated and reserved memory alone; the tiers (the answer) decide on reserved memory
    under 70-100% of usable: the picture now holds those limits and each tier's batch."""
    from types import SimpleNamespace

    from matplotlib.figure import Figure

    from batchfit.bench.engine import BenchRow
    from batchfit.devices import GiB
    from batchfit.report.plots import throughput_plot
    from batchfit.tiers import tiers

    rows = [BenchRow(b, "ok", "traced", peak_allocated_bytes=int(a * GiB), peak_reserved_bytes=int(r * GiB))
            for b, a, r in ((8, 2, 3), (16, 4, 5), (32, 8, 9), (64, 16, 17))]
    device = SimpleNamespace(usable_bytes=int(18 * GiB))
    result = SimpleNamespace(rows=rows, tiers=tiers(rows, int(18 * GiB)), workload="w",
                             options=SimpleNamespace(precision="fp32"),
                             target=SimpleNamespace(device=device, kind="virtual", spec="virtual:18GiB"))
    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda figure, path: drawn.append(figure))
    throughput_plot(result, tmp_path / "throughput.png")
    (memory,) = drawn[0].axes  # traced: nothing timed, no throughput panel
    lines = {line.get_label(): line for line in memory.get_lines()}
    decided = lines["peak reserved (what the tiers decide on)"]
    assert list(decided.get_ydata()) == [3, 5, 9, 17]
    # reserved 17 GiB <= 0.95 x 18 = 17.1; 9 <= 0.85 x 18 = 15.3 and 9 <= 0.70 x 18 = 12.6
    assert lines["aggressive, 95% of usable: batch 64"].get_ydata()[0] == pytest.approx(0.95 * 18)
    assert lines["conservative, 70% of usable: batch 32"].get_ydata()[0] == pytest.approx(0.70 * 18)
    assert "maximum, 100% of usable: batch 64" in lines and "default, 85% of usable: batch 32" in lines


def test_bitsandbytes_and_triton_import_notes_are_dropped_unless_debugging(monkeypatch):
    """PEFT imports bitsandbytes (--trainer, LoRA), whose CPU backend logged "Failed to load CPU
    gemm_4bit_forward from kernels-community" on every such command; BATCHFIT_DEBUG=1 keeps it."""
    import logging

    import batchfit  # noqa: F401 - installs the filters

    class Kept(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage()[:21])

    kept = Kept()
    loggers = [logging.getLogger(name) for name in ("bitsandbytes.backends.cpu.ops", "torchao.kernel.intmm")]
    for logger in loggers:
        logger.addHandler(kept)
    try:
        monkeypatch.delenv("BATCHFIT_DEBUG", raising=False)
        loggers[0].warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you "
                           "already `pip install kernels` and the kernels >= 0.11.1", "No module named 'kernels'")
        loggers[1].warning("Warning: Detected no triton, on systems without Triton certain kernels will not work")
        loggers[0].warning("another bitsandbytes warning")
        assert kept.messages == ["another bitsandbytes "]
        monkeypatch.setenv("BATCHFIT_DEBUG", "1")
        loggers[0].warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s", "x")
        assert kept.messages[-1] == "Failed to load CPU ge"
    finally:
        for logger in loggers:
            logger.removeHandler(kept)


def test_the_readmes_seed_table_holds_five_commands_the_cli_takes():
    """The README had each seed's command somewhere; the table gathers them: each row's commands name
    a command and options that exist (parsed by the app itself, nothing run)."""
    import re
    import shlex

    import typer

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## The five seeds as commands", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if re.match(r"\| 00[0-4]: ", line)]
    assert [row[2:5] for row in rows] == ["000", "001", "002", "003", "004"]
    group = typer.main.get_command(app)
    commands = [c for row in rows for c in re.findall(r"`(batchfit [^`]+)`", row) if "..." not in c]
    assert len(commands) >= 5
    for command in commands:
        name, *args = shlex.split(command)[1:]
        group.commands[name].make_context(name, args)  # raises on an unknown option or a bad value


def test_bad_input_is_one_line_without_the_traceback_hint():
    """A bad GPU name is the user's to fix from the line itself: no 'set BATCHFIT_DEBUG=1 for a
    traceback' under it (a failure inside a trace, exit 1, keeps the hint: test_sweep_cli)."""
    from typer.testing import CliRunner

    from batchfit.cli.app import app

    result = CliRunner().invoke(app, ["estimate", "gpt2-124m", "--gpu", "no-such-gpu"])
    assert result.exit_code == 2, result.output
    assert "error:" in result.output and "BATCHFIT_DEBUG" not in result.output
