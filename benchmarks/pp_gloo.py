"""Pipeline truth on this CPU: real gloo pipelines (torch's PipelineStage with each schedule of
``--pp-schedule``: GPipe, 1F1B, interleaved 1F1B, interleaved zero bubble, ZBV, DualPipeV) of a
tiny Llama (and 1F1B, interleaved ZB and ZBV again under full activation checkpointing), each
rank's peak over a steady step (the profiler's memory timeline, two profiled
steps) against the trace of that pipeline rank on the fake process group (CPU semantics).
2 ranks: the 4-block Llama, 4 micro-batches (tests/test_pipeline.py's run); 4 ranks: 8 blocks
(8 stages under the two-stage-per-rank schedules), 8 micro-batches (DualPipeV needs one per stage).

    PYTHONPATH=src python benchmarks/pp_gloo.py [--ranks 2,4]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(Path(__file__).parent), str(ROOT / "tests")]

from _common import write_result  # noqa: E402

RUNS = {2: (4, 4), 4: (8, 8)}
"""ranks -> (blocks, micro-batches)."""
SCHEDULES = (("gpipe", "none"), ("1f1b", "none"), ("interleaved-1f1b:2", "none"), ("interleaved-zb:2", "none"),
             ("zbv", "none"), ("dualpipev", "none"), ("1f1b", "full"), ("interleaved-zb:2", "full"), ("zbv", "full"))
"""(--pp-schedule, --checkpointing) of every run, as the module docstring lists them."""


def main() -> None:
    import torch

    import pipeline_truth as t
    from batchfit.devices import get_device
    from batchfit.distributed.pp_schedules import parse_schedule, rank_actions
    from batchfit.plan.pipeline import PipelineSession
    from batchfit.plan.sharded import parse_strategy
    from batchfit.workload import StepOptions
    from cpu_truth import free_port

    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", default="2,4", help="comma-separated pipeline sizes (2, 4)")
    ranks = [int(r) for r in parser.parse_args().ranks.split(",")]
    warnings.simplefilter("ignore")
    rows = []
    started = time.perf_counter()
    for world in ranks:
        n_layers, microbatches = RUNS[world]
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp)
            for rank in range(world):
                (path / str(rank)).mkdir()
            torch.multiprocessing.spawn(t.pipeline_gloo_main, args=(free_port(), str(path), world, microbatches,
                                                                    SCHEDULES, n_layers), nprocs=world, join=True)
            real = {rank: json.loads((path / f"peaks{rank}.json").read_text()) for rank in range(world)}
        for name, checkpointing in SCHEDULES:
            for rank in range(world):  # the order torch's runtime ran is ours
                order = real[rank]["orders"].get(name)
                assert order is None or [tuple(a) for a in order] == rank_actions(
                    parse_schedule(name, microbatches), world, rank), (name, rank)
            strategy = parse_strategy(f"pp{world}", world, pp_schedule=name,
                                         microbatches=microbatches)
            session = PipelineSession(t.pipeline_workload(n_layers), StepOptions(checkpointing=checkpointing),
                                      get_device("h100-80gb"), strategy, cuda_semantics=False)
            session.trace(t.MICRO * microbatches)
            for stage in session.stage_points:
                traced = stage.point.total_peak_bytes or stage.point.peak_bytes
                measured = real[stage.rank]["peaks"][t.run_key(name, checkpointing)]
                rows.append({"ranks": world, "blocks": n_layers, "microbatches": microbatches, "schedule": name,
                             "checkpointing": checkpointing, "rank": stage.rank, "stages": list(stage.stages),
                             "in_flight": stage.in_flight,
                             "traced_bytes": traced, "gloo_bytes": measured,
                             "error": round((traced - measured) / measured, 5)})
                stages = ",".join(map(str, stage.stages))
                print(f"pp{world} {name:<18} AC {checkpointing:<4} rank {stage.rank} stages {stages:<5}: "
                      f"in flight {stage.in_flight:>2}, traced {traced:>10,} B, gloo {measured:>10,} B, "
                      f"{traced - measured:+7,} B ({(traced - measured) / measured:+.2%})", flush=True)
    worst = max(abs(r["error"]) for r in rows)
    print(f"worst {worst:.2%} ({time.perf_counter() - started:.0f} s)")
    out = write_result("pp-gloo", {"model": "tiny Llama, d 64, seq 32, vocab 256 (4 blocks on 2 ranks, 8 on 4)",
                                   "micro_batch": t.MICRO, "profiled_steps": 2, "rows": rows,
                                   "worst_error": worst, "seconds": round(time.perf_counter() - started)})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
