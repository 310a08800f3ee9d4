"""The recipes people train with, traced against a real CPU step: the traced peak (CPU semantics:
no 512 B rounding, CPU kernels) against the torch profiler's memory timeline of the same step.

One row per recipe: (recipe, traced bytes, CPU truth bytes, error). The model is the zoo's
gpt-tinystories-22m (Llama-style: 4 blocks, d 512, 16 heads, SwiGLU 1344, no biases, vocab
10000), fp32 AdamW, batch 4 x 256 tokens. Writes benchmarks/results/recipes-<date>.json.

    python benchmarks/recipes.py [--model gpt-tinystories-22m] [--batch-size 4] [--seq-len 256]

Checkpointing recipes: none, full, every:2 (torchtitan's layer AC: blocks 1 and 3 of 4),
selective (torchtitan's per-op SAC), and a user's own ``create_selective_checkpoint_contexts``
policy that keeps every mm output (the model applies it; --checkpointing stays none). That one
calls checkpoint() with its default preserve_rng_state=True, so the real CPU step also keeps the
CPU generator's state (5,056 bytes) per block: host memory on a GPU, not counted by the trace.

Loss recipes (``train/losses.py``): chunked:8 (torchtune's chunked cross-entropy) and
fused-linear (a torch-native mirror of Liger's fused linear cross-entropy), in fp32 and under
bf16-mixed autocast (CPU autocast on both sides: the trace runs with CPU semantics); the
"checkpointing none" row is the fp32 plain loss.

torch.compile recipes (``trace/compiled.py``): --compile model in fp32, under bf16-mixed, and
with --memory-budget 0.5; the truth is the same step compiled with inductor on this CPU (the
third step: inductor compiles in the first).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from _common import write_result
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from batchfit.train.model import block_list
from batchfit.train.step import TrainingStep
from batchfit.trace.session import TraceSession
from batchfit.workload import StepOptions, Workload
from batchfit.zoo import ZOO


def user_sac(workload: Workload) -> Workload:
    """The user's model wraps each block in checkpoint() with its own SAC policy: save mm outputs."""
    def build_model():
        model = workload.build_model()
        context_fn = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
        for block in block_list(model):
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False, context_fn=context_fn)
        return model

    return dataclasses.replace(workload, build_model=build_model)


# recipe -> (how the workload changes, the step options)
RECIPES: dict[str, tuple[Callable[[Workload], Workload], StepOptions]] = {
    "checkpointing none": (lambda w: w, StepOptions(checkpointing="none")),
    "checkpointing full": (lambda w: w, StepOptions(checkpointing="full")),
    "checkpointing every:2": (lambda w: w, StepOptions(checkpointing="every:2")),
    "checkpointing selective": (lambda w: w, StepOptions(checkpointing="selective")),
    "user SAC policy (save mm)": (user_sac, StepOptions(checkpointing="none")),
    "loss chunked:8": (lambda w: w, StepOptions(loss="chunked:8")),
    "loss fused-linear": (lambda w: w, StepOptions(loss="fused-linear")),
    "bf16-mixed loss plain": (lambda w: w, StepOptions(precision="bf16-mixed")),
    "bf16-mixed loss chunked:8": (lambda w: w, StepOptions(precision="bf16-mixed", loss="chunked:8")),
    "bf16-mixed loss fused-linear": (lambda w: w, StepOptions(precision="bf16-mixed", loss="fused-linear")),
    "compile model": (lambda w: w, StepOptions(compile="model")),
    "bf16-mixed compile model": (lambda w: w, StepOptions(precision="bf16-mixed", compile="model")),
    "compile model memory-budget 0.5": (lambda w: w, StepOptions(compile="model", memory_budget=0.5)),
}


def traced_peak(workload: Workload, options: StepOptions, batch_size: int) -> int:
    with TraceSession(workload, options, cuda_semantics=False) as session:
        return session.trace(batch_size).snapshot.peak_bytes


def profiled_peak(workload: Workload, options: StepOptions, batch_size: int) -> int:
    """The profiler's memory timeline over the second real CPU step (the first made the
    optimizer state, as in the trace): the largest total of live bytes."""
    torch.manual_seed(0)
    step = TrainingStep(workload, options, torch.device("cpu"))
    for _ in range(2 if options.compile != "none" else 1):  # compiled: inductor compiles in the first
        step.run(batch_size)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        step.run(batch_size)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "timeline.json"
        prof.export_memory_timeline(str(path), device="cpu")
        _, sizes = json.loads(path.read_text())
    return max(sum(row) for row in sizes)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt-tinystories-22m")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated names of RECIPES")
    parser.add_argument("--name", default="recipes", help="results/<name>-<date>.json (e.g. recipes-<branch>)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # the profiler's FutureWarning on export_memory_timeline
    base = ZOO[args.model](seq_len=args.seq_len)
    rows = []
    print(f"{args.model}, batch {args.batch_size} x {args.seq_len} tokens, fp32 AdamW, on this CPU")
    print(f"{'recipe':<32} {'traced B':>13} {'CPU truth B':>13} {'error':>9} {'seconds':>8}")
    for name in args.recipes.split(","):
        change, options = RECIPES[name]
        workload = change(base)
        started = time.perf_counter()
        traced = traced_peak(workload, options, args.batch_size)
        measured = profiled_peak(workload, options, args.batch_size)
        seconds = time.perf_counter() - started
        error = (traced - measured) / measured
        rows.append({"recipe": name, "options": options.to_json(), "traced_bytes": traced,
                     "cpu_truth_bytes": measured, "error": error, "seconds": round(seconds, 1)})
        print(f"{name:<32} {traced:>13,} {measured:>13,} {error:>+9.4%} {seconds:>8.1f}", flush=True)
    path = write_result(args.name, {
        "model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len, "precision": "fp32",
        "truth": "torch.profiler export_memory_timeline peak of the same real CPU step (the second one)",
        "traced": "TraceSession(cuda_semantics=False) peak", "rows": rows,
        "notes": "user SAC policy: the real step also keeps torch.get_rng_state() (5,056 B) per checkpointed "
                 "block (preserve_rng_state=True); on a GPU that is host memory, so the trace leaves it out. "
                 "bf16-mixed loss fused-linear: the real step holds 149 KB (0.03%) more than the trace, "
                 "not explained yet (the same loss on tests/test_losses.py's model is within 48 B)"})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
