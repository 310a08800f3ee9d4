"""How long `batchfit estimate` takes for hf:llama-3.1-8b at seq 8192 on this machine.

Times the whole curve and max-batch search (goal: under 20 s on a 2-core CPU), and
separately the suggestions that are traced when batch 1 does not fit. Prints a table and
writes benchmarks/results/estimate_speed-<date>.json.

    python benchmarks/estimate_speed.py
"""

from __future__ import annotations

import time

from _common import write_result

from batchfit import StepOptions, estimate, get_device, load_workload

CASES = [
    ("fp32 (default)", {}),
    ("bf16-mixed", {"precision": "bf16-mixed"}),
    ("bf16-mixed + checkpointing full", {"precision": "bf16-mixed", "checkpointing": "full"}),
    ("bf16 + checkpointing full", {"precision": "bf16", "checkpointing": "full"}),
]


def main() -> None:
    device = get_device("h100-80gb")
    rows = []
    for label, options in CASES:
        workload = load_workload("hf:llama-3.1-8b", seq_len=8192)
        started = time.perf_counter()
        curve = estimate(workload, device=device, options=StepOptions(**options), suggest=False)
        curve_s = time.perf_counter() - started
        started = time.perf_counter()
        full = estimate(workload, device=device, options=StepOptions(**options), suggest=True)
        full_s = time.perf_counter() - started
        rows.append({"options": label, "curve_and_max_s": round(curve_s, 2), "with_suggestions_s": round(full_s, 2),
                     "traces": curve.traces, "max_batch_size": curve.max_batch_size,
                     "peak_gib_at_batch_1": round(curve.points[0].peak_bytes / 2**30, 2),
                     "suggestions": len(full.suggestions)})
        print(f"{label:34s} curve+max {curve_s:6.1f} s  with suggestions {full_s:6.1f} s  "
              f"traces {curve.traces}  max batch {curve.max_batch_size}  "
              f"peak@1 {rows[-1]['peak_gib_at_batch_1']} GiB")
    path = write_result("estimate_speed", {
        "what": "wall time of batchfit.estimate for hf:llama-3.1-8b, seq 8192, on h100-80gb (traced on CPU)",
        "goal_s": 20, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
