"""Per-stage memory and bubble of 1F1B, interleaved 1F1B and the zero-bubble schedules (interleaved
zero bubble, ZBV) on a Llama-3.1-405B-shaped model, pp8+fsdp[-noreshard]+tp8 on 512 GPUs (H100
80GB), traced per pipeline rank on the fake process group.

Shape: d_model 16384, 128 heads (8 KV), FFN 53248, vocab 128256, sequence 8192, untied, bf16
parameters under bf16-mixed FSDP2, full activation checkpointing, AdamW. Llama 3.1 405B has 126
layers, which split into neither 8 nor 16 equal stages: this config has 128 (two more blocks,
+1.6% parameters), said in the result.

The zero-bubble schedules need FSDP2 kept gathered from forward to backward (``fsdp-noreshard``:
torch's split backward loses the weight gradients of resharded blocks), torchtitan's default under
pp; 1F1B and interleaved 1F1B are traced both ways, so each difference has one cause.

What is traced, and what extrapolated: each traced pipeline rank's stage holds 16 blocks
(1F1B) or 2 x 8 (interleaved, ZBV). Tracing 16 blocks of this width per rank per schedule
does not fit this machine's 5 minutes, so each rank is traced with 1, 2 and 3 blocks per stage
(the whole step: embeddings / head where they sit, the schedule's micro-batches, the receive
buffers, FSDP2 + TP on the fake process group) and the peak put on the line through depths 1
and 2 at the full depth; depth 3's trace checks the line (its residual is printed). Ranks 0
(embeddings, most micro-batches in flight; under ZBV the head and loss too) and 7 (head and loss,
fewest in flight, under the looped schedules) are traced. Where depth 3 is off the line by more
than 1% (the peak moved to another part of the step as the stages deepen: the zero-bubble
schedules' first rank), that rank is traced at its full depth instead, and the row says so.

    PYTHONPATH=src python benchmarks/plan_pp.py
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _common import write_result  # noqa: E402

GIB = 2**30
LAYERS = 128
PP, TP, GPUS = 8, 8, 512
MICROBATCHES = 8
LOCAL_BATCH = 8  # micro-batch 1 x 8 micro-batches per pipeline step
CHECK = 0.01
"""A row whose depth-3 trace is off the line through depths 1 and 2 by more is traced at its full depth."""
RUNS = (("1f1b", "fsdp"), ("interleaved-1f1b:2", "fsdp"), ("1f1b", "fsdp-noreshard"),
        ("interleaved-1f1b:2", "fsdp-noreshard"), ("interleaved-zb:2", "fsdp-noreshard"), ("zbv", "fsdp-noreshard"))
"""(schedule, the data-parallel wrap inside each pipeline rank)."""


def workload(n_layers: int):
    from batchfit.zoo import language_model_workload
    from batchfit.zoo.transformer import Transformer, TransformerConfig

    cfg = TransformerConfig(vocab_size=128256, seq_len=8192, d_model=16384, n_layers=n_layers, n_heads=128,
                            n_kv_heads=8, d_ff=53248, llama=True, tied_embeddings=False)
    return language_model_workload(name=f"llama-405b-shaped-{n_layers}", build_model=lambda: Transformer(cfg),
                                   vocab_size=cfg.vocab_size, seq_len=cfg.seq_len,
                                   description=f"Llama-3.1-405B-shaped, {n_layers} layers, seq 8192")


def main() -> None:
    from batchfit.devices import get_device
    from batchfit.distributed.pp_schedules import bubble_fraction, in_flight, parse_schedule, rank_actions, rank_stages
    from batchfit.plan.pipeline import PipelineSession
    from batchfit.plan.sharded import parse_strategy
    from batchfit.workload import StepOptions

    warnings.simplefilter("ignore")
    device = get_device("h100-80gb")
    options = StepOptions(precision="bf16-mixed", checkpointing="full")
    started = time.perf_counter()
    rows = []
    for name, wrap in RUNS:
        schedule = parse_schedule(name, MICROBATCHES)
        stages = PP * schedule.virtual
        full_per_stage = LAYERS // stages
        strategy = parse_strategy(f"pp{PP}+{wrap}+tp{TP}", GPUS, pp_schedule=name,
                                     microbatches=MICROBATCHES)
        by_depth: dict[int, dict[int, dict]] = {}
        for per_stage in (1, 2, 3):
            session = PipelineSession(workload(per_stage * stages), options, device, strategy, ranks=[0, PP - 1])
            session.trace(LOCAL_BATCH)
            by_depth[per_stage] = {s.rank: {"peak_bytes": s.point.peak_bytes, "phase": s.point.phase,
                                            "breakdown": s.point.breakdown} for s in session.stage_points}
            print(f"{name} ({wrap}): {per_stage} block(s) per stage traced ({time.perf_counter() - started:.0f} s)",
                  flush=True)
        for rank in (0, PP - 1):
            p1, p2, p3 = (by_depth[d][rank]["peak_bytes"] for d in (1, 2, 3))
            slope = p2 - p1
            at_full = p1 + slope * (full_per_stage - 1)
            residual = (p3 - (p1 + 2 * slope)) / p3
            method = "extrapolated from 1 and 2 blocks per stage"
            if abs(residual) > CHECK:  # the peak moved to another part of the step: trace the whole depth
                session = PipelineSession(workload(LAYERS), options, device, strategy, ranks=[rank])
                session.trace(LOCAL_BATCH)
                at_full = session.stage_points[0].point.peak_bytes
                by_depth[full_per_stage] = {rank: {"peak_bytes": at_full, "phase": session.stage_points[0].point.phase,
                                                   "breakdown": session.stage_points[0].point.breakdown}}
                method = f"traced at the full depth ({full_per_stage} blocks per stage): the depth-3 check failed"
                print(f"{name} ({wrap}) rank {rank}: traced at the full depth ({time.perf_counter() - started:.0f} s)",
                      flush=True)
            actions = rank_actions(schedule, PP, rank)
            rows.append({
                "schedule": schedule.name, "wrap": wrap, "rank": rank, "stages": rank_stages(schedule, PP, rank),
                "blocks_per_stage": full_per_stage, "in_flight_microbatch_forwards": in_flight(actions),
                "in_flight_block_activations": in_flight(actions) * full_per_stage,
                "peak_bytes": at_full, "peak_gib": round(at_full / GIB, 2),
                "per_block_stage_bytes": slope, "depth3_residual": round(residual, 4),
                "method": method,
                "traced_depths": {d: by_depth[d][rank] for d in sorted(by_depth) if rank in by_depth[d]},
                "bubble_fraction": round(bubble_fraction(schedule, PP), 4),
            })
    seconds = time.perf_counter() - started
    print(f"\nLlama-3.1-405B-shaped ({LAYERS} layers), pp{PP}+fsdp[-noreshard]+tp{TP} on {GPUS} H100 80GB, "
          f"bf16-mixed, full AC, {MICROBATCHES} micro-batches of 1 x 8192 tokens")
    print(f"{'schedule':<20} {'wrap':<15} {'rank':>4} {'stages':>8} {'in flight':>9} {'blocks x mb':>11} "
          f"{'peak GiB':>9} {'bubble':>7} {'depth-3 check':>13}")
    for r in rows:
        print(f"{r['schedule']:<20} {r['wrap']:<15} {r['rank']:>4} {','.join(map(str, r['stages'])):>8} "
              f"{r['in_flight_microbatch_forwards']:>9} {r['in_flight_block_activations']:>11} {r['peak_gib']:>9.2f} "
              f"{r['bubble_fraction']:>7.1%} {r['depth3_residual']:>+13.2%}")
    by = {(r["schedule"], r["wrap"], r["rank"]): r for r in rows}
    parts = []
    for name in ("interleaved-1f1b:2", "interleaved-zb:2", "zbv"):  # each against 1F1B, both fsdp-noreshard
        for rank in (0, PP - 1):
            row, base = by[(name, "fsdp-noreshard", rank)], by[("1f1b", "fsdp-noreshard", rank)]
            parts.append(f"{name} rank {rank}: {(row['peak_bytes'] - base['peak_bytes']) / GIB:+.2f} GiB against "
                         f"1F1B, bubble {row['bubble_fraction']:.1%} (1F1B {base['bubble_fraction']:.1%})")
    why = "; ".join(parts)
    print("\n" + why)
    print(f"({seconds:.0f} s)")
    path = write_result("plan-pp-zb-405b", {
        "model": f"Llama-3.1-405B-shaped, {LAYERS} layers (126 do not split into 8 or 16 equal stages)",
        "strategy": f"pp{PP}+fsdp+tp{TP} and pp{PP}+fsdp-noreshard+tp{TP}", "gpus": GPUS, "gpu": "h100-80gb",
        "precision": "bf16-mixed",
        "checkpointing": "full", "microbatches": MICROBATCHES, "local_batch": LOCAL_BATCH, "seq_len": 8192,
        "method": "each pipeline rank traced on the fake process group at 1, 2 and 3 blocks per stage; the peak at "
                  "the full depth on the line through 1 and 2 (extrapolated), depth 3 the check; a row whose check is "
                  f"off by more than {CHECK:.0%} traced at its full depth (each row's 'method')",
        "rows": rows, "difference": why, "seconds": round(seconds, 1),
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
