"""A toy parallelism, whole in this one module: what a new one writes to join the strategy grammar,
``plan --strategies auto``, the time model, the approximations and both emits (``distributed/parallelisms.py``).

``xp<N>`` takes N of the GPUs like cp<N> (world = dp x xp x tp) and has no model code: it exists to
show that nothing outside its module names it. ``tests/test_parallelism_registry.py`` adds it with
``parallelisms.added(TOY)``.
"""

from __future__ import annotations

from batchfit.distributed.parallelisms import Parallelism
from batchfit.trace.approximation import Approximation


def _approximations(strategies, workload, options) -> list:
    names = sorted(s.name for s in strategies if s.parts.degree("xp") > 1)
    return [Approximation(what=f"{', '.join(names)}: the toy's ranks are not traced", may_differ_by="nothing: a toy",
                          source="tests/toy_parallelism.py")] if names else []


def _auto(context, facts, base) -> list[tuple[int, str | None]]:
    """xp2 on FSDP2 bases without pp or TP; skipped, with its reason, on a model without layers."""
    if base.shard != "fsdp" or base.pp > 1 or base.tp > 1:
        return []
    return [(2, None if facts.n_layers else f"{facts.name} has no layers for the toy to split")]


TOY = Parallelism(key="xp", token="xp<N>", module="tests/toy_parallelism.py", approximations=_approximations,
                  torchtitan_key="toy_parallel_degree", torchtitan_at_1=False, config_key="toy_parallel",
                  group="xp", span=lambda collective, strategy: collective.group_size * 2, auto=_auto,
                  auto_rule="xp<N>: the toy over N ranks, FSDP2 over dp x xp")
