"""On a real GPU: a variable-length fine-tuning loop, step by step, against batchfit's prediction (issue 32).

The model: a 2-layer Llama of hidden 256 (vocab 8,192, 4 heads, FFN 688), built from its config, no
weights. The data: ``--samples`` lengths drawn from a lognormal (numpy default_rng(32), mean 5.0,
sigma 0.7 of the log: median e^5 = 148 tokens), clipped to 16..2,048 tokens; batches of
``--batch`` samples in the data's order, each padded to its longest (pad-longest). The loop:
batchfit's one training step (``train/step.py``, the step every engine runs) on CUDA, one
optimizer for the whole run, ``--steps`` steps; after each, ``torch.cuda.max_memory_allocated``,
``memory_allocated``, ``max_memory_reserved`` and ``memory_reserved`` (peaks reset before each step).

The prediction, made before the loop on fake tensors, for the GPU found:
- every step's allocated and reserved peak and reserved at its end: the same steps in the same order
  through the caching allocator model (``estimator/churn.py``, what ``--replay-steps`` runs);
- the run's peak and its step (``estimator/run.py``, what ``estimate --data --batching pad-longest``
  answers at this batch);
- the eval loop's peak after training (``estimator/eval_phase.py``, ``--eval-batch-size``): the same
  data in eval batches of ``--eval-batch``, each step ``TrainingStep.evaluate`` (no gradients, whole logits).
Writes benchmarks/results/run_gpu-<date>.json. One command, well under 10 minutes on one GPU:

    python benchmarks/run_gpu.py                       # 300 steps of batch 8, bf16-mixed
    python benchmarks/run_gpu.py --device cpu --steps 5  # no GPU: the CPU dry run (profiler vs trace)

``--device cpu``: the same loop on this CPU, each step's peak read by the torch profiler against the
trace with CPU semantics (``estimator.run.step_peaks``), then one eval step at the worst eval batch
(the profiler's peak plus the optimizer state's bytes, which no eval op reads); prints, writes nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 688,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 8192,
          "max_position_embeddings": 2048, "tie_word_embeddings": False}


def lengths_of(samples: int) -> list[int]:
    rng = np.random.default_rng(32)
    return [int(n) for n in np.clip(rng.lognormal(mean=5.0, sigma=0.7, size=samples), 16, 2048)]


def model_folder() -> str:
    folder = Path(tempfile.mkdtemp(prefix="run_gpu-llama-"))
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return f"hf:{folder}"


def rel(predicted: int | None, measured: int | None) -> float | None:
    return None if predicted is None or not measured else round((predicted - measured) / measured, 5)


def cpu_dry_run(at_of, shapes, eval_shape, options) -> None:
    """The loop on this CPU, each step's profiled peak against its trace with CPU semantics."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from batchfit.estimator.run import step_peaks
    from batchfit.train.step import TrainingStep
    from cpu_truth import profiled_peak, profiled_step_peak

    predicted = step_peaks(at_of(), shapes, options, cuda_semantics=False)
    real = at_of()
    torch.manual_seed(0)
    step = TrainingStep(real.varying([s.length for s in shapes]), options, torch.device("cpu"))
    real.length = shapes[0].length
    step.run(shapes[0].rows)  # the optimizer state, as the trace's first step makes it
    with tempfile.TemporaryDirectory() as tmp:
        for i, shape in enumerate(shapes):
            real.length = shape.length
            measured = profiled_step_peak(step, shape.rows, Path(tmp), warmup=0)
            print(f"step {i} ({shape.rows} x {shape.length} tokens): traced {predicted[i]:,} B, "
                  f"profiler {measured:,} B ({rel(predicted[i], measured):+.4%})")
        # the eval loop after the last step: the profiler knows a block only once an op reads it, and no
        # op of an eval step reads the optimizer state, so its bytes (real tensors, counted) are added
        traced = predicted_eval(at_of(), shapes[-1], eval_shape, options, cuda_semantics=False)
        real.select(eval_shape.length)
        state_bytes = sum(t.nbytes for state in step.optimizer.state.values() for t in state.values()
                          if isinstance(t, torch.Tensor))
        measured = profiled_peak(lambda: step.evaluate(eval_shape.rows), Path(tmp)) + state_bytes
        print(f"eval ({eval_shape.rows} x {eval_shape.length} tokens): traced {traced:,} B, "
              f"profiler {measured:,} B ({rel(traced, measured):+.4%})")


def predicted_eval(at, train_shape, eval_shape, options, device=None, *, cuda_semantics: bool = True) -> int:
    """The eval step's allocated peak after a training step at ``train_shape`` (``estimator/eval_phase.py``),
    less the cuBLAS workspace on the CPU (a CPU step has none)."""
    from batchfit.devices import custom_device
    from batchfit.estimator.eval_phase import EvalTracer

    device = device or custom_device(2**40)
    tracer = EvalTracer(at.varying([]), at.select, train_shape, options, device, cuda_semantics=cuda_semantics)
    try:
        peak = tracer.point(eval_shape).peak_bytes
    finally:
        tracer.close()
    return peak if cuda_semantics else peak - device.workspace_bytes


def predict(load, at_of, lengths: list[int], shapes, options, device, batch: int):
    """(every step through the allocator model, the run's answer at ``batch``): on fake tensors, no GPU."""
    from batchfit.estimator.batching import Batching
    from batchfit.estimator.churn import churn
    from batchfit.estimator.request import EstimateRequest, RunRequest
    from batchfit.estimator.run import estimate_run

    replayed = churn(at_of(), shapes, batch, options, device)
    run = estimate_run(load, lengths, RunRequest(data="lognormal(5.0, 0.7)", batching=Batching("pad-longest")),
                       EstimateRequest(batch_sizes=[batch], max_batch=batch), device=device, options=options).run
    return replayed, run.runs[batch]


