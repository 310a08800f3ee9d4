"""Context-parallel truth on this CPU: real gloo runs of torch's ring attention (the CPU flash kernel
added to torch's CP table, ``distributed/context_parallel.py: ring_attention(cpu=True)``) on the tiny
Llama of tests/test_context_parallel.py (seq 64, b 4, fp32), fsdp+cp2 on 2 ranks, fsdp+cp4 on 4 and
fsdp+cp2 on 4 (dp 2 x cp 2): each rank's peak over a steady step (the profiler's memory timeline)
against the trace of rank 0 on the fake process group (CPU semantics). The first is also the test's.

    PYTHONPATH=src python benchmarks/cp_gloo.py
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

RUNS = ((2, "fsdp+cp2"), (4, "fsdp+cp4"), (4, "fsdp+cp2"))


def main() -> None:
    import test_context_parallel as t
    from cpu_truth import spawn_profiled_gloo

    warnings.simplefilter("ignore")
    rows = []
    started = time.perf_counter()
    for world, name in RUNS:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp)
            for rank in range(world):
                (path / str(rank)).mkdir()
            spawn_profiled_gloo(t._gloo_main, lambda port, p=str(path), w=world, n=name: (port, p, w, n), nprocs=world)
            real = {rank: json.loads((path / f"peak{rank}.json").read_text()) for rank in range(world)}
        traced = t._traced(name=name, world=world).total_peak_bytes
        for rank, measured in real.items():
            error = (traced - measured) / measured
            rows.append({"strategy": name, "gpus": world, "rank": rank, "traced_rank0_bytes": traced,
                         "gloo_bytes": measured, "error": round(error, 4)})
            print(f"{name} on {world}, rank {rank}: traced (rank 0) {traced:>10,} B, gloo {measured:>10,} B, "
                  f"{error:+.2%}", flush=True)
    worst = max(abs(r["error"]) for r in rows)
    seconds = time.perf_counter() - started
    print(f"worst {worst:.2%} ({seconds:.0f} s)")
    path = write_result("cp-gloo", {
        "model": "tiny Llama (d 128, 4 heads of 32, 2 KV heads repeated, 2 blocks), seq 64, local batch 4, fp32 AdamW",
        "truth": "each rank's torch.profiler memory-timeline peak over a steady step of a real gloo run",
        "traced": "rank 0 on the fake process group, CPU semantics (total_peak_bytes)",
        "rows": rows, "worst_error": round(worst, 4), "seconds": round(seconds, 1)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
