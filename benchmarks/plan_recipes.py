"""The plans of issue 20's "done when": how long they take here, and what they traced.

    batchfit plan hf:llama-3.1-8b --gpu h100-80gb --gpus 8 --strategies fsdp --seq-len 8192 \
      --batch-sizes 2 --precision bf16-mixed --checkpointing selective --compile model
    batchfit plan hf:llama-3.1-70b --gpu h100-80gb --nodes 8 --gpus-per-node 8 --strategies fsdp+tp8 \
      --seq-len 8192 --batch-sizes 16 --precision bf16-mixed --checkpointing full --compile model

The first is torchtitan's Llama-3.1-8B recipe (FSDP2 on 8 GPUs, local batch 2, per-op selective
activation checkpointing, torch.compile), the second a Llama-3.1-70B-shaped FSDP x TP8 plan on
64 GPUs with the vocabulary-sharded loss (the default ``--tp-loss sharded``), and the same with
``--tp-loss gathered`` (the whole fp32 logits on every rank, what plan traced before) for the
difference. Each is timed as a user runs it (a fresh process: imports, every trace, the
report; goal: under 3 minutes on this 2-core CPU) with the load average beside it (the machine
is shared), and its JSON says what was traced: the per-rank peak at the asked local batch, the
max local batch, the TP loss, and every approximation the plan printed (a compiled model in
plan is traced eager, and says so). Writes benchmarks/results/plan_recipes-<date>.json.

    python benchmarks/plan_recipes.py [--only 8b,70b,70b-gathered]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import write_result

COMMON = ["--gpu", "h100-80gb", "--seq-len", "8192", "--precision", "bf16-mixed", "--compile", "model"]
RUNS = {
    "8b": (["hf:llama-3.1-8b", "--gpus", "8", "--strategies", "fsdp", "--batch-sizes", "2",
            "--checkpointing", "selective", *COMMON], 2),
    "70b": (["hf:llama-3.1-70b", "--nodes", "8", "--gpus-per-node", "8", "--strategies", "fsdp+tp8",
             "--batch-sizes", "16", "--checkpointing", "full", *COMMON], 16),
    "70b-gathered": (["hf:llama-3.1-70b", "--nodes", "8", "--gpus-per-node", "8", "--strategies", "fsdp+tp8",
                      "--batch-sizes", "16", "--checkpointing", "full", *COMMON, "--tp-loss", "gathered"], 16),
}
GOAL_S = 180
SRC = Path(__file__).resolve().parent.parent / "src"
"""This checkout's batchfit, not whichever is installed."""


def run(name: str) -> dict:
    args, local_batch = RUNS[name]
    with tempfile.TemporaryDirectory() as folder:
        load_before = os.getloadavg()
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "batchfit.cli.app", "plan", *args, "--out", folder,
                               "--json", f"{folder}/plan.json"], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                  filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))})
        seconds = time.perf_counter() - started
        load_after = os.getloadavg()
        if done.returncode:
            return {"command": "batchfit plan " + " ".join(args), "failed": done.returncode,
                    "stderr": done.stderr[-2000:], "wall_s": round(seconds, 1)}
        data = json.loads(Path(folder, "plan.json").read_text())
    (row,) = data["strategies"]
    at = next(p for p in row["points"] if p["local_batch"] == local_batch)
    options = data["options"]
    return {
        "command": "batchfit plan " + " ".join(args), "wall_s": round(seconds, 1), "goal_s": GOAL_S,
        "load_average_1min": {"before": round(load_before[0], 2), "after": round(load_after[0], 2)},
        "strategy": row["strategy"], "gpus": row["gpus"], "dp": row["dp"], "tp": row["tp"],
        "local_batch": local_batch, "peak_bytes_per_rank": at["peak_bytes"],
        "peak_gib_per_rank": round(at["peak_bytes"] / 2**30, 2), "breakdown": at["breakdown"],
        "max_local_batch": row["max_local_batch"], "traced_local_batches": [p["local_batch"] for p in row["points"]],
        "traces": data["traces"], "trace_seconds": data["trace_seconds"],
        "whole_reserved": row.get("whole_reserved"),
        "traced": {
            "what": "rank 0's training step on a fake process group (PyTorch's FSDP2 / DTensor code, fake "
                    "tensors), CUDA semantics, peak allocated + cuBLAS workspace",
            "precision": options["precision"], "checkpointing": options["checkpointing"],
            "compile": options["compile"], "tp_loss": row.get("tp_loss"),
            "approximations": data["approximations"],
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(RUNS), help=f"comma-separated: {', '.join(RUNS)}")
    names = [n for n in parser.parse_args().only.split(",") if n]
    results = {}
    for name in names:
        result = results[name] = run(name)
        print(result["command"])
        if "failed" in result:
            print(f"  FAILED ({result['failed']}) after {result['wall_s']} s:\n{result['stderr']}")
            continue
        load = result["load_average_1min"]
        print(f"  {result['wall_s']:.1f} s (goal {GOAL_S} s; load average {load['before']} -> {load['after']} on "
              f"{os.cpu_count()} cores); {result['traces']} traces")
        print(f"  {result['strategy']} on {result['gpus']} GPUs: {result['peak_gib_per_rank']} GiB per rank at local "
              f"batch {result['local_batch']}; max local batch {result['max_local_batch']}; "
              f"TP loss {result['traced']['tp_loss'] or '-'}; reserved traced whole at "
              f"{result['whole_reserved'] or 'no local batch'}")
        for a in result["traced"]["approximations"]:
            print(f"  approximated: {a['what']} ({a.get('detail', '')}): may differ by {a['may_differ_by']}")
    path = write_result("plan_recipes", {"goal_s": GOAL_S, "runs": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
