"""Where the imports of `batchfit estimate hf:llama-3.1-8b ...` go: the CPU seconds of each group, in a fresh process.

The groups are imported one after another in one process, each timed with the process's CPU clock, so a module
two groups share counts in the first. The order puts what the command needs whatever the model first (the CLI,
torch, the tracer's FakeTensorMode with torch._dynamo, sympy and DTensor), then what an ``hf:`` model adds:
transformers, the optional packages its modeling code imports when they are installed (none used to build a
model from its config), the Llama config and modeling module, and matplotlib for memory.png. Each group is
timed over RUNS fresh processes: min / median / max. Prints a table and writes
benchmarks/results/import_cost-<date>.json.

    python benchmarks/import_cost.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from _common import write_result

RUNS = 3
GROUPS = [
    ("batchfit CLI (typer, rich, every command's flags)", "import batchfit.cli.app"),
    ("torch", "import torch"),
    ("the tracer's own torch imports: FakeTensorMode (torch._dynamo, sympy, DTensor)",
     "from torch._subclasses.fake_tensor import FakeTensorMode; FakeTensorMode(allow_non_fake_inputs=True)"),
    ("batchfit's estimator, tracer and zoo", "import batchfit.estimator.engine, batchfit.trace.session, batchfit.zoo"),
    ("transformers (its __init__)", "import transformers"),
    ("scipy.optimize: transformers' object-detection loss imports it when installed", "import scipy.optimize"),
    ("torchao: transformers' quantizers import it when installed", "import torchao"),
    ("accelerate: transformers' model loading imports it when installed", "import accelerate"),
    ("the Llama config and modeling module, with the rest of transformers' modeling code",
     "import transformers.models.llama.modeling_llama"),
    ("matplotlib (memory.png)", "import matplotlib.figure, matplotlib.backends.backend_agg"),
]
SCRIPT = """
import json, time
seconds = []
for code in {codes!r}:
    started = time.process_time()
    exec(code)
    seconds.append(time.process_time() - started)
print("SECONDS " + json.dumps(seconds))
"""


def one_run() -> list[float]:
    """The CPU seconds of each group in one fresh process."""
    src = str(Path(__file__).resolve().parent.parent / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(codes=[code for _, code in GROUPS])],
                         capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("SECONDS "))[8:])


def main() -> None:
    runs = [one_run() for _ in range(RUNS)]
    rows = []
    for n, (label, code) in enumerate(GROUPS):
        seconds = sorted(run[n] for run in runs)
        rows.append({"label": label, "code": code, "cpu_seconds": {
            "min": round(seconds[0], 3), "median": round(statistics.median(seconds), 3), "max": round(seconds[-1], 3)}})
        print(f"{statistics.median(seconds):6.2f} CPU-s  {label}", flush=True)
    total = statistics.median(sum(run) for run in runs)
    print(f"{total:6.2f} CPU-s  in all")
    path = write_result("import_cost", {
        "what": "CPU seconds of each group of imports the 8B estimate makes, in a fresh process, in the order "
                "of groups (a module two groups share counts in the first); median of the runs in all",
        "runs": RUNS, "bytecode_written": not os.environ.get("PYTHONDONTWRITEBYTECODE"),
        "total_cpu_seconds_median": round(total, 3), "groups": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
