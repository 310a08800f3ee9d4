"""How many probes each search policy needs to find the largest batch, and is it exact.

Runs every policy on the virtual device (the traced step with each GPU's usable capacity,
so the true maximum is known and every run is repeatable) for every zoo model on three
GPUs. Counts search probes (not the confirmation probes of recommendations) and their
seconds on this CPU; guided's prediction (tracing) is timed separately. Writes
benchmarks/results/search_cost-<date>.json.

    python benchmarks/search_cost.py [--models gpt2-124m,...] [--gpus h100-80gb,...]
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import write_result
from batchfit import search
from batchfit.probe.find import _Predictor
from batchfit.probe.runner import probe_once
from batchfit.search import Trial
from batchfit.targets import parse_target
from batchfit.workload import StepOptions
from batchfit.zoo import ZOO

GPUS = ["rtx4090-24gb", "a100-40gb", "h100-80gb"]
# The language models of the zoo; grpo-gpt2-124m (144 generated tokens a step) is too slow to trace
# the hundred probes that linear and halving need.
MODELS = ["gpt-tinystories-22m", "gpt2-124m", "llama-1b", "byte-elman-400m"]
MAX_BATCH = 4096


def run_policy(policy: str, workload, target, options, predictor) -> dict:
    seconds: list[float] = []

    def probe(batch_size: int) -> Trial:
        started = time.perf_counter()
        trial = probe_once(workload, options, target, batch_size)
        seconds.append(time.perf_counter() - started)
        return trial

    bounds = {"lo": 1, "hi": MAX_BATCH, "multiple_of": 1}
    if policy == "guided":
        result = search.guided(probe, predictor, **bounds)
    else:
        result = getattr(search, policy)(probe, **bounds)
    return {"max_batch_size": result.max_batch_size, "probes": len(result.trials), "exact": result.exact,
            "probe_seconds": round(sum(seconds), 1), "sizes": [t.batch_size for t in result.trials]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--gpus", default=",".join(GPUS))
    parser.add_argument("--precision", default="bf16-mixed")
    args = parser.parse_args()
    options = StepOptions(precision=args.precision)
    rows = []
    for model in args.models.split(","):
        workload = ZOO[model]()
        for gpu in args.gpus.split(","):
            target = parse_target(f"virtual:{gpu}")
            started = time.perf_counter()
            predictor = _Predictor(workload, options, target, target.device.usable_bytes, 1, MAX_BATCH, lambda m: None)
            predict_s = time.perf_counter() - started
            runs = {policy: run_policy(policy, workload, target, options, predictor) for policy in search.POLICIES}
            truth = runs["binsearch"]["max_batch_size"]  # exact by construction (bisection)
            for run in runs.values():
                run["found_true_max"] = run["max_batch_size"] == truth
            rows.append({"model": model, "gpu": gpu, "true_max": truth, "guided_predict_s": round(predict_s, 1),
                         "policies": runs})
            print(f"{model:20s} {gpu:14s} max {truth:5d}  " + "  ".join(
                f"{p} {r['probes']}{'' if r['found_true_max'] else '!'}" for p, r in runs.items()), flush=True)
    summary = {}
    for policy in search.POLICIES:
        counts = [row["policies"][policy]["probes"] for row in rows]
        summary[policy] = {"median_probes": statistics.median(counts), "max_probes": max(counts),
                           "found_true_max": sum(row["policies"][policy]["found_true_max"] for row in rows),
                           "cases": len(rows),
                           "median_probe_seconds": statistics.median(row["policies"][policy]["probe_seconds"]
                                                                     for row in rows)}
        print(f"{policy:10s} median probes {summary[policy]['median_probes']:5}  max "
              f"{summary[policy]['max_probes']:3}  true max found {summary[policy]['found_true_max']}/{len(rows)}")
    path = write_result("search_cost", {
        "what": f"search probes per policy on virtual devices ({args.precision}, batch 1..{MAX_BATCH}); "
                "'!' marks a policy that did not find the true maximum",
        "precision": args.precision, "max_batch": MAX_BATCH, "summary": summary, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
