"""Pipeline truth on this CPU: real gloo pipelines (torch's PipelineStage with ScheduleGPipe and
Schedule1F1B) of a 4-block Llama in 2 and 4 stages, each rank's peak over a steady step (the
profiler's memory timeline) against the trace of that pipeline rank on the fake process group
(CPU semantics). The 2-stage run is also tests/test_pipeline.py's.

    PYTHONPATH=src python benchmarks/pp_gloo.py
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(Path(__file__).parent), str(ROOT / "tests")]

from _common import write_result  # noqa: E402


def main() -> None:
    import torch

    import test_pipeline as t
    from batchfit.devices import get_device
    from batchfit.plan.pipeline import PipelineSession
    from batchfit.plan.pp_strategy import parse_pp_strategy
    from batchfit.plan.sharded import parse_strategy
    from batchfit.workload import StepOptions

    warnings.simplefilter("ignore")
    rows = []
    started = time.perf_counter()
    for world, microbatches in ((2, 4), (4, 4)):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp)
            for rank in range(world):
                (path / str(rank)).mkdir()
            torch.multiprocessing.spawn(t._gloo_main, args=(t._free_port(), str(path), world, microbatches),
                                        nprocs=world, join=True)
            real = {rank: json.loads((path / f"peaks{rank}.json").read_text()) for rank in range(world)}
        for name in t.SCHEDULES:
            strategy = parse_pp_strategy(f"pp{world}", world, parse_strategy, pp_schedule=name,
                                         microbatches=microbatches)
            session = PipelineSession(t.tiny_workload(), StepOptions(), get_device("h100-80gb"), strategy,
                                      cuda_semantics=False)
            session.trace(t.MICRO * microbatches)
            for stage in session.stage_points:
                traced = stage.point.total_peak_bytes or stage.point.peak_bytes
                measured = real[stage.rank][name]
                rows.append({"stages": world, "schedule": name, "rank": stage.rank, "in_flight": stage.in_flight,
                             "traced_bytes": traced, "gloo_bytes": measured,
                             "error": round((traced - measured) / measured, 4)})
                print(f"pp{world} {name:<5} rank {stage.rank}: in flight {stage.in_flight}, traced {traced:>9,} B, "
                      f"gloo {measured:>9,} B, {(traced - measured) / measured:+.2%}", flush=True)
    worst = max(abs(r["error"]) for r in rows)
    print(f"worst {worst:.2%} ({time.perf_counter() - started:.0f} s)")
    out = write_result("pp-gloo", {"model": "4-block Llama, d 64, seq 32, vocab 256", "micro_batch": t.MICRO,
                                   "rows": rows, "worst_error": worst})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
