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

Importing this module does not import torch: each entry's module is imported when it is asked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from batchfit.distributed.auto import AutoContext, Candidate, ModelFacts
from batchfit.errors import OptionError


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
    """What a row using it is, in a sentence ('expert-parallel'): the emits' refusals say it."""
    accelerate: Callable[[object, int], dict[str, object]] | None = None
    """``(row, degree) -> its keys in Accelerate's parallelism_config`` for a recommended row using it (cp: its
    size and the ring's rotation; ``{}`` for one written with the wraps' sizes, tp); raises OptionError for a
    row Accelerate cannot run it in. None: Accelerate's config cannot say it, and ``plan --emit accelerate``
    refuses such a row (its :attr:`words`)."""
    runs_experts: bool = False
    """Whether it runs a mixture's experts itself (ep: one grouped GEMM, not the model's loop), so the plan's
    routing line says so when every strategy uses it."""

    def used_by(self, layout) -> bool:
        """Whether ``layout`` (a ``Strategy``, a plan row) uses this parallelism."""
        return degree_of(layout, self.key) > 1 if self.degree else self.uses(layout)


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


def _cp_degrees(context: AutoContext, facts: ModelFacts, base: Candidate) -> list[tuple[int, str | None]]:
    """cp<N> on FSDP2 without pp, for attention models from MIN_AUTO_CP_SEQ tokens: the smallest and largest
    N within a node that divides the data-parallel ranks and leaves sequence / (2 N) whole (torch's
    head-tail load balancing)."""
    seq = facts.seq_len or 0
    if base.shard != "fsdp" or base.pp > 1 or facts.heads is None or seq < MIN_AUTO_CP_SEQ:
        return []
    room = context.gpus_per_node // base.tp
    fit = [d for d in divisors(base.dp) if 1 < d <= room and seq % (2 * d) == 0]
    return [(d, None) for d in sorted({fit[0], fit[-1]})] if fit else []


def _ep_degrees(context: AutoContext, facts: ModelFacts, base: Candidate) -> list[tuple[int, str | None]]:
    """ep<N>+fsdp[+tp<M>] for a mixture of experts, without pp: the largest N within a node dividing both the
    experts and the dp x tp ranks it borrows from (torchtitan's etp=1)."""
    fsdp = base.shard == "fsdp" or (base.shard == "none" and base.tp > 1)  # tp<M> alone: FSDP2 over one rank
    if not facts.experts or not fsdp or base.pp > 1:
        return []
    fit = [d for d in divisors(base.dp * base.tp) if 1 < d <= context.gpus_per_node and facts.experts % d == 0]
    return [(fit[-1], None)] if fit else []


MAX_AUTO_PP = 8
"""auto tries pipelines of up to 8 stages (published 405B runs use pp8; the 1F1B bubble grows with N)."""
MAX_AUTO_TP = 8
"""auto tries TP degrees up to one node's GPUs, at most 8: TP beyond a node's NVLink is rarely worth it."""
DP_WRAPS = ("ddp", "fsdp", "fsdp-noreshard", "zero1", "zero2")
"""The data-parallel wraps auto tries without pp or TP (hsdp<R> besides)."""


