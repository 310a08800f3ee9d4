"""On a real GPU: traced vs measured peak memory for the zoo, and predicted vs found max batch.

For each zoo model: trace the peak at two batch sizes (batchfit.estimate's tracer) and run
the same steps on the GPU (torch.cuda.max_memory_allocated, reset per probe); then find the
largest batch with `guided` on the GPU and compare it with the traced prediction. Also
measures the two fixed costs batchfit assumes: the CUDA context and the cuBLAS workspace.
Writes benchmarks/results/validate_gpu-<date>.json. Goal: traced within 3% of measured.

    python benchmarks/validate_gpu.py [--models ...] [--precision bf16-mixed] [--max 4096]
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import write_result

from batchfit import StepOptions, estimate, find_max_batch, parse_target
from batchfit.devices import detect_cuda_device
from batchfit.probe.runner import probe_once
from batchfit.zoo import ZOO

GiB = 2**30


def fixed_costs() -> dict:
    """The CUDA context (outside the allocator) and the cuBLAS workspace (inside it)."""
    torch.cuda.init()
    torch.empty(1, device="cuda")
    free, total = torch.cuda.mem_get_info()
    context = total - free - torch.cuda.memory_reserved()
    a = torch.randn(256, 256, device="cuda")
    before = torch.memory_allocated()
    (a @ a).sum().item()
    workspace_forward = torch.memory_allocated() - before - 256 * 256 * 4 - 512
    return {"cuda_context_bytes": context, "cublas_workspace_main_thread_bytes": workspace_forward,
            "total_bytes": total}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=",".join(ZOO))
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--max", type=int, default=4096)
    args = parser.parse_args()
    costs = fixed_costs()
    device = detect_cuda_device()
    target = parse_target("cuda")
    options = StepOptions(precision=args.precision)
    rows = []
    for model in args.models.split(","):
        workload = ZOO[model]()
        traced = estimate(workload, device=device, options=options, max_batch=args.max, suggest=False)
        points = []
        for point in traced.points[:2] + [traced.point(traced.max_batch_size)] if traced.max_batch_size else traced.points[:2]:
            trial = probe_once(workload, options, target, point.batch_size)
            measured = trial.peak_allocated_bytes
            points.append({"batch_size": point.batch_size, "traced_bytes": point.peak_bytes, "status": trial.status,
                           "measured_allocated_bytes": measured, "measured_reserved_bytes": trial.peak_reserved_bytes,
                           "error": None if not measured else round((point.peak_bytes - measured) / measured, 4),
                           "step_time_s": trial.step_time_s})
        started = time.perf_counter()
        found = find_max_batch(workload, target=target, options=options, largest=args.max)
        row = {"model": model, "points": points, "predicted_max": traced.max_batch_size,
               "found_max": found.max_batch_size, "found_exact": bool(found.search and found.search.exact),
               "search_probes": len(found.search.trials) if found.search else None,
               "search_seconds": round(time.perf_counter() - started, 1),
               "step_time_s_at_max": (found.trial(found.max_batch_size).step_time_s
                                      if found.max_batch_size else None),
               "tokens_per_sample": workload.tokens_per_sample}
        rows.append(row)
        print(f"{model:20s} predicted {row['predicted_max']:5d} found {row['found_max']:5d} "
              f"({row['search_probes']} probes)  " + "  ".join(
                  f"b{p['batch_size']}: {p['error']:+.1%}" for p in points if p["error"] is not None), flush=True)
    path = write_result("validate_gpu", {"device": device.display_name, "precision": args.precision,
                                         "fixed_costs": costs, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
