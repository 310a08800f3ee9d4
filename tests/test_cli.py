"""The CLI as a user runs it: reports written, bad input is one line and exit code 2."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from batchfit.cli.app import app

runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, list(args))


def test_estimate_writes_the_report(tmp_path):
    out = tmp_path / "report"
    result = run("estimate", "gpt-tinystories-22m", "--gpu", "rtx4090-24gb", "--seq-len", "64",
                 "--out", str(out), "--json", str(tmp_path / "e.json"), "--limit", "allocated")
    assert result.exit_code == 0, result.output
    assert {p.name for p in out.iterdir()} == {"report.md", "memory.png", "estimate.json"}
    data = json.loads((tmp_path / "e.json").read_text())
    assert data["max_batch_size"] > 0
    assert "## Peak memory by batch size" in (out / "report.md").read_text()
    assert (out / "memory.png").read_bytes()[:4] == b"\x89PNG"


def test_json_to_stdout_is_pure_json(tmp_path):
    result = runner.invoke(app, ["estimate", "gpt-tinystories-22m", "--gpu-memory", "8GiB", "--seq-len", "64",
                                 "--max-batch", "8", "--json", "-", "--out", str(tmp_path), "--limit", "allocated"])
    assert result.exit_code == 0
    assert json.loads(result.stdout)["device"]["name"] == "custom"


def test_user_workload_from_a_file(tmp_path):
    (tmp_path / "my_model.py").write_text(
        "import torch\nfrom torch import nn\nfrom batchfit import Workload\n"
        "def workload():\n"
        "    return Workload(name='mine', build_model=lambda: nn.Linear(64, 64),\n"
        "                    make_batch=lambda b, d: torch.randn(b, 64, device=d),\n"
        "                    loss_fn=lambda m, x: m(x).sum())\n")
    result = run("estimate", f"{tmp_path}/my_model.py:workload", "--gpu-memory", "1GiB", "--max-batch", "4096",
                 "--out", str(tmp_path / "r"))
    assert result.exit_code == 0, result.output
    assert "max batch size 4096" in result.output
    # 4096 is --max-batch, not a size shown to fail: the terminal says the search stopped at its cap
    assert "4,096 is --max-batch's cap, not where memory runs out" in " ".join(result.output.split())


BAD_INPUT = [
    (["estimate", "gpt-tinystories", "--gpu", "t4-16gb"], "did you mean 'gpt-tinystories-22m'"),
    (["estimate", "hf:llama-9b", "--gpu", "t4-16gb"], "unknown hf model"),
    (["estimate", "nowhere.py:workload", "--gpu", "t4-16gb"], "no file 'nowhere.py'"),
    (["estimate", "gpt2-124m", "--gpu", "h100"], None),  # an alias: fine, see below
    (["estimate", "gpt2-124m", "--gpu", "h100-80"], "did you mean 'h100-80gb'"),
    (["estimate", "gpt2-124m", "--gpu-memory", "24"], "24GiB"),
    (["estimate", "gpt2-124m", "--gpu", "t4-16gb", "--gpu-memory", "16GiB"], "give one of --gpu / --gpu-memory"),
    (["estimate", "gpt2-124m", "--gpu", "t4-16gb", "--precision", "bfloat16"], "bf16-mixed"),
    (["estimate", "gpt2-124m", "--gpu", "t4-16gb", "--optimizer", "lion"], "adamw"),
    (["estimate", "gpt2-124m", "--gpu", "t4-16gb", "--batch-sizes", "8;16"], "8,16,32"),
    (["estimate", "gpt2-124m", "--gpu", "t4-16gb", "--target-util", "90"], "0.9"),
    (["estimate", "gpt2-124m", "--gpu", "t4-16gb", "--seq-len", "0"], "--seq-len"),
    (["estimate", "hf:gpt2", "--gpu", "t4-16gb", "--seq-len", "4096"], "longer than"),
    (["estimate", "gpt2-124m", "--gpu", "t4-16gb", "--freeze", "nothing.*"], "matches no parameter"),
    (["estimate", "gpt2-124m", "--gpu", "t4-16gb", "--accumulation-steps", "0"], "1 or more"),
]


@pytest.mark.parametrize("args,message", [case for case in BAD_INPUT if case[1]])
def test_bad_input_is_one_line_and_exit_code_2(args, message):
    result = run(*args)
    assert result.exit_code == 2, result.output
    error_lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and message in result.output
    assert "Traceback" not in result.output


def test_a_model_that_cannot_be_traced_names_the_op(tmp_path):
    (tmp_path / "dyn.py").write_text(
        "import torch\nfrom torch import nn\nfrom batchfit import Workload\n"
        "def workload():\n"
        "    return Workload(name='dyn', build_model=lambda: nn.Linear(8, 8),\n"
        "                    make_batch=lambda b, d: torch.randn(b, 8, device=d),\n"
        "                    loss_fn=lambda m, x: m(x)[m(x) > 0].sum())\n")
    result = run("estimate", f"{tmp_path}/dyn.py:workload", "--gpu", "t4-16gb", "--out", str(tmp_path / "r"))
    assert result.exit_code == 1
    assert "nonzero" in result.output and "cannot be traced" in result.output


def test_gpus_and_zoo_list_what_is_known():
    assert "rtx6000ada-48gb" in run("gpus").output
    assert json.loads(run("gpus", "--json").output)[0]["name"] == "h100-80gb"
    assert "byte-elman-400m" in run("zoo").output


def test_help_teaches_with_examples():
    result = run("estimate", "--help")
    assert "batchfit estimate hf:llama-3.1-8b" in result.output


def test_ctrl_c_is_one_line_and_exit_code_130(capsys):
    import typer

    from batchfit.cli.common import handle_errors

    @handle_errors
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(typer.Exit) as stopped:
        interrupted()
    assert stopped.value.exit_code == 130


def test_bench_where_nothing_ran_exits_1_and_prints_the_error(tmp_path):
    """Item 16: every batch size failed with a non-OOM error, the terminal said only 'error'
    and the exit code was 0."""
    (tmp_path / "broken.py").write_text(
        "import torch\nfrom torch import nn\nfrom batchfit import Workload\n"
        "def loss(m, x):\n    raise ValueError('my loss needs labels')\n"
        "def workload():\n"
        "    return Workload(name='broken', build_model=lambda: nn.Linear(8, 8),\n"
        "                    make_batch=lambda b, d: torch.randn(b, 8, device=d), loss_fn=loss)\n")
    result = run("bench", f"{tmp_path}/broken.py:workload", "--device", "virtual:t4-16gb", "--batch-sizes", "2,4",
                 "--out", str(tmp_path / "r"), "--json", str(tmp_path / "b.json"))
    assert result.exit_code == 1, result.output
    assert "batch 2 error:" in result.output and "my loss needs labels" in result.output
    assert json.loads((tmp_path / "b.json").read_text())["rows"][0]["status"] == "error"


def test_zoo_without_transformers_lists_every_model_and_says_what_hf_ones_need():
    """Item 17: `batchfit zoo` crashed when transformers was not installed (frozen-pair builds on it)."""
    import os
    import subprocess
    import sys

    script = ("import sys; sys.modules['transformers'] = None  # import transformers now fails\n"
              "from typer.testing import CliRunner\nfrom batchfit.cli.app import app\n"
              "r = CliRunner().invoke(app, ['zoo'])\n"
              "print(r.exit_code); print(r.output)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})
    code, _, output = done.stdout.partition("\n")
    assert code == "0", done.stdout + done.stderr
    from batchfit.zoo import ZOO
    from batchfit.zoo.hf import CONFIGS

    rows = {line.split("│")[1].strip(): line for line in output.splitlines() if line.count("│") >= 3}
    assert set(ZOO) | {f"hf:{name}" for name in CONFIGS} <= set(rows)
    for name in ("frozen-pair", "frozen-pair-tiny"):
        assert "pip install 'batchfit[hf]'" in rows[name]
    assert "needs batchfit[hf]" in rows["hf:gpt2-124m"]


def test_device_options_are_declared_once_and_read_the_same_in_every_command():
    """--gpu, --gpu-memory and --device come from cli/common.py's aliases: one help text each."""
    import typer

    from batchfit.cli import common

    commands = typer.main.get_command(app).commands
    declared = {"gpu": common.GpuOpt, "gpu_memory": common.GpuMemoryOpt, "device": common.DeviceOpt}
    for command in ("estimate", "probe", "bench", "plan", "sweep", "noise", "recommend"):
        options = {p.name: p for p in commands[command].params}
        for name, alias in declared.items():
            if name in options:
                assert options[name].help == alias.__metadata__[0].help, (command, name)
        assert "device" in options
    # estimate, probe, bench, plan, sweep, noise and recommend take all three; gpus takes none (it lists them)
    assert sum(name in {p.name for p in commands[c].params} for c in commands for name in declared) == 7 * 3