def gpu_loop(at, shapes, eval_shapes, options) -> tuple[list[dict], int]:
    """The real loop on CUDA: the allocator's counters after each step; then the eval loop (its
    steps' largest max_memory_allocated)."""
    from batchfit.train.step import TrainingStep

    torch.manual_seed(0)
    step = TrainingStep(at.varying([s.length for s in shapes]), options, torch.device("cuda"))
    rows = []
    for i, shape in enumerate(shapes):
        at.length = shape.length
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step.run(shape.rows)
        torch.cuda.synchronize()
        rows.append({"step": i, "rows": shape.rows, "length": shape.length,
                     "max_allocated_bytes": torch.cuda.max_memory_allocated(),
                     "allocated_bytes": torch.cuda.memory_allocated(),
                     "max_reserved_bytes": torch.cuda.max_memory_reserved(),
                     "reserved_bytes": torch.cuda.memory_reserved()})
    eval_peak = 0
    for shape in eval_shapes:
        at.select(shape.length)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step.evaluate(shape.rows)
        torch.cuda.synchronize()
        eval_peak = max(eval_peak, torch.cuda.max_memory_allocated())
    return rows, eval_peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--samples", type=int, default=None, help="default: steps x batch")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--eval-batch", type=int, default=32, help="the eval loop after training, over the same data")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("run_gpu.py needs a CUDA GPU and found none: run it where one is "
                 "(or --device cpu --steps 5 for the CPU dry run)")
    warnings.simplefilter("ignore")
    from batchfit.estimator.batching import Batching, step_shapes
    from batchfit.estimator.run import Lengths
    from batchfit.specs import load_workload
    from batchfit.workload import StepOptions

    spec, options = model_folder(), StepOptions(precision=args.precision)
    lengths = lengths_of(args.samples or args.steps * args.batch)
    batching = Batching("pad-longest")
    shapes = step_shapes(lengths, batching, args.batch, max(lengths))[:args.steps]
    load = lambda n: load_workload(spec, seq_len=n)  # noqa: E731
    at_of = lambda: Lengths(load, max(lengths))  # noqa: E731
    print(f"{len(shapes)} steps of batch {args.batch}, pad-longest; tokens per sample median "
          f"{int(np.median(lengths))}, max {max(lengths)}; {args.precision}")
    eval_shapes = step_shapes(lengths, batching, args.eval_batch, max(lengths))
    eval_worst = max(eval_shapes, key=lambda e: (e.length, e.rows))  # a full batch at the longest: the worst
    if args.device == "cpu":
        cpu_dry_run(at_of, shapes, eval_worst, options)
        return

    from _common import write_result
    from batchfit.devices import detect_cuda_device

    device = detect_cuda_device()
    started = time.perf_counter()
    replayed, at_batch = predict(load, at_of, lengths[:len(shapes) * args.batch], shapes, options, device, args.batch)
    eval_predicted = predicted_eval(at_of(), shapes[-1], eval_worst, options, device)
    predict_s = time.perf_counter() - started
    started = time.perf_counter()
    measured, eval_measured = gpu_loop(at_of(), shapes, eval_shapes, options)
    loop_s = time.perf_counter() - started
    steps = []
    for real, model in zip(measured, replayed.default.steps):
        steps.append({**real, "predicted_max_allocated_bytes": model.peak_allocated_bytes,
                      "predicted_max_reserved_bytes": model.peak_reserved_bytes,
                      "predicted_reserved_bytes": model.reserved_bytes,
                      "allocated_rel": rel(model.peak_allocated_bytes, real["max_allocated_bytes"]),
                      "reserved_rel": rel(model.peak_reserved_bytes, real["max_reserved_bytes"])})
    peak_step = max(range(len(measured)), key=lambda i: measured[i]["max_allocated_bytes"])
    summary = {
        "steps": len(shapes), "batch": args.batch, "precision": args.precision, "model": CONFIG,
        "data": "lognormal(mean 5.0, sigma 0.7 of the log), default_rng(32), clipped 16..2048",
        "predict_s": round(predict_s, 1), "loop_s": round(loop_s, 1), "device": device.display_name,
        "replay_verdict": replayed.verdict,
        "worst_allocated_rel": max((abs(s["allocated_rel"]) for s in steps if s["allocated_rel"] is not None),
                                   default=None),
        "worst_reserved_rel": max((abs(s["reserved_rel"]) for s in steps if s["reserved_rel"] is not None),
                                  default=None),
        "run_peak_predicted_bytes": at_batch.peak_bytes, "run_peak_step_predicted": at_batch.peak_step,
        "run_peak_measured_bytes": measured[peak_step]["max_allocated_bytes"], "run_peak_step_measured": peak_step,
        "eval_batch": args.eval_batch, "eval_steps": len(eval_shapes), "eval_worst_rows": eval_worst.rows,
        "eval_worst_length": eval_worst.length, "eval_peak_predicted_bytes": eval_predicted,
        "eval_peak_measured_bytes": eval_measured, "eval_rel": rel(eval_predicted, eval_measured),
        "per_step": steps}
    path = write_result("run_gpu", summary)
    print(f"allocated per step: worst {summary['worst_allocated_rel']:+.3%}; reserved per step: worst "
          f"{summary['worst_reserved_rel']:+.3%}; run peak predicted {at_batch.peak_bytes:,} B at step "
          f"{at_batch.peak_step}, measured {summary['run_peak_measured_bytes']:,} B at step {peak_step}; eval loop "
          f"peak predicted {eval_predicted:,} B, measured {eval_measured:,} B; "
          f"predicted in {predict_s:.0f} s, loop {loop_s:.0f} s; wrote {path}")


if __name__ == "__main__":
    main()
