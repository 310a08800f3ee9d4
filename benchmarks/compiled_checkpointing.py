"""torch.compile with activation checkpointing: the traced peak of each combination of --compile,
--checkpointing, --precision and attention kernel, against the same step compiled with inductor on
this CPU (the profiler's memory timeline, one thread and oneDNN off: tests/cpu_truth.py).

The model: a small HF Llama (hidden 128, 4 heads, 2 K/V heads, SwiGLU 256, vocab 512, 2 layers, seq
128, no KV cache: as batchfit's hf: specs build it), AdamW. ``--op-by-op`` adds the trace as it ran
before each checkpointed graph ran inductor's own wrapper code (batchfit's fusion model, op by op).
Writes benchmarks/results/compiled_checkpointing-<date>.json.

    python benchmarks/compiled_checkpointing.py [--batch-size 4] [--attention sdpa,eager]
        [--compile model,blocks] [--checkpointing full,selective,every:2] [--precision fp32,bf16-mixed]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from _common import write_result

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from batchfit.trace.session import TraceSession  # noqa: E402
from batchfit.train.step import TrainingStep  # noqa: E402
from batchfit.workload import StepOptions, Workload  # noqa: E402
from cpu_truth import profiled_step_peak, same_kernels_on_any_x86  # noqa: E402


def llama(attention: str, seq_len: int = 128) -> Workload:
    def build():
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                            attn_implementation=attention, use_cache=False))  # as hf: specs

    return Workload(name=f"llama-2l-{attention}", build_model=build,
                    make_batch=lambda b, d: torch.randint(0, 512, (b, seq_len), device=d),
                    loss_fn=lambda m, x: m(input_ids=x, labels=x).loss, tokens_per_sample=seq_len)


def traced_peak(workload: Workload, options: StepOptions, batch_size: int) -> int:
    with TraceSession(workload, options, cuda_semantics=False) as session:
        assert session.compiled
        return session.trace(batch_size).snapshot.peak_bytes


def op_by_op_peak(workload: Workload, options: StepOptions, batch_size: int) -> int:
    """The trace with every graph run op by op (batchfit's fusion model), as before checkpointed graphs
    ran inductor's wrapper."""
    from unittest import mock

    import batchfit.trace.compiled as compiled

    with mock.patch.object(compiled, "recomputes", lambda module: False), \
            mock.patch.object(compiled, "inductor_everywhere", lambda model, checkpointing: False):
        return traced_peak(workload, options, batch_size)


def truth_peak(workload: Workload, options: StepOptions, batch_size: int) -> int:
    torch.manual_seed(0)
    with same_kernels_on_any_x86(), tempfile.TemporaryDirectory() as folder:
        return profiled_step_peak(TrainingStep(workload, options, torch.device("cpu")), batch_size, Path(folder),
                                  warmup=2)


def _key(row: dict) -> tuple:
    return row["attention"], row["compile"], row["checkpointing"], row["precision"]


def _earlier_rows(rows: list[dict]) -> list[dict]:
    """Today's rows already written, but the cells in ``rows`` (measured again)."""
    import datetime
    import json

    from _common import RESULTS

    path = RESULTS / f"compiled_checkpointing-{datetime.date.today().isoformat()}.json"
    again = {_key(row) for row in rows}
    earlier = json.loads(path.read_text())["rows"] if path.exists() else []
    return [row for row in earlier if _key(row) not in again]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--attention", default="sdpa,eager")
    parser.add_argument("--compile", default="model,blocks")
    parser.add_argument("--checkpointing", default="full,selective,every:2")
    parser.add_argument("--precision", default="fp32,bf16-mixed")
    parser.add_argument("--cells", default="",
                        help="instead of the grid: attention/compile/checkpointing/precision,...")
    parser.add_argument("--op-by-op", action="store_true", help="also trace each graph op by op")
    parser.add_argument("--merge", action="store_true", help="keep today's other rows (cells not measured again)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    rows: list[dict] = []
    print(f"2-layer HF Llama, batch {args.batch_size} x 128, AdamW, on this CPU (one thread, oneDNN off)")
    print(f"{'attention':>9} {'compile':>7} {'ckpt':>9} {'precision':>10} {'traced B':>11} {'inductor B':>11} "
          f"{'error':>8} {'op by op':>8}")
    cells = ([cell.split("/") for cell in args.cells.split(",")] if args.cells else
             itertools.product(args.attention.split(","), args.compile.split(","), args.checkpointing.split(","),
                               args.precision.split(",")))
    figures = {
        "model": "HF LlamaForCausalLM, hidden 128, 4 heads (2 K/V), SwiGLU 256, vocab 512, 2 layers",
        "batch_size": args.batch_size, "seq_len": 128,
        "truth": "torch.profiler export_memory_timeline peak of the third real CPU step compiled with inductor "
                 "(one thread, oneDNN off: tests/cpu_truth.py same_kernels_on_any_x86)",
        "traced": "TraceSession(cuda_semantics=False) peak", "rows": rows}
    for attention, compile_, checkpointing, precision in cells:
        workload = llama(attention)
        options = StepOptions(compile=compile_, checkpointing=checkpointing, precision=precision)
        started = time.perf_counter()
        traced = traced_peak(workload, options, args.batch_size)
        measured = truth_peak(workload, options, args.batch_size)
        row = {"attention": attention, "compile": compile_, "checkpointing": checkpointing, "precision": precision,
               "traced_bytes": traced, "cpu_truth_bytes": measured, "error": (traced - measured) / measured}
        if args.op_by_op:
            row["op_by_op_error"] = (op_by_op_peak(workload, options, args.batch_size) - measured) / measured
        row["seconds"] = round(time.perf_counter() - started, 1)
        rows.append(row)
        if args.merge:
            figures["rows"] = [*_earlier_rows(rows), *rows]
        op_by_op = f"{row['op_by_op_error']:>+8.2%}" if args.op_by_op else ""
        print(f"{attention:>9} {compile_:>7} {checkpointing:>9} {precision:>10} {traced:>11,} {measured:>11,} "
              f"{row['error']:>+8.3%} {op_by_op}", flush=True)
        path = write_result("compiled_checkpointing", figures)  # after each row: a long run keeps what it measured
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
