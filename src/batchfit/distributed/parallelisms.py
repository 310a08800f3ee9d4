"""The parallelisms a strategy composes, one entry each: the registry that plan and emit iterate over.

A :class:`Parallelism` names its token in a strategy name (its degree is the ``StrategyName`` /
``Strategy`` field of the same key, read by ``distributed/strategy_name.py``, the one parser),
the module that applies it on a mesh and its code around rank 0's step there (:class:`FakeMesh`), what
every plan with it says in its output (its approximations), its candidate rules for ``plan --strategies
auto`` (over ``distributed/auto.py``'s ``ModelFacts``) and what it leaves out to bound them, its torchtitan
``[parallelism]``, config.yaml and Accelerate keys, and the rules plan reads of it (whether FSDP2 shards over
its ranks, whether a pipeline runs it, its collectives' bytes on a link). The parser (``strategy_name.py``),
auto's candidates and bounds (``plan/candidates.py``), the traced rank (``plan/sharded.py``: TP's shipped plan
and ZeRO's optimizer too), the time model, the shard limit, the derived DDP rows, the pipeline's refusals,
``plan/engine.py``'s approximations and the three emits iterate over :func:`registered` instead of naming each
parallelism; ``tests/test_strategy_name.py`` checks that every
degree of a name has its entry, ``tests/test_parallelism_registry.py`` that a toy parallelism added from one
module is parsed, listed by auto and emitted. The data-parallel wraps (ddp, fsdp, hsdp, zero1/2) are the name's
``shard``: their entry ('dp') carries auto's first combinations, ZeRO's only what its traces say.

This file is the interface and the list; each entry's hooks live with its parallelism: auto's rules and
bounds in ``distributed/auto.py``, cp's ring rules in ``context_parallel.py``, ZeRO's optimizer and the pipeline's
approximations in ``zero.py`` and ``pipeline.py``. Importing it does not import torch: ``tp_plans.py`` and
``expert_parallel.py`` do, so their hooks here import them when called.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from batchfit.distributed import auto, pipeline, zero
from batchfit.distributed import context_parallel as cp
from batchfit.distributed.auto import AutoContext, Candidate, ModelFacts


@dataclass(frozen=True, kw_only=True)
class FakeMesh:
    """A parallelism's code around rank 0's traced step on the fake mesh: ``plan/sharded.py`` calls each
    hook of every parallelism its strategy uses, in the registry's order (the defaults do nothing)."""

    workload: Callable[..., object] = lambda workload, strategy, meshes, *, cpu, enter: workload
    """``(workload, strategy, meshes, *, cpu, enter) -> workload`` as this rank runs it (cp: the batch and the
    position tables cut to its sequence/N, torch's ring entered with ``enter`` for the session); ``cpu``:
    traced as a CPU step (the gloo truth's)."""
    params_elsewhere: Callable[[object], int] = lambda model: 0
    """Parameters of the whole model that rank 0's prepared model does not hold at all (ep: other ranks' experts)."""
    label: Callable[[object, object, object], tuple[str, int] | None] = lambda call, strategy, meshes: None
    """``(call, strategy, meshes) -> (group, ranks)`` for a collective call of its own (``Collective.group``),
    None for another's (the mesh's label stands)."""
    check: Callable[[object, object, list], None] = lambda strategy, meshes, calls: None
    """``(strategy, meshes, calls)`` after the first trace: raises OptionError when the step never ran it (cp:
    no attention through the ring)."""
    parallelize: Callable[[object, object], Callable | None] = lambda model, options: None
    """``(model, options) -> plan`` applying it to a model whose workload has no plan of its own (tp: the shipped
    plan, ``distributed/tp_plans.py``), None: no plan (the first entry's non-None plan is ``apply_strategy``'s)."""
    optimizer: Callable[[object, object, object], tuple] = lambda workload, options, strategy: (workload, options)
    """``(workload, options, strategy) -> (workload, options)`` whose step builds its optimizer as it needs it
    (zero1 / zero2: a ZeroRedundancyOptimizer, built inside the trace)."""


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
    bus: Callable[[object], float | None] = lambda collective: None
    """``collective -> bytes on a link per byte of its buffer`` for its own collectives that are not a ring's
    (cp's dK/dV pass: torch's _AllToAllRotater sends a rank's whole buffer to the next, 1.0); None: a ring's
    (``plan/time_model.py``'s bus_factor)."""
    critical_path: bool = False
    """Whether the next op waits for its collectives (never hidden behind compute): TP's, ep's all-to-alls."""
    name_order: int = 5
    """Where its token stands in a name written back (pp 0, ep 1, the wrap 2, cp 3, tp 4; a new one after)."""
    takes_gpus: bool = True
    """True: its degree is a factor of the world (cp: GPUs = pp x dp x cp x tp); False: it borrows its
    ranks from dp x tp (ep, torchtitan's etp=1), leaving the data-parallel degree as it is."""
    auto_combinations: Callable[[AutoContext, ModelFacts], list[Candidate]] | None = None
    """Its candidate rule for ``plan --strategies auto`` as combinations of its own (the data-parallel wraps,
    tp, pp): ``(context, facts) -> [Candidate]``, rows unnamed (``plan/candidates.py`` names them), each
    skipped one with its reason. Listed first, in the registry's order."""
    auto: Callable[[AutoContext, ModelFacts, Candidate], list[tuple[int, str | None]]] | None = None
    """Its candidate rule as a further component of each base combination (cp, ep): ``(context, facts, base)
    -> [(degree, reason or None)]`` with ``base`` a row of the combinations (``shard``, ``pp``, ``dp``,
    ``tp``); degree 1 need not be listed, a degree with a reason is listed as skipped. None: it has none."""
    auto_rule: str = ""
    """One line: the rule of ``auto``, as ``plan/candidates.py``'s docstring writes the others (a candidate's
    ``rule``)."""
    auto_skip: Callable[[AutoContext, ModelFacts, Candidate], str | None] | None = None
    """Why a row every rule has listed cannot apply after all (tp on a mixture of experts without ep beside
    it), read last; None: it has no such rule."""
    fake_mesh: Callable[[], FakeMesh] | None = None
    """Its code that ``plan/sharded.py`` runs around rank 0's step on the fake mesh beyond
    ``apply_strategy``'s wrap (loaded when a traced strategy uses it: :meth:`used_by`); None: none."""
    uses: Callable[[object], bool] = lambda layout: False
    """For an entry without a degree (a data-parallel wrap): whether ``layout`` (a ``Strategy``, a plan row)
    uses it (zero: its shard is zero1 or zero2). An entry with a degree is used from degree 2 on."""
    auto_bounds: tuple[str, ...] = ()
    """What auto leaves out of its rule only to bound the tracing (not because it cannot apply), one line
    each: ``plan/candidates.py``'s :func:`bounds` prints them with every ranking, in the registry's order."""
    fsdp_shards_over: bool = False
    """Whether FSDP2 shards the parameters over its ranks too (cp: torchtitan's dp_shard_cp mesh, FSDP2 over
    dp x cp), so ``plan/shard_limit.py`` counts them in the shard group it bounds by the model's rows."""
    in_pipeline: str | None = None
    """Why a pipeline's stages do not run it (yet): ``plan/pipeline.py`` refuses pp<N> with it, saying this
    after the strategy's name; None: they do."""
    words: str = ""
    """What a row using it is, in a sentence ('expert-parallel'): the emits' refusals say it. Left out: its
    key's ('xp-parallel'), so a refusal never reads 'is , which ...'."""
    accelerate: Callable[[object, int], dict[str, object]] | None = None
    """``(row, degree) -> its keys in Accelerate's parallelism_config`` for a recommended row using it (cp: its
    size and the ring's rotation; ``{}`` for one written with the wraps' sizes, tp); raises OptionError for a
    row Accelerate cannot run it in. None: Accelerate's config cannot say it, and ``plan --emit accelerate``
    refuses such a row (its :attr:`words`)."""
    runs_experts: bool = False
    """Whether it runs a mixture's experts itself (ep: one grouped GEMM, not the model's loop), so the plan's
    routing line says so when every strategy uses it."""

    def __post_init__(self) -> None:
        if not self.words:
            object.__setattr__(self, "words", f"{self.key}-parallel")

    def used_by(self, layout) -> bool:
        """Whether ``layout`` (a ``Strategy``, a plan row) uses this parallelism."""
        return degree_of(layout, self.key) > 1 if self.degree else self.uses(layout)


