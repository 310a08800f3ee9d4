"""The generation loop written (trace/written.py) against the loop run, on every family of the support matrix.

For each transformers family of tests/support_matrix.py (a tiny config, no weights) under TRL's GRPO step
(4 new tokens), in fp32 and bf16: trace batch sizes 8, 16, 40, 24 fresh with the loop written where it can be
(16 and 8 again for the warm-up step, 24 from the line through 8 and 16, checked at 40) and with it run every
time, and compare every figure of every traced point and the fresh process's allocation stream, event for
event. Writes benchmarks/results/written_families-<date>.json.

    python benchmarks/written_families.py [family,family...]
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import transformers

import batchfit.zoo.grpo as grpo
from _common import write_result
from batchfit.devices import get_device
from batchfit.errors import ModelSpecError
from batchfit.options import Rollout
from batchfit.trace.point import TracedCurve
from batchfit.trace.stream import _canonical
from batchfit.workload import StepOptions
from batchfit.zoo.hf_grpo import hf_grpo_workload

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support_matrix import FAMILIES  # noqa: E402

SIZES = [8, 16, 40, 24]


def traced(workload, options: dict, *, write: bool) -> tuple[dict, dict | None]:
    """Every size's point and canonical fresh stream, and how the loop was had."""
    shape_only_call = grpo.shape_only_call
    if not write:
        grpo.shape_only_call = lambda key, rows, device, run: run()
    try:
        with TracedCurve(workload, StepOptions(**options), get_device("rtx4090-24gb"), keep_streams=True) as curve:
            points = {b: (dataclasses.asdict(curve.point(b, fresh=True)), _canonical(curve._whole_streams[b]))
                      for b in SIZES}
            calls = curve._full.tracker.written
            return points, calls.summary() if calls is not None else None
    finally:
        grpo.shape_only_call = shape_only_call


def main() -> None:
    families = sys.argv[1].split(",") if len(sys.argv) > 1 else list(FAMILIES)
    rows = []
    for family in families:
        config = dict(FAMILIES[family])
        folder = tempfile.mkdtemp()
        transformers.AutoConfig.for_model(config.pop("model_type"), **config).save_pretrained(folder)
        try:
            workload = hf_grpo_workload(folder, Rollout(prompt_len=8, new_tokens=4, group_size=2))
        except ModelSpecError as error:  # an encoder or encoder-decoder family: GRPO needs a causal LM
            rows.append({"family": family, "refused": str(error)})
            continue
        for options in ({}, {"precision": "bf16"}):
            started = time.perf_counter()
            written, how = traced(workload, options, write=True)
            run, _ = traced(workload, options, write=False)
            different = [b for b in SIZES if written[b] != run[b]]
            rows.append({"family": family, "precision": options.get("precision", "fp32"), "how": how,
                         "equal": not different, "different_sizes": different,
                         "events_at_40": len(run[40][1]), "seconds": round(time.perf_counter() - started, 1)})
            print(rows[-1], flush=True)
    write_result("written_families", {
        "what": "trace/written.py's generation loop written against it run at every size: every traced figure and "
                "the fresh allocation stream of batch sizes 8, 16, 40, 24 (TRL's GRPO step, 4 new tokens, prompt 8, "
                "group 2; each family of tests/support_matrix.py at its tiny size)",
        "command": "python benchmarks/written_families.py",
        "rows": rows,
        "all_equal": all(r["equal"] for r in rows if "equal" in r),
    })


if __name__ == "__main__":
    main()
