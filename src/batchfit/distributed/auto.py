"""The candidate rules of ``plan --strategies auto``, one per parallelism, and what they read and list.

Each parallelism's rule (its entry in ``distributed/parallelisms.py`` names it: ``Parallelism.auto_combinations``,
``auto``, ``auto_skip``, ``auto_rule``, ``auto_bounds``) is written below: it reads a model's :class:`ModelFacts`
and an :class:`AutoContext` (the world, the pipeline schedule and its micro-batches) and lists :class:`Candidate`
rows; ``plan/candidates.py`` iterates over the registry, names the rows and ranks nothing. Pure Python:
:func:`model_facts` imports torch when it builds the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batchfit.errors import OptionError


@dataclass(frozen=True, kw_only=True)
class ModelFacts:
    """What the rules read of a model (``model_facts`` builds it on the meta device)."""

    name: str
    """The workload's name, for the reasons."""
    n_layers: int | None = None
    """Blocks a pipeline splits; None: the model has no embed / blocks / norm / head split."""
    pp_tp_split_backward: bool = True
    """Whether TP composes inside its pipeline under a split-backward (zero-bubble) schedule: not for
    an HF model on a sequence-parallel plan (``plan/pipeline.py`` says why)."""
    heads: int | None = None
    """Attention query heads (None: not known, not checked)."""
    kv_heads: int | None = None
    """Attention key/value heads (None: as many as ``heads``)."""
    tp_plan: bool = False
    """Whether a tensor-parallel plan applies (the workload's own ``parallelize`` or a shipped one)."""
    tp_missing: str | None = None
    """Why no shipped plan applies, when none does (``tp_plans.no_plan_reason``)."""
    experts: int | None = None
    """Routed experts of a mixture-of-experts model (for the ep component); None: a dense model."""
    loss: str = "plain"
    """--loss: pipelines trace the plain loss only."""
    seq_len: int | None = None
    """Tokens per sample (the cp component's rule reads it); None: not a sequence model."""
    unread: str | None = None
    """Why the model could not be built on the meta device (then TP is left to the tracer, pp skipped)."""


@dataclass(frozen=True, kw_only=True)
class AutoContext:
    """What a rule reads besides the model: the world's shape and the pipeline schedule asked for."""

    gpus: int
    nodes: int = 1
    gpus_per_node: int
    pp_schedule: str = "1f1b"
    """--pp-schedule: which pipelines apply (its micro-batches, a zero-bubble schedule's split backward)."""
    microbatches: int = 0
    """--microbatches (0: the schedule's default)."""


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One combination of a world: its strategy name, degrees, and why it is skipped (or None)."""

    name: str = ""
    """As ``--strategies`` names it: 'fsdp', 'pp2+fsdp+tp4', ...; '' in a rule's row, which
    ``plan/candidates.py`` names from its degrees (``StrategyName`` writes it)."""
    gpus: int
    nodes: int = 1
    pp: int = 1
    dp: int = 1
    """Data-parallel ranks (samples split over them): GPUs / (pp x tp x cp)."""
    tp: int = 1
    degrees: dict[str, int] = field(default_factory=dict)
    """Degrees of further components (``cp``, ``ep``): ``Parallelism.auto``."""
    shard: str = "none"
    """The data-parallel wrap: 'ddp', 'fsdp', 'fsdp-noreshard', 'hsdp', 'zero1', 'zero2' or 'none'."""
    replicas: int = 1
    rule: str = ""
    """The rule (``plan/candidates.py``'s docstring) that made it."""
    skipped: str | None = None
    """Why it cannot apply to this model, when it cannot (it is then not traced)."""


def model_facts(workload, options=None) -> ModelFacts:
    """The facts the rules read, from ``workload``'s model built on the meta device (no memory)."""
    import torch

    from batchfit.distributed.pipeline import pipeline_layers
    from batchfit.distributed.pipeline_hf import hf_layers
    from batchfit.distributed.tp_plans import no_plan_reason, sequence_parallel, tp_plan

    try:
        with torch.device("meta"):
            model = workload.build_model()
    except Exception as error:  # a model that cannot be built without memory: the tracer decides TP
        return ModelFacts(name=workload.name, tp_plan=True, unread=f"{type(error).__name__}: {error}"[:200],
                          loss=getattr(options, "loss", "plain") or "plain", seq_len=workload.tokens_per_sample)
    n_layers = pipeline_layers(model)
    pp_tp_split_backward = hf_layers(model) is None or not sequence_parallel(model)
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    heads = getattr(cfg, "n_heads", None) or getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "n_kv_heads", None) or getattr(cfg, "num_key_value_heads", None)
    experts = next((getattr(cfg, k) for k in ("n_experts", "num_experts", "num_local_experts", "n_routed_experts")
                    if isinstance(getattr(cfg, k, None), int)), None)
    has_plan = workload.parallelize is not None or tp_plan(model) is not None
    tp_missing = None if has_plan else no_plan_reason(model)
    return ModelFacts(name=workload.name, n_layers=n_layers, pp_tp_split_backward=pp_tp_split_backward,
                      heads=heads if isinstance(heads, int) else None,
                      kv_heads=kv if isinstance(kv, int) else None, tp_plan=has_plan, tp_missing=tp_missing,
                      experts=experts, loss=getattr(options, "loss", "plain") or "plain",
                      seq_len=workload.tokens_per_sample)

