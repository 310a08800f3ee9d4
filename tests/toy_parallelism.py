"""A toy parallelism, whole in this one module: what a new one writes to join the strategy grammar,
``plan --strategies auto``, the time model, the approximations and both emits (``distributed/parallelisms.py``).

``xp<N>`` takes N of the GPUs like cp<N> (world = dp x xp x tp) and has no model code of its own: it exists
to show that nothing outside its module names it. Its code around rank 0's step on the fake mesh
(:func:`_fake_mesh`, what cp and ep use for their ring and experts) sees the workload rank 0 runs, counts
parameters no rank-0 tensor holds, claims FSDP2's all-gathers as its own collectives and refuses a step
without any. ``tests/test_parallelism_registry.py`` adds it with ``parallelisms.added(TOY)``.
"""

from __future__ import annotations

from batchfit.distributed.parallelisms import FakeMesh, Parallelism
from batchfit.errors import OptionError
from batchfit.trace.approximation import Approximation

ELSEWHERE = 1000
"""Parameters the toy says other ranks hold (as ep's experts on other ranks): added to a traced point's."""
SEEN: list[tuple[str, bool]] = []
"""(strategy, traced as a CPU step) of each workload the toy's fake-mesh code was handed."""


def _approximations(strategies, workload, options) -> list:
    names = sorted(s.name for s in strategies if s.parts.degree("xp") > 1)
    return [Approximation(what=f"{', '.join(names)}: the toy's ranks are not traced", may_differ_by="nothing: a toy",
                          source="tests/toy_parallelism.py")] if names else []


def _auto(context, facts, base) -> list[tuple[int, str | None]]:
    """xp2 on FSDP2 bases without pp or TP; skipped, with its reason, on a model without layers."""
    if base.shard != "fsdp" or base.pp > 1 or base.tp > 1:
        return []
    return [(2, None if facts.n_layers else f"{facts.name} has no layers for the toy to split")]


def _workload(workload, strategy, meshes, *, cpu, enter):
    SEEN.append((strategy.name, cpu))
    return workload


def _label(call, strategy, meshes) -> tuple[str, int] | None:
    """FSDP2's all-gathers, over all the world's ranks here, labelled the toy's (xp ranks); others: the mesh's."""
    return ("xp", strategy.parts.degree("xp")) if call.op == "all_gather" else None


def _check(strategy, meshes, calls) -> None:
    if not any(call.op == "all_gather" for call in calls):
        raise OptionError(f"{strategy.name}: the toy's ranks never all-gathered: use fsdp+xp<N>")


def _fake_mesh() -> FakeMesh:
    return FakeMesh(workload=_workload, params_elsewhere=lambda model: ELSEWHERE, label=_label, check=_check)


TOY = Parallelism(key="xp", token="xp<N>", module="tests/toy_parallelism.py", approximations=_approximations,
                  torchtitan_key="toy_parallel_degree", torchtitan_at_1=False, config_key="toy_parallel",
                  group="xp", span=lambda collective, strategy: collective.group_size * 2, auto=_auto,
                  auto_rule="xp<N>: the toy over N ranks, FSDP2 over dp x xp", fake_mesh=_fake_mesh,
                  fsdp_shards_over=True, auto_bounds=("xp only at degree 2",), words="toy-parallel")
