"""torchtitan's Llama 3 8B job against the reserved peak torchtitan published for it.

torchtitan's benchmarks/llama3_h100_202412_torchtitan.md (torchtitan 9dec370, torch 1963fc8,
December 2024; H100s with 96 GB of HBM2e): "1D Parallelism (FSDP). Llama 3.1 8B model. Local
batch size 2 ... Selective activation checkpointing", row "FSDP" (no compile, no float8):
82.4 GiB on 8 GPUs (Table 1), 67.0 GiB on 128 (Table 3). torchtitan logs ``max_reserved_gib``
(its train.py: "memory: {max_reserved_gib}GiB"), read at step 90, its peak stats reset every 10 steps.

What runs here is what ``plan`` runs for that job at local batch 2 (``DeepSession.reserved``:
torchtitan 0.2.2's own Llama 3 and ``parallelize_llama`` on the fake process group, rank 0's
fresh process replayed through the allocator model), once with FSDP2's side streams kept apart
(as the CUDA caching allocator keeps them) and once with every block in one pool (batchfit
before 2026-11-28), on a 96 GiB H100 so that neither replay runs out.

    PYTHONPATH=src python benchmarks/titan_published.py [--gpus 8,128] [--implementation fused]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _common import write_result  # noqa: E402

JOB = Path(__file__).parent / "data" / "torchtitan_llama3_8b.toml"
PUBLISHED_GIB = {8: 82.4, 128: 67.0}
GIB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", default="8,128")
    parser.add_argument("--implementation", default=None,
                        help="the optimizer's (fused: the job's 0.2.2 default; foreach: torchtitan 9dec370's)")
    args = parser.parse_args()

    from batchfit.devices import custom_device
    from batchfit.plan.deep import DeepSession
    from batchfit.plan.reserved import replay_steps
    from batchfit.plan.sharded import parse_strategy
    from batchfit.specs import load_workload
    from batchfit.workload import StepOptions

    device = custom_device(96 * GIB)
    text = JOB.read_text()
    if args.implementation:
        text = text.replace('eps = 1e-8\n', f'eps = 1e-8\nimplementation = "{args.implementation}"\n')
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        job = Path(folder) / JOB.name
        job.write_text(text)
        workload = load_workload(f"torchtitan:{job}", seq_len=8192, for_plan=True)
        for gpus in (int(g) for g in args.gpus.split(",")):
            start = time.perf_counter()
            seen = {}

            def session(*a, **k):
                from batchfit.plan.sharded import ShardedSession

                seen["session"] = ShardedSession(*a, **k)
                return seen["session"]

            with DeepSession(workload, StepOptions(precision="bf16-mixed"), device, parse_strategy("fsdp", gpus),
                             session=session) as deep:
                apart = deep.reserved(2)
            s = seen["session"]
            pooled = replay_steps(s.fresh_stream, s.fresh_steps, device)
            side = {}
            for kind, ident, nbytes in s.fresh_stream[s.fresh_steps[1]:]:
                if kind == "malloc" and ident in s.fresh_streams:
                    side[s.fresh_streams[ident]] = side.get(s.fresh_streams[ident], 0) + nbytes
            published = PUBLISHED_GIB.get(gpus)
            row = {"gpus": gpus, "published_reserved_gib": published,
                   "params_per_rank": s.params_per_rank, "fp32_shard_bytes": 4 * s.params_per_rank,
                   "steady_step_bytes_by_side_stream": side,
                   "peak_allocated_bytes": max(apart.peak_allocated_by_step),
                   "reserved_streams_apart_bytes": apart.peak_reserved_bytes,
                   "reserved_one_pool_bytes": pooled.peak_reserved_bytes,
                   "peak_step": apart.peak_step_name, "wall_s": round(time.perf_counter() - start, 1)}
            for key in ("reserved_streams_apart", "reserved_one_pool"):
                row[f"{key}_gib"] = round(row[f"{key}_bytes"] / GIB, 2)
                if published:
                    row[f"{key}_vs_published"] = f"{row[f'{key}_bytes'] / GIB / published - 1:+.1%}"
            print(row, flush=True)
            rows.append(row)
    name = "titan_published" + (f"-{args.implementation}" if args.implementation else "")
    print("wrote", write_result(name, {"job": str(JOB.relative_to(Path(__file__).parents[1])),
                                       "implementation": args.implementation or "the job's (fused)",
                                       "local_batch": 2, "seq_len": 8192, "device": device.display_name,
                                       "rows": rows}))


if __name__ == "__main__":
    main()
