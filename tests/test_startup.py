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
