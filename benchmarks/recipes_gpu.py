"""On a real GPU: this round's recipes, traced (CUDA semantics, fake tensors) against the same step measured.

One row per recipe: the traced peak (``estimate`` on the GPU found here, ``peak_bytes``: what
``torch.cuda.max_memory_allocated()`` would show) against a real step in this process
(``probe_once``: two steps at the batch, the peak allocated reset before them), and the
approximations the trace printed. The recipes: activation checkpointing (full, selective,
every:2), the chunked and fused-linear losses, torch.compile (model, blocks; the real step is
inductor's), activation offloading, Muon, on gpt2-124m (zoo, seq 1024) and the Hugging Face
Llama 3.2 1B built from its config (SDPA, seq 2048). The CPU truths of the same recipes are
``recipes.py`` (the torch profiler on a CPU step); this is the GPU's word on them.

Cases run in the order given and the results file is written after each, so a run stopped at a
time limit keeps what it measured; ``--budget-s`` starts no case past that many seconds.
Writes benchmarks/results/<name, default recipes_gpu>-<date>.json.

    python benchmarks/recipes_gpu.py [--cases LABEL,LABEL] [--budget-s 420]
"""

from __future__ import annotations

import argparse
import gc
import time
import traceback

import torch

from _common import write_result
from batchfit import StepOptions, estimate, load_workload, parse_target
from batchfit.devices import detect_cuda_device, get_device
from batchfit.probe.runner import probe_once
from validate_gpu import relative

GPT2 = ("gpt2-124m", None, 8)
LLAMA = ("hf:llama-3.2-1b", 2048, 2)
BF16 = {"precision": "bf16-mixed"}
# (label, (model, seq_len, batch), options): most telling first, since a run may stop at its budget
CASES = [
    ("gpt2 bf16", GPT2, BF16),
    ("gpt2 bf16 selective", GPT2, {**BF16, "checkpointing": "selective"}),
    ("gpt2 bf16 full", GPT2, {**BF16, "checkpointing": "full"}),
    ("gpt2 bf16 chunked:8", GPT2, {**BF16, "loss": "chunked:8"}),
    ("gpt2 bf16 fused-linear", GPT2, {**BF16, "loss": "fused-linear"}),
    ("gpt2 bf16 compile model", GPT2, {**BF16, "compile": "model"}),
    ("llama bf16", LLAMA, BF16),
    ("llama bf16 selective", LLAMA, {**BF16, "checkpointing": "selective"}),
    ("gpt2 bf16 offload activations", GPT2, {**BF16, "offload": "activations"}),
    ("gpt2 bf16 muon", GPT2, {**BF16, "optimizer": "muon"}),
    ("gpt2 bf16 every:2", GPT2, {**BF16, "checkpointing": "every:2"}),
    ("gpt2 fp32", GPT2, {"precision": "fp32"}),
    ("gpt2 bf16 compile blocks selective", GPT2, {**BF16, "compile": "blocks", "checkpointing": "selective"}),
    ("llama bf16 compile model", LLAMA, {**BF16, "compile": "model"}),
]


def run_case(label: str, model: str, seq_len: int | None, batch_size: int, options: dict, device,
             measure: bool = True) -> dict:
    workload = load_workload(model, seq_len=seq_len)
    step_options = StepOptions(**options)
    started = time.perf_counter()
    traced = estimate(workload, device=device, options=step_options, batch_sizes=[batch_size], suggest=False)
    trace_s = time.perf_counter() - started
    point = traced.point(batch_size)
    if not measure:
        return {"label": label, "traced_bytes": point.peak_bytes, "trace_s": round(trace_s, 1),
                "approximations": [a.to_json() for a in traced.approximations]}
    started = time.perf_counter()
    trial = probe_once(workload, step_options, parse_target("cuda"), batch_size, limit="allocated")
    measure_s = time.perf_counter() - started
    return {"label": label, "model": model, "seq_len": workload.tokens_per_sample, "batch_size": batch_size,
            "options": options, "traced_bytes": point.peak_bytes, "traced_phase": point.phase,
            "measured_status": trial.status, "measured_error": trial.error,
            "measured_allocated_bytes": trial.peak_allocated_bytes,
            "measured_reserved_bytes": trial.peak_reserved_bytes,
            "error": relative(point.peak_bytes, trial.peak_allocated_bytes),
            "approximations": [a.to_json() for a in traced.approximations],
            "trace_s": round(trace_s, 1), "measure_s": round(measure_s, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="", help="labels to run, comma-separated (default: all, in order)")
    parser.add_argument("--budget-s", type=float, default=420, help="start no case after this many seconds")
    parser.add_argument("--name", default="recipes_gpu", help="results file: benchmarks/results/<name>-<date>.json")
    parser.add_argument("--trace-only", metavar="GPU", help="no GPU here: trace every case for this catalog GPU, "
                        "measure none (checks the cases before a GPU's time is spent on them)")
    args = parser.parse_args()
    wanted = [c for c in args.cases.split(",") if c]
    device = get_device(args.trace_only) if args.trace_only else detect_cuda_device()
    began = time.perf_counter()
    rows, skipped = [], []
    for label, (model, seq_len, batch_size), options in CASES:
        if wanted and label not in wanted:
            continue
        if time.perf_counter() - began > args.budget_s:
            skipped.append(label)
            continue
        try:
            row = run_case(label, model, seq_len, batch_size, options, device, measure=not args.trace_only)
        except Exception as error:  # noqa: BLE001 - record why, go on to the next recipe
            row = {"label": label, "failed": f"{type(error).__name__}: {error}".splitlines()[0],
                   "traceback": traceback.format_exc()[-2000:]}
        rows.append(row)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        print(_line(row), flush=True)
        if not args.trace_only:
            write(args.name, device, rows, skipped)
    if args.trace_only:
        return
    print(f"wrote {write(args.name, device, rows, skipped)}")


def _line(row: dict) -> str:
    traced = f"{row['label']:38s} traced {row.get('traced_bytes', 0) / 2**30:7.3f} GiB"
    if "failed" in row:
        return f"{traced}  failed: {row['failed']}"
    if "measured_status" not in row:
        return f"{traced}  ({row['trace_s']} s, not measured)"
    if row["error"] is None:
        return f"{traced}  measured {row['measured_status']}: {row['measured_error']}"
    return f"{traced}  measured {row['measured_allocated_bytes'] / 2**30:7.3f} GiB  {row['error']:+.2%}"


def write(name: str, device, rows: list[dict], skipped: list[str]):
    return write_result(name, {"device": device.display_name, "torch": torch.__version__, "rows": rows,
                               "not_run_past_budget": skipped})


if __name__ == "__main__":
    main()
