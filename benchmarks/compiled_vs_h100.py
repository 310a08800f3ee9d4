"""The compiled trace (CUDA semantics, bf16-mixed) against the compiled runs measured on an H100.

The measurements are results/validate_gpu_compile-2026-11-24.json (``validate_gpu.py --name
validate_gpu_compile``: inductor, bf16-mixed, the third step's peak allocated). This traces the
same model and batch on the virtual H100, eager and ``--compile model``, with no GPU here, in
ONE process and in the validation's order: the validation compiled the three models one after
the other in one process, and the zoo's models share their code, so dynamo recompiled gpt2-124m
and llama-1b with dynamic shapes (automatic dynamic shapes); so does this trace. A fresh process
compiles them with static shapes, as one training run does: `batchfit estimate gpt2-124m --gpu
h100-80gb --precision bf16-mixed --compile model --batch-sizes 8 --limit allocated` traces
8,689,031,168 B there (against 9,359,219,200 B here), llama-1b at batch 4 40,308,778,496 B
(39,805,462,016 B here). A static-shape H100 run of gpt2-124m was measured on 2026-11-27
(results/recipes_gpu-2026-11-27.json, ``recipes_gpu.py``: a fresh process): 8,712,264,192 B, the trace
-0.27%; Llama 3.2 1B (hf:, seq 2048, batch 2) compiled: 26,488,761,344 B measured, the trace -0.01%.
Writes benchmarks/results/compiled_vs_h100-<date>.json.

    python benchmarks/compiled_vs_h100.py [--models gpt-tinystories-22m,gpt2-124m,llama-1b]
"""

from __future__ import annotations

import argparse
import json

from _common import RESULTS, write_result
from batchfit.devices import get_device
from batchfit.estimator.engine import estimate
from batchfit.workload import StepOptions
from batchfit.zoo import ZOO

MEASURED = RESULTS / "validate_gpu_compile-2026-11-24.json"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gpt-tinystories-22m,gpt2-124m,llama-1b")
    args = parser.parse_args()
    runs = {row["model"]: row for row in json.loads(MEASURED.read_text())["compiled"]}
    device = get_device("h100-80gb")
    rows = []
    print(f"{'model':<22} {'batch':>5} {'mode':>8} {'traced B':>15} {'H100 B':>15} {'error':>8}")
    for name in args.models.split(","):
        run = runs[name]
        for mode, key in (("none", "eager"), ("model", "compiled")):
            result = estimate(ZOO[name](), device=device, options=StepOptions(precision="bf16-mixed", compile=mode),
                              batch_sizes=[run["batch_size"]], max_batch=run["batch_size"], limit="allocated",
                              suggest=False)
            traced = result.points[0].peak_bytes
            measured = run[key]["peak_allocated_bytes"]
            rows.append({"model": name, "batch_size": run["batch_size"], "compile": mode, "traced_bytes": traced,
                         "h100_bytes": measured, "error": (traced - measured) / measured})
            print(f"{name:<22} {run['batch_size']:>5} {mode:>8} {traced:>15,} {measured:>15,} "
                  f"{rows[-1]['error']:>+8.2%}", flush=True)
    path = write_result("compiled_vs_h100", {
        "measured": str(MEASURED.relative_to(RESULTS.parent.parent)), "precision": "bf16-mixed",
        "traced": "estimate on h100-80gb (CUDA semantics), --limit allocated, peak_bytes; all in one process, "
                  "in the validation's order (dynamo recompiles the later models with dynamic shapes, as the "
                  "validation run did)", "rows": rows,
        "fresh_process_static_shapes": {"gpt2-124m b8 compiled": 8689031168, "llama-1b b4 compiled": 40308778496}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
