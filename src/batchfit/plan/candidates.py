"""``plan --strategies auto``: every parallelism combination worth tracing for a world and a model.

One function, :func:`candidates`, lists them; each combination comes from a written rule (below),
and a combination a rule cannot apply to this model (no tensor-parallel plan, heads or layers
that do not divide) is listed as **skipped, with the reason**, never dropped in silence. The
rules that only keep the count bounded (each candidate is a tracing session: seconds to
minutes on a CPU) are :func:`bounds`, printed with every ranking.

A combination is the degrees ``pp x dp x tp = world`` (``cp`` joins the product and ``ep``
borrows from dp x tp) and the data-parallel wrap of the dp ranks. The rules are the registered
parallelisms' (``distributed/parallelisms.py``), each written once in ``distributed/auto.py`` over
the model's ``ModelFacts``, and iterated here in the registry's order:

- ``Parallelism.auto_combinations``: combinations of its own, listed first (the data-parallel wraps,
  tp, pp: ``data_parallel_combinations``, ``tp_combinations``, ``pp_combinations``);
- ``Parallelism.auto``: a further component on each combination that applies, its ``auto_rule`` as
  the row's rule (cp, ep: ``cp_degrees``, ``ep_degrees``; read by :func:`registered_components`);
- ``Parallelism.auto_skip``: a row every rule listed that cannot apply after all (tp on a mixture
  of experts without ep beside it: ``moe_tp_skip``), read last;
- one GPU: the plain single-GPU step, once (this module's own).

Counts (a model every rule applies to; the plan's --help and docs/tracing/auto.md say them): 2 GPUs 7,
4 GPUs 11, 8 GPUs 15, 16 (2 nodes) 15, 64 (8 nodes) 17. Narrow with ``--strategies`` (a list).
Pure Python; ``model_facts`` (``distributed/auto.py``) builds the model on the meta device (torch, imported there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from batchfit.distributed import parallelisms
from batchfit.distributed.auto import AutoContext, Candidate, ModelFacts, model_facts  # noqa: F401 - plan's names
from batchfit.distributed.strategy_name import StrategyName
from batchfit.plan.world import World


def bounds() -> tuple[str, ...]:
    """What auto leaves out only to bound the tracing (not because it cannot apply), printed with the ranking:
    each registered parallelism's ``auto_bounds``, in the registry's order."""
    return tuple(line for p in parallelisms.registered() for line in p.auto_bounds)


@dataclass(frozen=True, kw_only=True)
class Component:
    """A further parallelism dimension (cp, ep): its degrees for a base combination, and its name part.

    ``degrees(context, facts, base) -> [(degree, reason or None)]`` (degree 1, meaning none, is
    always tried and need not be listed); a degree with a reason is listed as skipped."""

    key: str
    """'cp' or 'ep': the Candidate.degrees key, a degree of ``StrategyName`` (which writes it into the name)."""
    takes_gpus: bool
    """True: a factor of the world (cp: GPUs = pp x dp x cp x tp); False: borrows from dp (ep divides dp)."""
    degrees: Callable[[AutoContext, ModelFacts, Candidate], list[tuple[int, str | None]]]
    rule: str
    """One line: the rule, as the module docstring writes the others."""


def registered_components() -> tuple[Component, ...]:
    """The further components auto tries: every registered parallelism with a candidate rule (cp, ep, and a
    new one's: ``Parallelism.auto`` in ``distributed/parallelisms.py``), in the registry's order."""
    return tuple(Component(key=p.key, takes_gpus=p.takes_gpus, degrees=p.auto, rule=p.auto_rule)
                 for p in parallelisms.registered() if p.auto is not None)


def _named(row: Candidate) -> Candidate:
    """``row`` with the grammar's name (``distributed/strategy_name.py`` writes it):
    [pp<N>+][ep<N>+]wrap[+cp<N>][+tp<N>] ('none' wrap: 'tp4' alone)."""
    if row.name:
        return row
    parts = StrategyName.of(shard=row.shard, replicas=row.replicas, degrees={"tp": row.tp, "pp": row.pp, **row.degrees})
    return replace(row, name=parts.name)


def candidates(world: World, facts: ModelFacts, *, pp_schedule: str = "1f1b", microbatches: int = 0,
               components: tuple[Component, ...] | None = None) -> list[Candidate]:
    """Every combination of ``world`` for a model of ``facts``, skipped ones with their reason
    (the rules: the module docstring). Each registered parallelism's own combinations first, in the
    registry's order (the data-parallel wraps, TP, pp), then its further components (cp, ep)."""
    components = registered_components() if components is None else components
    if world.gpus == 1:
        return [Candidate(name="fsdp", gpus=1, nodes=world.nodes, rule="one GPU: the plain single-GPU step")]
    context = AutoContext(gpus=world.gpus, nodes=world.nodes, gpus_per_node=world.gpus_per_node,
                          pp_schedule=pp_schedule, microbatches=microbatches)
    out: list[Candidate] = []

    def add(candidate: Candidate) -> None:
        candidate = _named(candidate)
        if all(c.name != candidate.name for c in out):
            out.append(candidate)

    for parallelism in parallelisms.registered():
        for row in parallelism.auto_combinations(context, facts) if parallelism.auto_combinations else ():
            add(row)
    # further components (cp, ep): on each combination listed that applies and has room for them
    for component in components:
        for c in [c for c in out if c.skipped is None and c.shard != "hsdp" and not c.degrees]:  # bases; hsdp<R>: none
            for degree, reason in component.degrees(context, facts, c):
                if degree <= 1 or (c.dp if component.takes_gpus else c.dp * c.tp) % degree:  # ep borrows dp x tp
                    continue
                dp = c.dp // degree if component.takes_gpus else c.dp
                add(replace(c, name="", dp=dp, degrees={**c.degrees, component.key: degree}, rule=component.rule,
                            skipped=reason))
    skips = [p.auto_skip for p in parallelisms.registered() if p.auto_skip is not None]
    return [replace(c, skipped=reason) if c.skipped is None and (reason := _first_reason(skips, context, facts, c))
            else c for c in out]


def _first_reason(skips: list[Callable], context: AutoContext, facts: ModelFacts, row: Candidate) -> str | None:
    return next((reason for skip in skips if (reason := skip(context, facts, row)) is not None), None)
