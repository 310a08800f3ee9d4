"""Seed 004 with ``--strategies auto``: every combination ranked by predicted tokens/s, with its memory.

Seed 004 compared two strategies by hand (FSDP over 4 ranks, "tp=1"; FSDP+TP4 with one
data-parallel rank, "tp=4") on 4 x H100-80GB for a Llama-style model ("Enoki", head_dim 64) of
28 to 48 heads at seq 2048. This plans the same setup with every combination batchfit traces
(``plan/candidates.py``: ddp, fsdp, fsdp-noreshard, zero1, zero2, hsdp2, fsdp+tp2, tp4, pp2+fsdp,
pp2+tp2, pp4; those that cannot apply listed with why) and prints the ranking beside seed 004's
published figures. The model is ``benchmarks/seed004.py``'s reconstruction (d = 64 x heads, 3/4 x
heads layers, untied 50,257 vocabulary, Llama blocks), bf16-mixed, AdamW, no activation
checkpointing, global batch 512, Chinchilla tokens (20 x parameters), the default assumed MFU 0.4.

Seed 004's "tp=4" is batchfit's ``tp4`` (TP over the 4 GPUs, one data-parallel rank: FSDP over one
rank shards nothing). Its tokens/s are measured at its largest power-of-two global batch, one step
(``iter_dt``); batchfit's comparable figure is tokens/s at the max local batch, no accumulation
(``tokens_per_s_at_max``), and the ranking's is at global batch 512 with accumulation.

    python benchmarks/plan_rank.py [--heads 28,32] [--limit allocated|reserved]

Writes benchmarks/results/plan_rank-<date>.json (each size's ``ranking``, as plan.json has it).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from _common import write_result

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batchfit import StepOptions, get_device  # noqa: E402
from batchfit.plan.engine import plan  # noqa: E402
from batchfit.plan.world import World  # noqa: E402
from seed004 import enoki  # noqa: E402 - the reconstructed model, one copy

GiB = 2**30
# heads: seed 004's summary row: params, then tp=1 and tp=4: (max global, local batch, iter_dt s, tok/s), days tp=1
SEED_004 = {
    28: ("0.99B", (32, 8, 0.607, 108e3), (32, 32, 0.995, 66e3), 2.1),
    32: ("1.41B", (32, 8, 0.779, 84e3), (16, 16, 0.770, 43e3), 3.9),
    36: ("1.95B", (32, 8, 0.985, 67e3), (16, 16, 0.957, 34e3), 6.7),
    40: ("2.62B", (32, 8, 1.430, 46e3), (16, 16, 1.330, 25e3), 13.2),
    44: ("3.42B", (16, 4, 0.920, 36e3), (8, 8, 0.912, 18e3), 22.0),
    48: ("4.39B", (16, 4, 1.100, 30e3), (8, 8, 1.060, 15e3), 33.9),
}
SEED_RANKING = ["fsdp (tp=1)", "fsdp+tp4 (tp=4)"]
"""Seed 004's conclusion: tp=1 strictly better at every size (1.5-2x the tokens/s)."""


def one(heads: int, limit: str, started: float) -> dict:
    result = plan(enoki(heads), device=get_device("h100-80gb"), worlds=[World(4)],
                  options=StepOptions(precision="bf16-mixed"), strategies="auto", global_batch=512,
                  tokens="chinchilla", limit=limit, processes=1,
                  progress=lambda m: print(f"[{time.perf_counter() - started:7.1f} s] {heads} heads: {m}", flush=True))
    by_name = {p.strategy: p for p in result.plans}
    return {"heads": heads, "params": result.params, "trace_seconds": round(result.trace_seconds, 1),
            "traces": result.traces, "ranking": [row.to_json() for row in result.ranking],
            "at_max": {name: {"max_global_batch": p.max_global_batch,
                              "step_time_s_at_max": p.time_at_max.step_time_s if p.time_at_max else None,
                              "tokens_per_s_at_max": p.tokens_per_s_at_max}
                       for name, p in by_name.items() if p.fits and not p.skipped}}


