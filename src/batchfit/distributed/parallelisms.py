"""The parallelisms a strategy composes, one entry each: the registry that plan and emit iterate over.

A :class:`Parallelism` names its token in a strategy name (its degree is the ``StrategyName`` /
``Strategy`` field of the same key, read by ``distributed/strategy_name.py``, the one parser),
the module that applies it on a mesh, what every plan with it says in its output (its
approximations), its candidate rule for ``plan --strategies auto``, and its torchtitan ``[parallelism]``
and config.yaml keys. The parser (``strategy_name.py``), auto's candidates (``plan/candidates.py``), the
time model, ``plan/engine.py``'s approximations and both emits iterate over :func:`registered`
instead of naming each parallelism; ``tests/test_strategy_name.py`` checks that every degree of a name
has its entry, ``tests/test_parallelism_registry.py`` that a toy parallelism added from one module is
parsed, listed by auto and emitted. The data-parallel wraps (ddp, fsdp, hsdp, zero1/2) are the name's
``shard``; ZeRO's entry carries only what its traces say.

Importing this module does not import torch: each entry's module is imported when it is asked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Parallelism:
    """One parallelism's small interface."""

    key: str
    """Its degree's field on ``StrategyName`` and ``Strategy`` ('tp', 'pp', 'cp', 'ep'), or the wraps' name
    ('zero') for one that is a data-parallel wrap."""
    degree: bool = True
    """Whether ``key`` is a degree of the name (False for a data-parallel wrap: ZeRO is the name's shard)."""
    token: str
    """How a strategy name writes it ('pp<N>', 'zero1 / zero2')."""
    module: str
    """The module that applies it (``distributed/...``)."""
    approximations: Callable[[list, object, object], list] = lambda strategies, workload, options: []
    """``(strategies, workload, options) -> [Approximation]``: what a plan with it says in every output
    (empty when no strategy of ``strategies`` uses it)."""
    torchtitan_key: str | None = None
    """Its degree's key in torchtitan's ``[parallelism]`` (None: torchtitan has none)."""
    torchtitan_at_1: bool = True
    """Whether the key is written at degree 1 too (torchtitan's job files name tp, pp and cp always)."""
    config_key: str | None = None
    """Its degree's key in ``plan --emit config.yaml`` (None: not written)."""
    config_at_1: bool = False
    """Whether that key is written at degree 1 too (seed 001's shape names tensor_parallel always)."""
    group: str | None = None
    """The label its own collectives carry in a trace (``Collective.group``); None: it has none (a
    pipeline's sends move no bytes of their own; ZeRO's are data-parallel ones)."""
    span: Callable[[object, object], int] | None = None
    """``(collective, strategy) -> ranks``: how many consecutive ranks one group of its collectives spans,
    which decides NVLink or the network (``plan/time_model.py``; the mesh puts tp innermost)."""
    critical_path: bool = False
    """Whether the next op waits for its collectives (never hidden behind compute): TP's, ep's all-to-alls."""
    name_order: int = 5
    """Where its token stands in a name written back (pp 0, ep 1, the wrap 2, cp 3, tp 4; a new one after)."""
    takes_gpus: bool = True
    """True: its degree is a factor of the world (cp: GPUs = pp x dp x cp x tp); False: it borrows its
    ranks from dp x tp (ep, torchtitan's etp=1), leaving the data-parallel degree as it is."""
    auto: Callable[[object, object, object], list[tuple[int, str | None]]] | None = None
    """Its candidate rule for ``plan --strategies auto`` as a further component of a base combination (cp,
    ep): ``(world, facts, base) -> [(degree, reason or None)]`` with ``world`` a ``plan.world.World``
    (``gpus_per_node``), ``facts`` a ``plan.candidates.ModelFacts`` and ``base`` a ``plan.candidates.Candidate``
    (``shard``, ``pp``, ``dp``, ``tp``); degree 1 need not be listed, a degree with a reason is listed as
    skipped. None: auto builds it into the base combinations (tp, pp) or does not add it."""
    auto_rule: str = ""
    """One line: the rule, as ``plan/candidates.py``'s docstring writes the others (a candidate's ``rule``)."""


def _pipeline(strategies, workload, options) -> list:
    from batchfit.distributed.pipeline import pipeline_approximations

    return pipeline_approximations(strategies, workload)


def _context_parallel(strategies, workload, options) -> list:
    from batchfit.distributed.context_parallel import context_parallel_approximations

    return context_parallel_approximations(strategies)


def _expert_parallel(strategies, workload, options) -> list:
    from batchfit.distributed.expert_parallel import ep_approximations

    return ep_approximations(strategies, options.routing)


def _zero(strategies, workload, options) -> list:
    from batchfit.distributed.zero import zero_approximations

    return zero_approximations(strategies)


MIN_AUTO_CP_SEQ = 8192
"""auto adds context parallelism from this sequence length on (shorter sequences fit without a ring)."""


