"""On a real GPU: traced vs measured memory for the zoo, predicted vs found max batch, compiled steps.

For each zoo model:
- allocated: trace the peak at two batch sizes and at the predicted maximum (batchfit.estimate's
  tracer) and run the same steps on the GPU (torch.cuda.max_memory_allocated, reset per probe);
- reserved: the allocator model's peak reserved bytes for a fresh process (the virtual device with
  ``limit='reserved'``) against a real fresh process (``probe_isolated``: spawned, two steps,
  torch.cuda.max_memory_reserved);
- search: the largest batch found with `guided` on the GPU against the traced prediction.
Then, for ``--compile-models``: the measured peak of the eager step against the same step under
``torch.compile`` (inductor, CUDA), beside the traced eager peak: what a compiled model traced as
eager gets wrong on a GPU (issue 20).
Also measures the two fixed costs batchfit assumes: the CUDA context and the cuBLAS workspace.
Writes benchmarks/results/validate_gpu-<date>.json. Goal: traced within 3% of measured.

    python benchmarks/validate_gpu.py [--models ...] [--precision bf16-mixed] [--max 4096]
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from _common import write_result
from batchfit import StepOptions, estimate, find_max_batch, parse_target
from batchfit.devices import detect_cuda_device
from batchfit.probe.runner import probe_isolated, probe_once
from batchfit.targets import Target
from batchfit.train.step import TrainingStep
from batchfit.zoo import ZOO

GiB = 2**30
DEFAULT_MODELS = "gpt-tinystories-22m,gpt2-124m,llama-1b,byte-elman-400m"


def fixed_costs() -> dict:
    """The CUDA context (outside the allocator) and the cuBLAS workspace (inside it)."""
    torch.cuda.init()
    torch.empty(1, device="cuda")
    free, total = torch.cuda.mem_get_info()
    context = total - free - torch.cuda.memory_reserved()
    a = torch.randn(256, 256, device="cuda")
    before = torch.cuda.memory_allocated()
    (a @ a).sum().item()
    workspace_forward = torch.cuda.memory_allocated() - before - 256 * 256 * 4 - 512
    return {"cuda_context_bytes": context, "cublas_workspace_main_thread_bytes": workspace_forward,
            "total_bytes": total}


def relative(traced: int | None, measured: int | None) -> float | None:
    return None if not traced or not measured else round((traced - measured) / measured, 4)


def reserved_rows(model: str, workload, options: StepOptions, virtual: Target, batch_sizes: list[int]) -> list[dict]:
    rows = []
    for b in batch_sizes:
        traced = probe_once(workload, options, virtual, b, limit="reserved")
        real = probe_isolated(model, None, options, parse_target("cuda"), b, limit="reserved")
        rows.append({"batch_size": b, "traced_status": traced.status, "measured_status": real.status,
                     "traced_reserved_bytes": traced.peak_reserved_bytes,
                     "measured_reserved_bytes": real.peak_reserved_bytes,
                     "traced_allocated_bytes": traced.peak_allocated_bytes,
                     "measured_allocated_bytes": real.peak_allocated_bytes,
                     "reserved_error": relative(traced.peak_reserved_bytes, real.peak_reserved_bytes)})
    return rows


def measured_step(workload, options: StepOptions, batch_size: int, compiled: bool) -> dict:
    """Peak allocated / reserved of the third real step (the first two compile and warm up)."""
    step = TrainingStep(workload, options, torch.device("cuda"))
    if compiled:
        step.model = torch.compile(step.model)
    try:
        for _ in range(2):
            step.run(batch_size)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        step.run(batch_size)
        torch.cuda.synchronize()
        return {"peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
                "step_time_s": round(time.perf_counter() - started, 4)}
    finally:
        del step
        gc.collect()
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=DEFAULT_MODELS)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--max", type=int, default=4096)
    parser.add_argument("--compile-models", default="gpt-tinystories-22m:64,gpt2-124m:8,llama-1b:4")
    parser.add_argument("--skip-search", action="store_true")
    parser.add_argument("--name", default="validate_gpu", help="results file: benchmarks/results/<name>-<date>.json")
    args = parser.parse_args()
    costs = fixed_costs()
    device = detect_cuda_device()
    target = parse_target("cuda")
    virtual = Target("virtual", device, f"virtual:{device.display_name}")
    options = StepOptions(precision=args.precision)
    rows = []
    for model in filter(None, args.models.split(",")):
        workload = ZOO[model]()
        traced = estimate(workload, device=device, options=options, max_batch=args.max, suggest=False)
        points = []
        chosen = traced.points[:2] + ([traced.point(traced.max_batch_size)] if traced.max_batch_size else [])
        for point in chosen:
            trial = probe_once(workload, options, target, point.batch_size)
            measured = trial.peak_allocated_bytes
            points.append({"batch_size": point.batch_size, "traced_bytes": point.peak_bytes, "status": trial.status,
                           "measured_allocated_bytes": measured, "measured_reserved_bytes": trial.peak_reserved_bytes,
                           "error": relative(point.peak_bytes, measured), "step_time_s": trial.step_time_s})
        reserved = reserved_rows(model, workload, options, virtual, [p.batch_size for p in traced.points[:2]])
        row = {"model": model, "points": points, "reserved": reserved, "predicted_max": traced.max_batch_size,
               "tokens_per_sample": workload.tokens_per_sample}
        if not args.skip_search:
            started = time.perf_counter()
            found = find_max_batch(workload, target=target, options=options, largest=args.max)
            row.update({"found_max": found.max_batch_size,
                        "found_exact": bool(found.search and found.search.exact),
                        "search_probes": len(found.search.trials) if found.search else None,
                        "search_seconds": round(time.perf_counter() - started, 1),
                        "step_time_s_at_max": (found.trial(found.max_batch_size).step_time_s
                                               if found.max_batch_size else None)})
        rows.append(row)
        print(f"{model:20s} predicted {row['predicted_max']:5d} found {row.get('found_max', '-')!s:>5} "
              + "  ".join(f"b{p['batch_size']}: {p['error']:+.1%}" for p in points if p["error"] is not None)
              + "  reserved " + "  ".join(f"b{r['batch_size']}: {r['reserved_error']:+.1%}"
                                          for r in reserved if r["reserved_error"] is not None), flush=True)
    compiled_rows = []
    for item in filter(None, args.compile_models.split(",")):
        model, _, batch = item.partition(":")
        workload = ZOO[model]()
        b = int(batch)
        traced = estimate(workload, device=device, options=options, batch_sizes=[b], suggest=False).point(b)
        eager = measured_step(workload, options, b, compiled=False)
        try:
            compiled = measured_step(workload, options, b, compiled=True)
        except Exception as error:  # noqa: BLE001 - record why, go on
            compiled = {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
        compiled_rows.append({"model": model, "batch_size": b, "traced_eager_bytes": traced.peak_bytes,
                              "eager": eager, "compiled": compiled,
                              "compiled_vs_eager": relative(compiled.get("peak_allocated_bytes"),
                                                            eager["peak_allocated_bytes"]),
                              "traced_eager_vs_compiled": relative(traced.peak_bytes,
                                                                   compiled.get("peak_allocated_bytes"))})
        print(f"compile {model:20s} b{b}: eager {eager['peak_allocated_bytes'] / GiB:.3f} GiB, compiled "
              f"{compiled.get('peak_allocated_bytes', 0) / GiB:.3f} GiB, traced eager "
              f"{traced.peak_bytes / GiB:.3f} GiB",
              flush=True)
    path = write_result(args.name, {"device": device.display_name, "precision": args.precision,
                                         "torch": torch.__version__, "fixed_costs": costs, "rows": rows,
                                         "compiled": compiled_rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