def table(size: dict) -> list[str]:
    heads = size["heads"]
    params, tp1, tp4, days = SEED_004[heads]
    lines = [f"## {heads} heads ({params} in seed 004, {size['params'] / 1e9:.2f}B traced): "
             f"{size['traces']} traced steps in {size['trace_seconds']:.0f} s", "",
             "| rank | strategy | pp | dp | tp | max global | micro x accum | GiB alloc | GiB resv | compute s | "
             "exposed comm s | bubble s | step s | tokens/s @512 | tokens/s @max | days | status |",
             "|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]

    def f(value, digits=2):
        return "—" if value is None else f"{value:,.{digits}f}"

    def micro(row) -> str:
        return f"{row['micro_batch']} x {row['accumulation_steps']}" if row["rank"] else "—"

    for row in size["ranking"]:
        at_max = size["at_max"].get(row["strategy"], {})
        speed_max = at_max.get("tokens_per_s_at_max")
        lines.append(
            f"| {row['rank'] or '—'} | {row['strategy']} | {row['pp']} | {row['dp']} | {row['tp']} | "
            f"{row['max_global_batch'] or '—'} | {micro(row)} | "
            f"{f(row['allocated_bytes'] and row['allocated_bytes'] / GiB)} | "
            f"{f(row['reserved_bytes'] and row['reserved_bytes'] / GiB)} | {f(row['compute_s'])} | "
            f"{f(row['exposed_comm_s'])} | {f(row['bubble_s'])} | {f(row['step_time_s'])} | "
            f"{f(row['tokens_per_s'], 0)} | {f(speed_max, 0)} | {f(row['days'], 1)} | "
            f"{row['status']}{': ' + row['why'][:100] if row['why'] else ''} |")
    fsdp = size["at_max"].get("fsdp", {})
    tp4_ours = size["at_max"].get("tp4", {})
    ranked = {row["strategy"]: row for row in size["ranking"]}
    ratio = (ranked["fsdp"]["tokens_per_s"] / ranked["tp4"]["tokens_per_s"]
             if ranked.get("fsdp", {}).get("tokens_per_s") and ranked.get("tp4", {}).get("tokens_per_s") else None)
    lines += ["",
              "Seed 004 (measured, its summary row) against batchfit (traced memory, computed time at MFU 0.4):", "",
              "| | seed tp=1 | batchfit fsdp | seed tp=4 | batchfit tp4 |", "|---|---:|---:|---:|---:|",
              f"| max global batch | {tp1[0]} | {fsdp.get('max_global_batch', '—')} | {tp4[0]} | "
              f"{tp4_ours.get('max_global_batch', '—')} |",
              f"| tokens/s at max global (one step) | {tp1[3]:,.0f} | {f(fsdp.get('tokens_per_s_at_max'), 0)} | "
              f"{tp4[3]:,.0f} | {f(tp4_ours.get('tokens_per_s_at_max'), 0)} |",
              f"| Chinchilla days (global 512) | {days} | {f(ranked.get('fsdp', {}).get('days'), 1)} | — | "
              f"{f(ranked.get('tp4', {}).get('days'), 1)} |",
              f"| tp=1 over tp=4 tokens/s | {tp1[3] / tp4[3]:.2f}x | {f(ratio)}x (at 512) | | |",
              f"| rank of fsdp / tp4 among every combination | — | {ranked.get('fsdp', {}).get('rank')} | — | "
              f"{ranked.get('tp4', {}).get('rank')} |", ""]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", default="28,32", help="seed 004 sizes to plan (28,32,36,40,44,48); two by default "
                                                         "(28: pp cannot split its 21 layers; 32: every rule applies)")
    parser.add_argument("--limit", default="reserved", choices=("reserved", "allocated"))
    args = parser.parse_args()
    started = time.perf_counter()
    sizes = [one(int(h), args.limit, started) for h in args.heads.split(",")]
    lines = ["# Seed 004 by `plan --strategies auto`: every combination on 4 x H100-80GB, seq 2048, global batch 512",
             "", f"Memory limit: {args.limit}. GiB = 2^30, rank 0 at the chosen micro-batch.", ""]
    for size in sizes:
        lines += table(size)
    print("\n".join(lines))
    path = write_result("plan_rank", {"seconds": round(time.perf_counter() - started, 1), "limit": args.limit,
                                      "seed_004": {str(h): SEED_004[h] for h in SEED_004},
                                      "seed_004_ranking": SEED_RANKING, "sizes": sizes})
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {path} and {path.with_suffix('.md').name}")


if __name__ == "__main__":
    main()
