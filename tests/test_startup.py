"""`batchfit --help`, `batchfit gpus` and a mistyped option answer without loading torch (well under a second)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
from typer.testing import CliRunner
from batchfit.cli.app import app
runner = CliRunner()
for args in (["--help"], ["gpus"], ["estimate", "--help"], ["plan", "--help"], ["sweep", "--help"]):
    result = runner.invoke(app, args)
    assert result.exit_code == 0, (args, result.output)
for args in (["estimate", "gpt2-124m", "--gpu", "h100-80g"],  # typos are told before torch loads
             ["estimate", "gpt2-124m", "--gpu", "h100-80gb", "--precision", "bf17"],
             ["estimate", "gpt2-124m", "--gpu", "h100-80gb", "--limit", "reserve"],
             ["estimate", "gpt2-124m", "--gpu", "h100-80gb", "--target-util", "1.5"],
             ["probe", "gpt2-124m", "--device", "virtual:h100-80gb", "--policy", "guidd"],
             ["probe", "gpt2-124m", "--device", "virtual:h100-80gb", "--steps", "1"]):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, (args, result.output)
heavy = sorted(m for m in ("torch", "transformers", "matplotlib") if m in sys.modules)
print(",".join(heavy) or "none")
"""


def test_help_and_gpus_load_no_torch():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "none", out.stdout + out.stderr


def test_import_batchfit_loads_names_when_used():
    # estimate itself loads no torch (an answer read from the trace cache needs none); probe runs real steps
    script = ("import sys, batchfit; assert 'torch' not in sys.modules; "
              "from batchfit import estimate, StepOptions; assert callable(estimate) and 'torch' not in sys.modules; "
              "from batchfit import find_max_batch; assert 'torch' in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok", out.stderr


def test_the_cli_loads_an_engine_only_for_its_command():
    # every command's flags are read at start, its engine when it runs: the planner with its config, emitters and
    # time model was a quarter of `import batchfit.cli.app` (0.1 of 0.4 CPU-s) for estimate, gpus and --help too
    engines = ("batchfit.plan.engine", "batchfit.plan.emit", "batchfit.plan.time_model", "batchfit.config.plan",
               "batchfit.trace", "batchfit.estimator.engine", "batchfit.probe.find", "batchfit.bench.engine",
               "batchfit.sweep", "batchfit.recommend.engine", "multiprocessing")
    script = ("import sys, batchfit.cli.app; "
              f"print(','.join(sorted(m for m in sys.modules if m.startswith({engines!r}))) or 'none')")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "none", out.stdout + out.stderr