# The rules, one per parallelism (each named by its entry in ``distributed/parallelisms.py``): the data-parallel
# wraps', tp's and pp's combinations, cp's and ep's degrees on them, tp's skip on a mixture of experts, and what
# each leaves out only to bound the tracing (``Parallelism.auto_bounds``, printed with every ranking).

MIN_AUTO_CP_SEQ = 8192
"""auto adds context parallelism from this sequence length on (shorter sequences fit without a ring)."""


def divisors(n: int) -> list[int]:
    """1 .. n's divisors, ascending (auto's degrees divide the ranks they split)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def cp_degrees(context: AutoContext, facts: ModelFacts, base: Candidate) -> list[tuple[int, str | None]]:
    """cp<N> on FSDP2 without pp, for attention models from MIN_AUTO_CP_SEQ tokens: the smallest and largest
    N within a node that divides the data-parallel ranks and leaves sequence / (2 N) whole (torch's
    head-tail load balancing)."""
    seq = facts.seq_len or 0
    if base.shard != "fsdp" or base.pp > 1 or facts.heads is None or seq < MIN_AUTO_CP_SEQ:
        return []
    room = context.gpus_per_node // base.tp
    fit = [d for d in divisors(base.dp) if 1 < d <= room and seq % (2 * d) == 0]
    return [(d, None) for d in sorted({fit[0], fit[-1]})] if fit else []


def ep_degrees(context: AutoContext, facts: ModelFacts, base: Candidate) -> list[tuple[int, str | None]]:
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


def data_parallel_combinations(context: AutoContext, facts: ModelFacts) -> list[Candidate]:
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


def tp_combinations(context: AutoContext, facts: ModelFacts) -> list[Candidate]:
    """tp<N> for N in 2..(one node's GPUs, at most MAX_AUTO_TP) dividing the GPUs, FSDP2 over the rest
    (``tp<N>`` alone when it spans every GPU), each skipped with :func:`tp_reason` where it cannot apply."""
    rows = []
    for tp in (d for d in divisors(context.gpus) if 1 < d <= _tp_cap(context)):
        dp = context.gpus // tp
        rows.append(Candidate(gpus=context.gpus, nodes=context.nodes, dp=dp, tp=tp,
                              shard="fsdp" if dp > 1 else "none", rule="tp<N> within a node, FSDP2 over the rest",
                              skipped=tp_reason(facts, tp)))
    return rows


_MOE_TP = ("TP of a mixture of experts is traced with ep<N> beside it (torchtitan's etp=1: the experts "
           "sharded by ep, not by tp): see ep<N>+fsdp+tp<M>")


def moe_tp_skip(context: AutoContext, facts: ModelFacts, row: Candidate) -> str | None:
    """An MoE's experts are tensor-parallel only beside ep (``distributed/tp_plans_moe.py``)."""
    return _MOE_TP if facts.experts and row.tp > 1 and "ep" not in row.degrees else None


def _pp_reason(facts: ModelFacts, pp: int, schedule: str, microbatches: int) -> str | None:
    """Why pp<``pp``> cannot apply: a model without embed / blocks / norm / head (batchfit's zoo transformers
    and HF causal LMs by their config's ``base_model_pp_plan`` have them), a loss other than the plain one, or
    layers that do not split into ``pp`` equal stages (x V under interleaved 1F1B) with micro-batches the
    schedule accepts; None when it can."""
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


def pp_combinations(context: AutoContext, facts: ModelFacts) -> list[Candidate]:
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


DP_BOUNDS = ("zero1/zero2 and hsdp only without pp and TP (batchfit's strategy grammar does not compose them)",
             "hsdp<R>: R = the nodes and up to two halvings (not below 2) on several nodes; R = 2 or 4 (2+ GPUs per "
             "shard group) on one")
TP_BOUNDS = (f"tp at most one node's GPUs (and {MAX_AUTO_TP}): TP's collectives never overlap compute, across nodes "
             "they run at network speed",)
PP_BOUNDS = (f"pp at most {MAX_AUTO_PP} stages; inside a pipeline only FSDP2 (fsdp-noreshard only under a zero-bubble "
             "schedule, which needs it: torch's PipelineStage keeps a stage's parameters gathered through the "
             "backwards anyway; no ddp, zero1/2, hsdp) and TP none or the largest allowed",)
CP_RULE = "cp<N>: ring attention over N ranks of each sample, FSDP2 over dp x cp"
CP_BOUNDS = (f"cp only from a sequence of {MIN_AUTO_CP_SEQ:,} tokens, over FSDP2 without pp, at the smallest and "
             "largest degree that fit one node",)
EP_RULE = "ep<N>+fsdp[+tp<M>]: each rank keeps experts / N, all-to-all dispatch (etp=1 with tp)"
EP_BOUNDS = ("ep only on a mixture of experts, ep<N>+fsdp[+tp<M>] without pp, at the largest degree within a node",)
