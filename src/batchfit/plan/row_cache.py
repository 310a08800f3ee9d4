"""plan's rows kept in the trace cache: a strategy on a GPU count asked about again is not traced again.

What one tracing session answers (``engine._plan_one``: the strategy's row on its world, the rows
derived from its traces, the parameter count and the local batches traced) is a function of the
workload (its spec and the content of the file it names), the step's options, the GPU, the world,
the strategy, the search's bounds and target, the limit, the time model and the caching allocator's
configuration, and of the code that traced it: all of them are the key (``trace/cache.py``, which adds
the versions of torch, transformers and batchfit's source). So ``plan`` asked again, or asked with
more GPU counts or another ``--tokens``, reads each session it already ran and traces only the others,
with the rows a run without the cache writes (``tests/test_plan_bound.py``). Not kept: a workload built
in Python (no content to key), ``--compile`` (what a compiled trace reports depends on dynamo's state),
a stand-in tracer.
"""

from __future__ import annotations

from typing import Any

from batchfit.trace.allocator import AllocatorConfig
from batchfit.trace.cache import TraceCache


def row_cache(workload, options, device, job: tuple, search: dict[str, Any]) -> TraceCache | None:
    """The cache entry folder of one session ``job`` (world, strategy, derived rows), or None where
    nothing is kept; ``search`` holds the session's other inputs (bounds, target, limit, time model)."""
    if workload.cache_key is None or options.compile != "none":
        return None
    world, strategy, derived = job
    return TraceCache({"engine": "plan", "workload": workload.cache_key, "options": options.to_json(),
                       "device": device.to_json(), "world": repr(world), "strategy": repr(strategy),
                       "derived": [f"{w!r} {s!r}" for w, s in derived], "alloc_conf": repr(AllocatorConfig.from_env()),
                       **{name: repr(value) for name, value in search.items()}})