def _own_group(collective, strategy) -> int:
    return collective.group_size


def _with_the_wraps(row, degree: int) -> dict[str, object]:
    return {}  # parallelism_config_tp_size: written beside the data-parallel sizes (plan/emit.py), tp1 too


# tp_plans.py and expert_parallel.py import torch: their hooks import them when called.
def _tp_mesh() -> FakeMesh:
    from batchfit.distributed.tp_plans import tp_plan

    return FakeMesh(parallelize=lambda model, options: tp_plan(model, options.tp_loss))


def _ep_mesh() -> FakeMesh:
    from batchfit.distributed.expert_parallel import dispatch_label, experts_elsewhere

    return FakeMesh(params_elsewhere=experts_elsewhere, label=dispatch_label)


def _ep_approximations(strategies, workload, options) -> list:
    from batchfit.distributed.expert_parallel import ep_approximations

    return ep_approximations(strategies, options.routing)


_REGISTRY: list[Parallelism] = [
    # the data-parallel wraps: the name's shard, no degree of their own; auto's first combinations
    Parallelism(key="dp", degree=False, token="ddp / fsdp / fsdp-noreshard / hsdp<R> / zero1 / zero2",
                module="distributed/strategy.py", auto_combinations=auto.data_parallel_combinations,
                auto_bounds=auto.DP_BOUNDS),
    Parallelism(key="tp", token="tp<N>", module="distributed/tp_plans.py", torchtitan_key="tensor_parallel_degree",
                config_key="tensor_parallel", config_at_1=True, group="tp", span=_own_group, critical_path=True,
                name_order=4, auto_combinations=auto.tp_combinations, auto_skip=auto.moe_tp_skip,
                auto_bounds=auto.TP_BOUNDS, fake_mesh=_tp_mesh, words="tensor-parallel", accelerate=_with_the_wraps),
    Parallelism(key="zero", degree=False, token="zero1 / zero2", module="distributed/zero.py",
                approximations=lambda strategies, workload, options: zero.zero_approximations(strategies),
                uses=lambda layout: getattr(layout, "shard", None) in ("zero1", "zero2"),
                fake_mesh=lambda: FakeMesh(optimizer=zero.with_sharded_optimizer)),
    Parallelism(key="pp", token="pp<N>", module="distributed/pipeline.py",
                approximations=lambda strategies, workload, options: pipeline.pipeline_approximations(strategies,
                                                                                                      workload),
                torchtitan_key="pipeline_parallel_degree", config_key="pipeline_parallel", name_order=0,
                auto_combinations=auto.pp_combinations, auto_bounds=auto.PP_BOUNDS, words="pipeline-parallel"),
    Parallelism(key="cp", token="cp<N>", module="distributed/context_parallel.py",
                approximations=lambda strategies, workload, options: cp.context_parallel_approximations(strategies),
                torchtitan_key="context_parallel_degree", config_key="context_parallel", group="cp",
                span=cp.ring_span, bus=cp.ring_pass, name_order=3, auto=auto.cp_degrees, auto_rule=auto.CP_RULE,
                auto_bounds=auto.CP_BOUNDS, fsdp_shards_over=True, in_pipeline=cp.NOT_IN_PIPELINE,
                fake_mesh=lambda: FakeMesh(workload=cp.on_fake_mesh, label=cp.ring_label, check=cp.check_ring),
                words="context-parallel", accelerate=cp.accelerate_keys),
    # ep<N>: the sparse mesh's innermost dimension, N consecutive ranks (the tp ranks among them: etp=1)
    Parallelism(key="ep", token="ep<N>", module="distributed/expert_parallel.py", approximations=_ep_approximations,
                torchtitan_key="expert_parallel_degree", torchtitan_at_1=False, config_key="expert_parallel",
                group="ep", span=_own_group, critical_path=True, name_order=1, takes_gpus=False, auto=auto.ep_degrees,
                auto_rule=auto.EP_RULE, auto_bounds=auto.EP_BOUNDS, fake_mesh=_ep_mesh, runs_experts=True,
                words="expert-parallel"),
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
    """``layout``'s degree of ``key``: its field (a ``Strategy``'s or a plan row's tp, cp, ...), else its
    ``degrees`` (an auto ``Candidate``'s cp, ep), else the name's degree of a parallelism without a field of
    its own (``StrategyName.more``), else 1."""
    if hasattr(layout, key):
        return getattr(layout, key)
    if isinstance(degrees := getattr(layout, "degrees", None), dict):
        return degrees.get(key, 1)
    parts = getattr(layout, "parts", None)
    return parts.degree(key) if parts is not None else 1


def runs_experts(layout) -> bool:
    """Whether a parallelism ``layout`` uses runs a mixture's experts itself (ep<N>: ``Parallelism.runs_experts``)."""
    return any(p.runs_experts and p.used_by(layout) for p in _REGISTRY)


def approximations(strategies: list, workload, options) -> list:
    """What every parallelism used by ``strategies`` says in a plan's outputs, entry by entry."""
    return [a for p in registered() for a in p.approximations(strategies, workload, options)]
