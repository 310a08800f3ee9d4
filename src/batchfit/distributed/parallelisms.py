"""The parallelisms a strategy composes, one entry each: the registry that plan and emit iterate over.

A :class:`Parallelism` names its token in a strategy name (its degree is the ``StrategyName`` /
``Strategy`` field of the same key, read by ``distributed/strategy_name.py``, the one parser),
the module that applies it on a mesh, what every plan with it says in its output (its
approximations) and its torchtitan ``[parallelism]`` key. ``plan/engine.py`` collects the
approximations of every entry, ``plan/emit_torchtitan.py`` writes each entry's degree, instead of
naming each parallelism; ``tests/test_strategy_name.py`` checks that every degree of a name has its
entry. The data-parallel wraps (ddp, fsdp, hsdp, zero1/2) are the name's ``shard``; ZeRO's entry
carries only what its traces say.

Importing this module does not import torch: each entry's module is imported when it is asked.
"""

from __future__ import annotations

from collections.abc import Callable
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


def _own_group(collective, strategy) -> int:
    return collective.group_size


def _ring(collective, strategy) -> int:  # the cp ring over cp x tp consecutive ranks (tp innermost)
    return collective.group_size * strategy.tp


PARALLELISMS: tuple[Parallelism, ...] = (
    Parallelism(key="tp", token="tp<N>", module="distributed/tp_plans.py", torchtitan_key="tensor_parallel_degree",
                config_key="tensor_parallel", config_at_1=True, group="tp", span=_own_group, critical_path=True),
    Parallelism(key="zero", degree=False, token="zero1 / zero2", module="distributed/zero.py", approximations=_zero),
    Parallelism(key="pp", token="pp<N>", module="distributed/pipeline.py", approximations=_pipeline,
                torchtitan_key="pipeline_parallel_degree", config_key="pipeline_parallel"),
    Parallelism(key="cp", token="cp<N>", module="distributed/context_parallel.py", approximations=_context_parallel,
                torchtitan_key="context_parallel_degree", config_key="context_parallel", group="cp", span=_ring),
    # ep<N>: the sparse mesh's innermost dimension, N consecutive ranks (the tp ranks among them: etp=1)
    Parallelism(key="ep", token="ep<N>", module="distributed/expert_parallel.py", approximations=_expert_parallel,
                torchtitan_key="expert_parallel_degree", torchtitan_at_1=False, config_key="expert_parallel",
                group="ep", span=_own_group, critical_path=True),
)
"""Every parallelism, in the order a plan's outputs list their approximations."""

DEGREES = tuple(p.key for p in PARALLELISMS if p.degree)
"""The degree fields of a strategy: one per entry with a degree."""


BY_GROUP = {p.group: p for p in PARALLELISMS if p.group}
"""Each collective label's parallelism ('tp', 'cp', 'ep'); a label not here is data-parallel ('dp')."""


def approximations(strategies: list, workload, options) -> list:
    """What every parallelism used by ``strategies`` says in a plan's outputs, entry by entry."""
    return [a for p in PARALLELISMS for a in p.approximations(strategies, workload, options)]
