"""torchtitan's Llama 3 8B job, planned: ``batchfit plan torchtitan:llama3_8b.toml`` on the 64 A100s
its preset names ("this toml config is a preset for 64 A100 GPUs").

benchmarks/data/torchtitan_llama3_8b.toml is torchtitan v0.2.2's own
torchtitan/models/llama3/train_configs/llama3_8b.toml (commit 73a0e6979dd1, byte for byte):
flavor 8B, local_batch_size 1, seq_len 8192, FSDP over all GPUs (data_parallel_shard_degree -1),
selective activation checkpointing per op, bf16 FSDP2 policy, fused AdamW. What runs is
torchtitan's own model and parallelize_llama on batchfit's fake process group (the whole
32-block step traced, rank 0), with the job's own global batch (1 x 64).

    PYTHONPATH=src python benchmarks/plan_torchtitan.py [--gpu a100-80gb] [--gpus 64]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _common import write_result  # noqa: E402

JOB = Path(__file__).parent / "data" / "torchtitan_llama3_8b.toml"
GIB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpu", default="a100-80gb")
    parser.add_argument("--gpus", default="64")
    parser.add_argument("--max-batch", default="8")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        command = [sys.executable, "-m", "batchfit.cli.app", "plan", f"torchtitan:{JOB}", "--gpu", args.gpu,
                   "--gpus", args.gpus, "--max-batch", args.max_batch, "--processes", "1",
                   "--json", str(out / "plan.json"), "--out", str(out / "report"),
                   "--emit", f"torchtitan:{out / 'job.toml'}"]
        start = time.perf_counter()
        run = subprocess.run(command, capture_output=True, text=True)
        wall_s = time.perf_counter() - start
        print(run.stdout[-4000:], run.stderr[-2000:])
        run.check_returncode()
        data = json.loads((out / "plan.json").read_text())
        emitted = (out / "job.toml").read_text()
    best = data["recommended"][0]
    plan = next(p for p in data["strategies"] if p["strategy"] == best["strategy"])
    figures = {
        "job": str(JOB.relative_to(Path(__file__).parents[1])),
        "gpu": args.gpu, "gpus": int(args.gpus),
        "code": data["torchtitan"]["code"],
        "strategy": best["strategy"],
        "max_local_batch": plan["max_local_batch"],
        "micro_batch": best["micro_batch"], "accumulation_steps": best["accumulation_steps"],
        "global_batch": best["global_batch"],
        "peak_gib_at_micro": round((best.get("peak_reserved_bytes_at_micro") or best["peak_bytes_at_micro"]) / GIB, 2),
        "limit": best["limit"], "step_time_s": best["step_time_s"], "tokens_per_s": best["tokens_per_s"],
        "approximations": data.get("approximations") or [],
        "emitted_toml_changes": [line for line in emitted.splitlines() if line not in JOB.read_text().splitlines()],
        "wall_s": round(wall_s, 1),
        "unused_keys": sum(1 for m in data["torchtitan"]["mapping"] if m["used_as"].startswith("not used")),
    }
    for key, value in figures.items():
        print(f"{key}: {value}")
    print("wrote", write_result("plan_torchtitan", figures))


if __name__ == "__main__":
    main()
