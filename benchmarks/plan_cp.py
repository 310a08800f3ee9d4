"""Context parallelism on a Llama-3.1-8B-shaped model at sequence 32768 on 8 H100s: fsdp on the whole
sequence against fsdp+cp2 / cp4 / cp8 (torch's ring attention, traced on the fake process group).

Shape: d_model 4096, 32 heads (8 KV, repeated before attention as torchtitan's Llama does), FFN
14336, vocab 128256, 32 layers, untied; bf16-mixed FSDP2 over dp x cp, full activation
checkpointing, AdamW. ``batchfit.plan`` itself runs (the depth-2/3/4 traces extrapolated to 32
blocks, each local batch found and confirmed), with ``--limit allocated`` (the reserved replay of
four strategies does not fit this machine's minutes; allocated is what the trace counts).

Printed beside each plan row: the ring's bytes rank 0 moves per step on the cp group (the time
model's "cp" collective) and, by hand, what one attention layer's forward all-gathers:
N x 2 x b x 32 heads x S/N x 128 x 2 B (bf16), which the traced collective must equal.

    PYTHONPATH=src python benchmarks/plan_cp.py [--seq-len 32768] [--gpus 8] [--global-batch 8]
    PYTHONPATH=src python benchmarks/plan_cp.py --seq-len 131072 --gpus 16 --global-batch 16 \
        --strategies fsdp,fsdp+cp8,fsdp+cp16,fsdp+cp8+tp2
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _common import write_result  # noqa: E402

GIB = 2**30
HEADS, HEAD_DIM, LAYERS = 32, 128, 32


def workload(seq_len: int):
    from batchfit.zoo import language_model_workload
    from batchfit.zoo.transformer import Transformer, TransformerConfig

    cfg = TransformerConfig(vocab_size=128256, seq_len=seq_len, d_model=4096, n_layers=LAYERS, n_heads=HEADS,
                            n_kv_heads=8, d_ff=14336, llama=True, tied_embeddings=False)
    return language_model_workload(name="llama-3.1-8b-shaped", build_model=lambda: Transformer(cfg),
                                   vocab_size=cfg.vocab_size, seq_len=seq_len,
                                   description=f"Llama-3.1-8B-shaped, 32 layers, seq {seq_len}")


def main() -> None:
    from batchfit.devices import get_device
    from batchfit.plan.engine import plan
    from batchfit.plan.world import parse_worlds
    from batchfit.workload import StepOptions

    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--strategies", default="fsdp,fsdp+cp2,fsdp+cp4,fsdp+cp8")
    parser.add_argument("--global-batch", type=int, default=8)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    device = get_device("h100-80gb")
    options = StepOptions(precision="bf16-mixed", checkpointing="full")
    started = time.perf_counter()
    result = plan(workload(args.seq_len), device=device, worlds=parse_worlds(str(args.gpus), None, None),
                  options=options, strategies=args.strategies, global_batch=args.global_batch, processes=1,
                  limit="allocated",
                  progress=lambda line: print(f"[{time.perf_counter() - started:6.0f} s] {line}", flush=True))
    seconds = time.perf_counter() - started
    data = result.to_json()
    rows = []
    for row in data["strategies"]:
        name = row["strategy"]
        cp = int(name.split("cp")[1].split("+")[0]) if "+cp" in name else 1
        points = {p["local_batch"]: p for p in row["points"]}
        micro = row.get("micro_batch")
        timing = row.get("time") or {}
        cp_sent = (timing.get("bytes_sent") or {}).get("cp", 0)
        kv_gather_by_hand = cp * 2 * (micro or 1) * HEADS * (args.seq_len // cp) * HEAD_DIM * 2 if cp > 1 else 0
        rows.append({
            "strategy": name, "cp": cp, "dp": row["dp"], "max_local_batch": row.get("max_local_batch"),
            "micro_batch": micro, "accumulation_steps": row.get("accumulation_steps"),
            "peak_gib_at_micro": round((row.get("peak_bytes_at_micro") or 0) / GIB, 2),
            "peak_gib_at_local_1": round(points[1]["peak_bytes"] / GIB, 2) if 1 in points else None,
            "activations_gib_at_local_1": (round(points[1]["breakdown"]["activations"] / GIB, 2)
                                           if 1 in points else None),
            "tokens_per_s": row.get("tokens_per_s"), "step_time_s": row.get("step_time_s"),
            "cp_bytes_sent_per_micro_batch": cp_sent, "cp_seconds_per_micro_batch":
                (timing.get("communication_s") or {}).get("cp", 0.0),
            "kv_all_gather_bytes_per_layer_by_hand": kv_gather_by_hand,
            "fix": row.get("fix"),
        })
    print(f"\nLlama-3.1-8B-shaped at seq {args.seq_len} on {args.gpus} H100 80GB, bf16-mixed, full AC, "
          f"global batch {args.global_batch} ({seconds:.0f} s)")
    print(f"{'strategy':<12} {'dp':>3} {'max local':>9} {'micro x acc':>11} {'GiB@micro':>9} {'GiB@b1':>7} "
          f"{'tokens/s':>10} {'cp GB/micro':>11}")
    for r in rows:
        acc = f"{r['micro_batch']} x {r['accumulation_steps']}" if r["micro_batch"] else "-"
        print(f"{r['strategy']:<12} {r['dp']:>3} {r['max_local_batch'] or 0:>9} {acc:>11} "
              f"{r['peak_gib_at_micro']:>9.2f} "
              f"{r['peak_gib_at_local_1'] or 0:>7.2f} {r['tokens_per_s'] or 0:>10,.0f} "
              f"{r['cp_bytes_sent_per_micro_batch'] / 1e9:>11.2f}")
    path = write_result(f"plan_cp-seq{args.seq_len}", {
        "model": "Llama-3.1-8B-shaped (zoo Transformer: K/V repeated to 32 heads before SDPA, as torchtitan's Llama)",
        "gpus": args.gpus, "gpu": "h100-80gb", "precision": "bf16-mixed", "checkpointing": "full",
        "seq_len": args.seq_len, "global_batch": args.global_batch, "limit": "allocated",
        "method": "batchfit.plan: rank 0 traced on the fake process group with torch's ring attention "
                  "(context_parallel's dispatcher and _context_parallel_buffers), depths 2/3/4 extrapolated",
        "rows": rows, "seconds": round(seconds, 1), "approximations": data.get("approximations"),
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
