"""torch.compile's activation memory budget (``--memory-budget F``): the traced curve of peak
against budget, each point checked against the same step compiled with inductor on this CPU.

The curve is traced point by point, never assumed monotonic: a smaller budget can peak higher
(pytorch/pytorch#197838, "activation_memory_budget: physical peak allocated memory is
non-monotonic across budgets": the knapsack caps the saved activations, not the peak, and what
it stops saving is recomputed in backward, where the recomputed tensors can meet a larger
peak). The model: a small HF Llama (hidden 256, 4 heads, SwiGLU 688, vocab 2048, seq 128),
fp32 AdamW. Writes benchmarks/results/memory_budget-<date>.json.

    python benchmarks/memory_budget.py [--layers 2] [--batch-size 4] [--budgets 1,0.8,0.5,0.3,0.1,0]
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from _common import write_result
from batchfit.trace.session import TraceSession
from batchfit.workload import StepOptions, Workload
from recipes import profiled_peak  # the third step, compiled: inductor compiles in the first


def llama(layers: int, seq_len: int = 128) -> Workload:
    def build():
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688,
                                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                                            max_position_embeddings=seq_len, attn_implementation="sdpa"))

    return Workload(name=f"llama-{layers}l", build_model=build,
                    make_batch=lambda b, d: torch.randint(0, 2048, (b, seq_len), device=d),
                    loss_fn=lambda m, x: m(input_ids=x, labels=x).loss, tokens_per_sample=seq_len)


def traced_peak(workload: Workload, options: StepOptions, batch_size: int) -> int:
    with TraceSession(workload, options, cuda_semantics=False) as session:
        assert session.compiled
        return session.trace(batch_size).snapshot.peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--budgets", default="1,0.8,0.5,0.3,0.1,0")
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # the profiler's FutureWarning on export_memory_timeline
    workload = llama(args.layers)
    rows = []
    print(f"{workload.name}, batch {args.batch_size} x 128, {args.precision} AdamW, --compile model, on this CPU")
    print(f"{'budget':>6} {'traced B':>13} {'inductor B':>13} {'error':>9} {'seconds':>8}")
    for budget in (float(b) for b in args.budgets.split(",")):
        options = StepOptions(compile="model", memory_budget=budget, precision=args.precision)
        started = time.perf_counter()
        traced = traced_peak(workload, options, args.batch_size)
        measured = profiled_peak(workload, options, args.batch_size)
        seconds = time.perf_counter() - started
        error = (traced - measured) / measured
        rows.append({"budget": budget, "traced_bytes": traced, "cpu_truth_bytes": measured, "error": error,
                     "seconds": round(seconds, 1)})
        print(f"{budget:>6g} {traced:>13,} {measured:>13,} {error:>+9.4%} {seconds:>8.1f}", flush=True)
    by_budget = sorted(rows, key=lambda row: -row["budget"])
    rises = [f"{a['budget']:g} -> {b['budget']:g}" for a, b in zip(by_budget, by_budget[1:])
             if b["cpu_truth_bytes"] > a["cpu_truth_bytes"]]
    path = write_result("memory_budget", {
        "model": workload.name, "batch_size": args.batch_size, "seq_len": 128, "precision": args.precision,
        "truth": "torch.profiler export_memory_timeline peak of the same real CPU step compiled with inductor "
                 "(the third step), torch._functorch.config.activation_memory_budget set while inductor compiles",
        "traced": "TraceSession(cuda_semantics=False) peak, --compile model --memory-budget F", "rows": rows,
        "truth_rises_as_budget_falls": rises,
        "upstream": "https://github.com/pytorch/pytorch/issues/197838 (peak non-monotonic across budgets)"})
    print(f"a smaller budget peaked higher (inductor): {', '.join(rises) or 'nowhere here'}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