def _hsdp_replicas(context: AutoContext) -> list[int]:
    if context.nodes > 1:
        out, r = [], context.nodes
        while r >= 2 and context.nodes % r == 0 and len(out) < 3:
            out.append(r)
            r //= 2
        return sorted(out)
    return [r for r in (2, 4) if context.gpus % r == 0 and context.gpus // r >= 2]


def _data_parallel(context: AutoContext, facts: ModelFacts) -> list[Candidate]:
    """Every wrap of DP_WRAPS over every GPU, then hsdp<R>: R = the nodes and up to two halvings (not below 2)
    on several nodes, R = 2 or 4 with 2+ GPUs per shard group on one."""
    g = context.gpus
    return ([Candidate(gpus=g, nodes=context.nodes, dp=g, shard=wrap, rule="data parallel over every GPU")
             for wrap in DP_WRAPS]
            + [Candidate(gpus=g, nodes=context.nodes, dp=g, shard="hsdp", replicas=r,
                         rule="hsdp<R>: shard groups of whole nodes (or 2+ GPUs on one node), replicated R times")
               for r in _hsdp_replicas(context)])


def _tp_cap(context: AutoContext) -> int:
    return min(context.gpus_per_node, MAX_AUTO_TP)


def tp_reason(facts: ModelFacts, tp: int) -> str | None:
    """Why tp<``tp``> cannot apply to the model of ``facts`` (no tensor-parallel plan, heads that do not
    divide), or None."""
    if not facts.tp_plan:
        why = f": {facts.tp_missing}" if facts.tp_missing else ""
        return (f"{facts.name} has no tensor-parallel plan{why} (batchfit ships plans for its zoo transformers, "
                "GPT-2, BERT and HF models whose config has a base_model_tp_plan; a Workload can give its own "
                "parallelize)")
    kv = facts.kv_heads or facts.heads
    if facts.heads is not None and (facts.heads % tp or kv % tp):
        return f"{facts.heads} query / {kv} key-value heads do not divide by {tp}"
    return None


def _tp_combinations(context: AutoContext, facts: ModelFacts) -> list[Candidate]:
    """tp<N> for N in 2..(one node's GPUs, at most MAX_AUTO_TP) dividing the GPUs, FSDP2 over the rest."""
    rows = []
    for tp in (d for d in divisors(context.gpus) if 1 < d <= _tp_cap(context)):
        dp = context.gpus // tp
        rows.append(Candidate(gpus=context.gpus, nodes=context.nodes, dp=dp, tp=tp,
                              shard="fsdp" if dp > 1 else "none", rule="tp<N> within a node, FSDP2 over the rest",
                              skipped=tp_reason(facts, tp)))
    return rows


_MOE_TP = ("TP of a mixture of experts is traced with ep<N> beside it (torchtitan's etp=1: the experts "
           "sharded by ep, not by tp): see ep<N>+fsdp+tp<M>")


def _moe_tp(context: AutoContext, facts: ModelFacts, row: Candidate) -> str | None:
    """An MoE's experts are tensor-parallel only beside ep (``distributed/tp_plans_moe.py``)."""
    return _MOE_TP if facts.experts and row.tp > 1 and "ep" not in row.degrees else None


def _pp_reason(facts: ModelFacts, pp: int, schedule: str, microbatches: int) -> str | None:
    from batchfit.distributed.pp_schedules import check_pipeline, parse_schedule  # no torch at import

    if facts.unread:
        return f"{facts.name} could not be built on the meta device to count its layers ({facts.unread})"
    if facts.n_layers is None:
        return (f"{facts.name} has no embed / blocks / norm / head split (pipeline parallelism covers "
                "batchfit's zoo transformers and HF causal LMs with a base_model_pp_plan)")
    if facts.loss != "plain":
        return f"--loss {facts.loss} is not traced under pipeline parallelism (the last stage's plain loss only)"
    try:
        check_pipeline(parse_schedule(schedule, microbatches), pp, facts.n_layers)
    except OptionError as error:
        return str(error)
    return None


def _splits_backward(schedule: str) -> bool:
    """Whether ``schedule`` is a zero-bubble one (a split backward); False for a bad name, whose pp
    candidates are each skipped with the parser's reason."""
    from batchfit.distributed.pp_schedules import parse_schedule

    try:
        return parse_schedule(schedule).splits_backward
    except OptionError:
        return False


def _pp_combinations(context: AutoContext, facts: ModelFacts) -> list[Candidate]:
    """pp<N> for N in 2..MAX_AUTO_PP dividing the GPUs, FSDP2 inside (kept gathered from forward to backward
    under a zero-bubble schedule, whose split backward needs it: ``pp_schedules.check_inner``), TP none or
    the largest degree tp's rule allows there."""
    splits = _splits_backward(context.pp_schedule)
    wrap, tp_inside = "fsdp-noreshard" if splits else "fsdp", facts.pp_tp_split_backward or not splits
    rows = []
    for pp in (d for d in divisors(context.gpus) if 1 < d <= MAX_AUTO_PP):
        inner = context.gpus // pp
        reason = _pp_reason(facts, pp, context.pp_schedule, context.microbatches)
        tps = [1] + [t for t in divisors(inner) if 1 < t <= _tp_cap(context) and tp_reason(facts, t) is None
                     and tp_inside][-1:]
        for tp in tps if reason is None else [1]:
            dp = inner // tp
            rows.append(Candidate(gpus=context.gpus, nodes=context.nodes, pp=pp, dp=dp, tp=tp,
                                  shard=wrap if dp > 1 else "none", skipped=reason,
                                  rule="pp<N> stages, FSDP2 inside, TP none or the largest allowed"))
    return rows


def _own_group(collective, strategy) -> int:
    return collective.group_size


def _ring(collective, strategy) -> int:  # the cp ring over cp x tp consecutive ranks (tp innermost)
    return collective.group_size * strategy.tp


def _ring_pass(collective) -> float | None:  # the ring's dK/dV pass (permute_tensor): a whole buffer to the next
    return 1.0 if collective.op == "all_to_all" else None


def _cp_accelerate(row, degree: int) -> dict[str, object]:
    """torch's ring with its default all-gather rotation (what the trace ran), under FSDP2 (Accelerate's only)."""
    if row.shard not in ("fsdp", "fsdp-noreshard"):
        raise OptionError(f"the recommended {row.strategy}: Accelerate runs context parallelism with FSDP2 only: "
                          "emit the YAML (`emit` config.yaml), or plan fsdp+cp<N> strategies")
    return {"parallelism_config_cp_size": degree, "parallelism_config_cp_comm_strategy": "allgather"}


def _with_the_wraps(row, degree: int) -> dict[str, object]:
    return {}  # parallelism_config_tp_size: written beside the data-parallel sizes (plan/emit.py), tp1 too


def _tp_mesh() -> FakeMesh:
    from batchfit.distributed.tp_plans import tp_plan

    return FakeMesh(parallelize=lambda model, options: tp_plan(model, options.tp_loss))


def _zero_mesh() -> FakeMesh:
    from batchfit.distributed.zero import with_sharded_optimizer

    return FakeMesh(optimizer=with_sharded_optimizer)


def _cp_mesh() -> FakeMesh:
    from batchfit.distributed.context_parallel import check_ring, on_fake_mesh, ring_label

    return FakeMesh(workload=on_fake_mesh, label=ring_label, check=check_ring)


def _ep_mesh() -> FakeMesh:
    from batchfit.distributed.expert_parallel import dispatch_label, experts_elsewhere

    return FakeMesh(params_elsewhere=experts_elsewhere, label=dispatch_label)


_REGISTRY: list[Parallelism] = [
    # the data-parallel wraps: the name's shard, no degree of their own; auto's first combinations
    Parallelism(key="dp", degree=False, token="ddp / fsdp / fsdp-noreshard / hsdp<R> / zero1 / zero2",
                module="distributed/strategy.py", auto_combinations=_data_parallel,
                auto_bounds=("zero1/zero2 and hsdp only without pp and TP (batchfit's strategy grammar does not "
                             "compose them)",
                             "hsdp<R>: R = the nodes and up to two halvings (not below 2) on several nodes; R = 2 or "
                             "4 (2+ GPUs per shard group) on one")),
    Parallelism(key="tp", token="tp<N>", module="distributed/tp_plans.py", torchtitan_key="tensor_parallel_degree",
                config_key="tensor_parallel", config_at_1=True, group="tp", span=_own_group, critical_path=True,
                name_order=4, auto_combinations=_tp_combinations, auto_skip=_moe_tp, fake_mesh=_tp_mesh,
                words="tensor-parallel", accelerate=_with_the_wraps,
                auto_bounds=(f"tp at most one node's GPUs (and {MAX_AUTO_TP}): TP's collectives never overlap "
                             "compute, across nodes they run at network speed",)),
    Parallelism(key="zero", degree=False, token="zero1 / zero2", module="distributed/zero.py", approximations=_zero,
                uses=lambda layout: getattr(layout, "shard", None) in ("zero1", "zero2"), fake_mesh=_zero_mesh),
    Parallelism(key="pp", token="pp<N>", module="distributed/pipeline.py", approximations=_pipeline,
                torchtitan_key="pipeline_parallel_degree", config_key="pipeline_parallel", name_order=0,
                auto_combinations=_pp_combinations, words="pipeline-parallel",
                auto_bounds=(f"pp at most {MAX_AUTO_PP} stages; inside a pipeline only FSDP2 (fsdp-noreshard only "
                             "under a zero-bubble schedule, which needs it: torch's PipelineStage keeps a stage's "
                             "parameters gathered through the backwards anyway; no ddp, zero1/2, hsdp) and TP none "
                             "or the largest allowed",)),
    Parallelism(key="cp", token="cp<N>", module="distributed/context_parallel.py", approximations=_context_parallel,
                torchtitan_key="context_parallel_degree", config_key="context_parallel", group="cp", span=_ring,
                name_order=3, auto=_cp_degrees, fake_mesh=_cp_mesh, fsdp_shards_over=True, bus=_ring_pass,
                auto_rule="cp<N>: ring attention over N ranks of each sample, FSDP2 over dp x cp",
                auto_bounds=(f"cp only from a sequence of {MIN_AUTO_CP_SEQ:,} tokens, over FSDP2 without pp, at "
                             "the smallest and largest degree that fit one node",),
                in_pipeline=("context parallelism inside a pipeline is not traced yet: use fsdp+cp<N>[+tp<T>] "
                             "without pp, or pp<N>+fsdp without cp"),
                words="context-parallel", accelerate=_cp_accelerate),
    # ep<N>: the sparse mesh's innermost dimension, N consecutive ranks (the tp ranks among them: etp=1)
    Parallelism(key="ep", token="ep<N>", module="distributed/expert_parallel.py", approximations=_expert_parallel,
                torchtitan_key="expert_parallel_degree", torchtitan_at_1=False, config_key="expert_parallel",
                group="ep", span=_own_group, critical_path=True, name_order=1, takes_gpus=False, auto=_ep_degrees,
                fake_mesh=_ep_mesh, runs_experts=True, words="expert-parallel",
                auto_rule="ep<N>+fsdp[+tp<M>]: each rank keeps experts / N, all-to-all dispatch (etp=1 with tp)",
                auto_bounds=("ep only on a mixture of experts, ep<N>+fsdp[+tp<M>] without pp, at the largest degree "
                             "within a node",)),
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
