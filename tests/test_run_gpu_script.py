"""benchmarks/run_gpu.py (issue 32, item 5) is ready to run where a GPU is lent: without one it says so
in one line, and its CPU dry run (the same loop, each step's profiled peak against its trace) agrees."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "run_gpu.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          cwd=SCRIPT.parent, timeout=600)


def test_without_a_gpu_it_says_so_in_one_line():
    done = _run("--steps", "1")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines()[-1].startswith("run_gpu.py needs a CUDA GPU and found none")


@pytest.mark.slow  # 60 s here: 2 steps of the benchmark's model (8 x up to 480 tokens), an eval step, the profiler
def test_its_cpu_dry_run_matches_the_profiler_step_by_step():
    done = _run("--device", "cpu", "--steps", "2", "--precision", "fp32")
    assert done.returncode == 0, done.stderr[-2000:]
    pairs = re.findall(r"traced ([\d,]+) B, profiler ([\d,]+) B", done.stdout)
    assert len(pairs) == 3  # two training steps, then the eval loop's step
    for traced, measured in pairs:
        assert int(traced.replace(",", "")) == pytest.approx(int(measured.replace(",", "")), rel=0.01)