def test_main_exits_as_sys_exit_would_without_the_teardown():
    """``main`` ends with ``os._exit`` (the interpreter's teardown took 1.6-2.1 s after a 70B plan): its exit code
    is the command's (2 for bad input), what it printed reaches a pipe whole, and exit handlers still run."""
    import subprocess
    import sys

    def run(*args: str) -> subprocess.CompletedProcess:
        script = ("import atexit, sys\nfrom batchfit.cli.app import main\n"
                  "atexit.register(lambda: print('handler ran', file=sys.stderr))\n"
                  f"sys.argv = ['batchfit', *{list(args)!r}]\nmain()\nprint('not reached')")
        return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)

    listed = run("gpus", "--json")  # a long JSON through a pipe
    assert listed.returncode == 0 and "not reached" not in listed.stdout
    assert "h100-80gb" in [gpu["name"] for gpu in json.loads(listed.stdout)]
    assert listed.stderr.strip().endswith("handler ran")
    wrong = run("estimate", "no-such-model", "--gpu", "h100-80gb")
    assert wrong.returncode == 2 and "error:" in wrong.stderr and wrong.stderr.strip().endswith("handler ran")


def test_main_under_a_profiler_exits_through_sys_exit():
    """``python -m cProfile`` writes its figures after the command returns: under a profiler ``main`` raises
    SystemExit as ``sys.exit`` does instead of ending the process."""
    import subprocess
    import sys

    script = ("import sys\nfrom batchfit.cli.app import main\nsys.argv = ['batchfit', 'gpus']\n"
              "sys.setprofile(lambda *args: None)\n"
              "try:\n    main()\nexcept SystemExit as done:\n    sys.setprofile(None)\n    print('exited', done.code)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("exited 0"), done.stdout[-300:] + done.stderr
