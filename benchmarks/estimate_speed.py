"""How long `batchfit estimate` takes for hf:llama-3.1-8b at seq 8192 on this machine.

Times the whole command as a user runs it (a fresh `batchfit estimate` process: imports,
building the model, every trace, the report; goal: under 10 s on a 2-core CPU), and the
in-process part, for the README's example and the other precisions. Prints a table and
writes benchmarks/results/estimate_speed-<date>.json.

    python benchmarks/estimate_speed.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import write_result
from batchfit import StepOptions, estimate, get_device, load_workload

MODEL = ["hf:llama-3.1-8b", "--gpu", "h100-80gb", "--seq-len", "8192"]
CASES = [
    ("fp32 (default)", {}),
    ("bf16-mixed", {"precision": "bf16-mixed"}),
    ("bf16-mixed + checkpointing full", {"precision": "bf16-mixed", "checkpointing": "full"}),
    ("bf16 + checkpointing full", {"precision": "bf16", "checkpointing": "full"}),
    ("bf16 + checkpointing full, --limit allocated", {"precision": "bf16", "checkpointing": "full",
                                                      "limit": "allocated"}),
]


def _flags(options: dict) -> list[str]:
    return [arg for key, value in options.items() for arg in (f"--{key}", value)]


def command_seconds(options: dict) -> tuple[float, dict]:
    """The whole CLI process, as a user runs it, and the JSON it wrote."""
    with tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "batchfit.cli.app", "estimate", *MODEL, *_flags(options),
                        "--out", folder, "--json", f"{folder}/e.json"], check=True, capture_output=True)
        seconds = time.perf_counter() - started
        return seconds, json.loads(Path(folder, "e.json").read_text())


def main() -> None:
    device = get_device("h100-80gb")
    rows = []
    for label, options in CASES:
        command_s, data = command_seconds(options)
        workload = load_workload("hf:llama-3.1-8b", seq_len=8192)
        started = time.perf_counter()
        step = {k: v for k, v in options.items() if k != "limit"}
        estimate(workload, device=device, options=StepOptions(**step), limit=options.get("limit", "reserved"))
        in_process_s = time.perf_counter() - started
        rows.append({"options": label, "command": "batchfit estimate " + " ".join(MODEL + _flags(options)),
                     "command_s": round(command_s, 2), "in_process_s": round(in_process_s, 2),
                     "traces": data["traces"], "traced_by_depth": data["traced_by_depth"],
                     "max_batch_size": data["max_batch_size"],
                     "peak_gib_at_batch_1": round(data["points"][0]["peak_bytes"] / 2**30, 2),
                     "suggestions": len(data["suggestions"])})
        print(f"{label:34s} command {command_s:6.1f} s  in-process {in_process_s:6.1f} s  "
              f"traces {data['traces']}  max batch {data['max_batch_size']}  "
              f"peak@1 {rows[-1]['peak_gib_at_batch_1']} GiB", flush=True)
    path = write_result("estimate_speed", {
        "what": "wall time of `batchfit estimate` for hf:llama-3.1-8b, seq 8192, on h100-80gb (traced on CPU): "
                "the whole command as a fresh process, and estimate() in-process",
        "goal_command_s": 10, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