def divisors(n: int) -> list[int]:
    """1 .. n's divisors, ascending (auto's degrees divide the ranks they split)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _cp_degrees(world, facts, base) -> list[tuple[int, str | None]]:
    """cp<N> on FSDP2 without pp, for attention models from MIN_AUTO_CP_SEQ tokens: the smallest and largest
    N within a node that divides the data-parallel ranks and leaves sequence / (2 N) whole (torch's
    head-tail load balancing)."""
    seq = facts.seq_len or 0
    if base.shard != "fsdp" or base.pp > 1 or facts.heads is None or seq < MIN_AUTO_CP_SEQ:
        return []
    room = world.gpus_per_node // base.tp
    fit = [d for d in divisors(base.dp) if 1 < d <= room and seq % (2 * d) == 0]
    return [(d, None) for d in sorted({fit[0], fit[-1]})] if fit else []


def _ep_degrees(world, facts, base) -> list[tuple[int, str | None]]:
    """ep<N>+fsdp[+tp<M>] for a mixture of experts, without pp: the largest N within a node dividing both the
    experts and the dp x tp ranks it borrows from (torchtitan's etp=1)."""
    fsdp = base.shard == "fsdp" or (base.shard == "none" and base.tp > 1)  # tp<M> alone: FSDP2 over one rank
    if not facts.experts or not fsdp or base.pp > 1:
        return []
    fit = [d for d in divisors(base.dp * base.tp) if 1 < d <= world.gpus_per_node and facts.experts % d == 0]
    return [(fit[-1], None)] if fit else []


def _own_group(collective, strategy) -> int:
    return collective.group_size


def _ring(collective, strategy) -> int:  # the cp ring over cp x tp consecutive ranks (tp innermost)
    return collective.group_size * strategy.tp


_REGISTRY: list[Parallelism] = [
    Parallelism(key="tp", token="tp<N>", module="distributed/tp_plans.py", torchtitan_key="tensor_parallel_degree",
                config_key="tensor_parallel", config_at_1=True, group="tp", span=_own_group, critical_path=True,
                name_order=4),
    Parallelism(key="zero", degree=False, token="zero1 / zero2", module="distributed/zero.py", approximations=_zero),
    Parallelism(key="pp", token="pp<N>", module="distributed/pipeline.py", approximations=_pipeline,
                torchtitan_key="pipeline_parallel_degree", config_key="pipeline_parallel", name_order=0),
    Parallelism(key="cp", token="cp<N>", module="distributed/context_parallel.py", approximations=_context_parallel,
                torchtitan_key="context_parallel_degree", config_key="context_parallel", group="cp", span=_ring,
                name_order=3, auto=_cp_degrees,
                auto_rule="cp<N>: ring attention over N ranks of each sample, FSDP2 over dp x cp"),
    # ep<N>: the sparse mesh's innermost dimension, N consecutive ranks (the tp ranks among them: etp=1)
    Parallelism(key="ep", token="ep<N>", module="distributed/expert_parallel.py", approximations=_expert_parallel,
                torchtitan_key="expert_parallel_degree", torchtitan_at_1=False, config_key="expert_parallel",
                group="ep", span=_own_group, critical_path=True, name_order=1, takes_gpus=False, auto=_ep_degrees,
                auto_rule="ep<N>+fsdp[+tp<M>]: each rank keeps experts / N, all-to-all dispatch (etp=1 with tp)"),
]
"""Every parallelism, in the order a plan's outputs list their approximations (:func:`added` appends one)."""


def registered() -> tuple[Parallelism, ...]:
    """Every parallelism now registered, in the registry's order."""
    return tuple(_REGISTRY)


def entry(key: str) -> Parallelism:
    """The parallelism of ``key`` ('tp', 'cp', ...)."""
    return next(p for p in _REGISTRY if p.key == key)


def degree_keys() -> tuple[str, ...]:
    """The degree keys of a strategy name: one per entry with a degree ('tp', 'pp', 'cp', 'ep', ...)."""
    return tuple(p.key for p in _REGISTRY if p.degree)


def by_group() -> dict[str, Parallelism]:
    """Each collective label's parallelism ('tp', 'cp', 'ep'); a label not here is data-parallel ('dp')."""
    return {p.group: p for p in _REGISTRY if p.group}


@contextmanager
def added(parallelism: Parallelism) -> Iterator[Parallelism]:
    """``parallelism`` registered for the ``with`` block (a new one's tests; a plugin's run), then removed.

    A new parallelism's whole code is one module that defines its :class:`Parallelism` (and the
    functions it names) and registers it: the parser, auto, the time model and the emits read it."""
    if parallelism.key in {p.key for p in _REGISTRY} | {"hsdp"}:
        raise ValueError(f"a parallelism '{parallelism.key}' is already registered: give the new one its own key")
    _REGISTRY.append(parallelism)
    try:
        yield parallelism
    finally:
        _REGISTRY.remove(parallelism)


def degree_of(layout, key: str) -> int:
    """``layout``'s degree of ``key``: its field (a ``Strategy``'s or a plan row's tp, cp, ...), else the
    name's degree of a parallelism without a field of its own (``StrategyName.more``), else 1."""
    if hasattr(layout, key):
        return getattr(layout, key)
    parts = getattr(layout, "parts", None)
    return parts.degree(key) if parts is not None else 1


def approximations(strategies: list, workload, options) -> list:
    """What every parallelism used by ``strategies`` says in a plan's outputs, entry by entry."""
    return [a for p in registered() for a in p.approximations(strategies, workload, options)]
