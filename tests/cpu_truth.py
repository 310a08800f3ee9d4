"""The independent measurement most tracer tests hold the trace to: the torch profiler's memory
timeline of a REAL training step on this CPU (trace it with ``cuda_semantics=False`` to compare)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from batchfit.train.step import TrainingStep


def profiled_step_peak(step: TrainingStep, batch_size: int, tmp_path: Path, *, warmup: int = 1) -> int:
    """The peak bytes of the profiler's memory timeline over one real step at ``batch_size``,
    after ``warmup`` steps (the optimizer state exists before the measured step, as in the
    trace; a compiled step needs two: inductor compiles in the first)."""
    for _ in range(warmup):
        step.run(batch_size)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        step.run(batch_size)
    path = tmp_path / "timeline.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # export_memory_timeline's FutureWarning
        prof.export_memory_timeline(str(path), device="cpu")
    _, sizes = json.loads(path.read_text())
    return max(sum(row) for row in sizes)
