"""``plan --strategies auto``: every parallelism combination worth tracing for a world and a model.

One function, :func:`candidates`, lists them; each combination comes from a written rule below,
and a combination a rule cannot apply to this model (no tensor-parallel plan, heads or layers
that do not divide) is listed as **skipped, with the reason**, never dropped in silence. The
rules that only keep the count bounded (each candidate is a tracing session: seconds to
minutes on a CPU) are :data:`BOUNDS`, printed with every ranking.

A combination is the degrees ``pp x dp x tp = world`` (``cp`` joins the product and ``ep``
borrows from dp x tp: each further parallelism's own rule, ``Parallelism.auto`` in
``distributed/parallelisms.py``, read by :func:`registered_components`) and the data-parallel wrap
of the dp ranks. Rules:

- **pp<N>** (``plan/pipeline.py``): N in 2..MAX_AUTO_PP dividing the GPUs; only a model with
  embed / blocks / norm / head (batchfit's zoo transformers, HF causal LMs by their config's
  ``base_model_pp_plan``; an HF one on a sequence-parallel TP plan without TP inside under a
  zero-bubble schedule) whose layers split into N equal
  stages (x V under interleaved 1F1B), with ``--microbatches`` the schedule accepts and the
  plain loss; inside a pipeline the data-parallel wrap is FSDP2 (torchtitan composes pp with
  FSDP2 and TP; ``fsdp-noreshard`` under a zero-bubble schedule, which needs it), and TP is none
  or the largest degree the TP rule allows there.
- **tp<N>** (``distributed/tp_plans.py``): N in 2..(GPUs of one node, at most MAX_AUTO_TP)
  dividing the GPUs left by pp; only a model with a tensor-parallel plan whose query and
  key/value heads divide by N. ``tp<N>`` when it spans every GPU left, else ``fsdp+tp<N>``.
  On a mixture of experts only with ep<N> beside it (the ep component below: ``ep8+fsdp+tp2``).
- **data parallel over dp ranks** without pp or TP: ``ddp``, ``fsdp`` (ZeRO-3),
  ``fsdp-noreshard``, ``zero1``, ``zero2`` and ``hsdp<R>``: on several nodes R = the node count
  and up to two halvings of it, not below 2 (shard groups of whole nodes); on one node R in 2, 4
  with at least 2 GPUs per shard group.
- One GPU: the plain single-GPU step, once.

Counts (a model every rule applies to; the plan's --help and docs/tracing/auto.md say them): 2 GPUs 7,
4 GPUs 11, 8 GPUs 15, 16 (2 nodes) 15, 64 (8 nodes) 17. Narrow with ``--strategies`` (a list).
Pure Python; :func:`model_facts` builds the model on the meta device (torch, imported there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from batchfit.distributed import parallelisms
from batchfit.distributed.parallelisms import MIN_AUTO_CP_SEQ, divisors
from batchfit.distributed.strategy_name import StrategyName
from batchfit.errors import OptionError
from batchfit.plan.world import World

MAX_AUTO_PP = 8
"""auto tries pipelines of up to 8 stages (published 405B runs use pp8; the 1F1B bubble grows with N)."""
MAX_AUTO_TP = 8
"""auto tries TP degrees up to one node's GPUs, at most 8: TP beyond a node's NVLink is rarely worth it."""
DP_WRAPS = ("ddp", "fsdp", "fsdp-noreshard", "zero1", "zero2")
"""The data-parallel wraps auto tries without pp or TP (hsdp<R> besides)."""

BOUNDS = (
    f"pp at most {MAX_AUTO_PP} stages; inside a pipeline only FSDP2 (fsdp-noreshard only under a zero-bubble "
    "schedule, which needs it: torch's PipelineStage keeps a stage's parameters gathered through the backwards "
    "anyway; no ddp, zero1/2, hsdp) and TP none or the largest allowed",
    f"tp at most one node's GPUs (and {MAX_AUTO_TP}): TP's collectives never overlap compute, across nodes "
    "they run at network speed",
    "zero1/zero2 and hsdp only without pp and TP (batchfit's strategy grammar does not compose them)",
    "hsdp<R>: R = the nodes and up to two halvings (not below 2) on several nodes; R = 2 or 4 (2+ GPUs per shard "
    "group) on one",
    f"cp only from a sequence of {MIN_AUTO_CP_SEQ:,} tokens, over FSDP2 without pp, at the smallest and largest "
    "degree that fit one node; ep only on a mixture of experts, ep<N>+fsdp[+tp<M>] without pp, at the largest "
    "degree within a node",
)
"""What auto leaves out only to bound the tracing (not because it cannot apply): printed with the ranking."""


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
class Candidate:
    """One combination of a world: its strategy name, degrees, and why it is skipped (or None)."""

    name: str
    """As ``--strategies`` names it (``plan/sharded.py``'s grammar): 'fsdp', 'pp2+fsdp+tp4', ..."""
    gpus: int
    nodes: int = 1
    pp: int = 1
    dp: int = 1
    """Data-parallel ranks (samples split over them): GPUs / (pp x tp x cp)."""
    tp: int = 1
    degrees: dict[str, int] = field(default_factory=dict)
    """Degrees of further components (``cp``, ``ep``): :func:`registered_components`."""
    shard: str = "none"
    """The data-parallel wrap: 'ddp', 'fsdp', 'fsdp-noreshard', 'hsdp', 'zero1', 'zero2' or 'none'."""
    replicas: int = 1
    rule: str = ""
    """The rule (of the module docstring) that made it."""
    skipped: str | None = None
    """Why it cannot apply to this model, when it cannot (it is then not traced)."""


@dataclass(frozen=True, kw_only=True)
class Component:
    """A further parallelism dimension (cp, ep): its degrees for a base combination, and its name part.

    ``degrees(world, facts, base) -> [(degree, reason or None)]`` (degree 1, meaning none, is
    always tried and need not be listed); a degree with a reason is listed as skipped."""

    key: str
    """'cp' or 'ep': the Candidate.degrees key, a degree of ``StrategyName`` (which writes it into the name)."""
    takes_gpus: bool
    """True: a factor of the world (cp: GPUs = pp x dp x cp x tp); False: borrows from dp (ep divides dp)."""
    degrees: Callable[[World, ModelFacts, Candidate], list[tuple[int, str | None]]]
    rule: str
    """One line: the rule, as the module docstring writes the others."""


def registered_components() -> tuple[Component, ...]:
    """The further components auto tries: every registered parallelism with a candidate rule (cp, ep, and a
    new one's: ``Parallelism.auto`` in ``distributed/parallelisms.py``), in the registry's order."""
    return tuple(Component(key=p.key, takes_gpus=p.takes_gpus, degrees=p.auto, rule=p.auto_rule)
                 for p in parallelisms.registered() if p.auto is not None)


def _hsdp_replicas(world: World) -> list[int]:
    if world.nodes > 1:
        out, r = [], world.nodes
        while r >= 2 and world.nodes % r == 0 and len(out) < 3:
            out.append(r)
            r //= 2
        return sorted(out)
    return [r for r in (2, 4) if world.gpus % r == 0 and world.gpus // r >= 2]


def _tp_reason(facts: ModelFacts, tp: int) -> str | None:
    if not facts.tp_plan:
        why = f": {facts.tp_missing}" if facts.tp_missing else ""
        return (f"{facts.name} has no tensor-parallel plan{why} (batchfit ships plans for its zoo transformers, "
                "GPT-2, BERT and HF models whose config has a base_model_tp_plan; a Workload can give its own "
                "parallelize)")
    kv = facts.kv_heads or facts.heads
    if facts.heads is not None and (facts.heads % tp or kv % tp):
        return f"{facts.heads} query / {kv} key-value heads do not divide by {tp}"
    return None


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
    from batchfit.distributed.pp_schedules import parse_schedule

    try:
        return parse_schedule(schedule).splits_backward
    except OptionError:
        return False  # a bad name: each pp candidate is skipped with the parser's reason


def _pp_wrap(schedule: str) -> str:
    """FSDP2 inside a pipeline; kept gathered from forward to backward under a zero-bubble schedule,
    whose split backward needs it (``pp_schedules.check_inner``)."""
    from batchfit.distributed.pp_schedules import parse_schedule

    try:
        return "fsdp-noreshard" if parse_schedule(schedule).splits_backward else "fsdp"
    except OptionError:
        return "fsdp"  # a bad name: each pp candidate is skipped with the parser's reason


def _name(pp: int, wrap: str, tp: int, degrees: dict[str, int] | None = None) -> str:
    """The grammar's name (``distributed/strategy_name.py`` writes it): [pp<N>+][ep<N>+]wrap[+cp<N>][+tp<N>]
    ('' wrap: none; 'tp4' alone)."""
    return StrategyName.of(shard=wrap or "none", degrees={"tp": tp, "pp": pp, **(degrees or {})}).name


def candidates(world: World, facts: ModelFacts, *, pp_schedule: str = "1f1b", microbatches: int = 0,
               components: tuple[Component, ...] | None = None) -> list[Candidate]:
    """Every combination of ``world`` for a model of ``facts``, skipped ones with their reason
    (the rules: the module docstring). The plain data-parallel ones first, then TP, then pp."""
    components = registered_components() if components is None else components
    g = world.gpus
    base = dict(gpus=g, nodes=world.nodes)
    if g == 1:
        return [Candidate(name="fsdp", **base, rule="one GPU: the plain single-GPU step")]
    out: list[Candidate] = []
    tp_cap = min(world.gpus_per_node, MAX_AUTO_TP)

    def add(candidate: Candidate) -> None:
        if all(c.name != candidate.name for c in out):
            out.append(candidate)

    # 1. data parallel over every GPU
    for wrap in DP_WRAPS:
        add(Candidate(name=wrap, **base, dp=g, shard=wrap, rule="data parallel over every GPU"))
    for r in _hsdp_replicas(world):
        add(Candidate(name=StrategyName(shard="hsdp", replicas=r).name, **base, dp=g, shard="hsdp", replicas=r,
                      rule="hsdp<R>: shard groups of whole nodes (or 2+ GPUs on one node), replicated R times"))
    # 2. tensor parallel (FSDP2 over the rest)
    for tp in (d for d in divisors(g) if 1 < d <= tp_cap):
        dp = g // tp
        add(Candidate(name=_name(1, "fsdp" if dp > 1 else "", tp), **base, dp=dp, tp=tp,
                      shard="fsdp" if dp > 1 else "none", rule="tp<N> within a node, FSDP2 over the rest",
                      skipped=_tp_reason(facts, tp)))
    # 3. pipelines
    wrap = _pp_wrap(pp_schedule)
    for pp in (d for d in divisors(g) if 1 < d <= MAX_AUTO_PP):
        inner = g // pp
        reason = _pp_reason(facts, pp, pp_schedule, microbatches)
        tp_inside = facts.pp_tp_split_backward or not _splits_backward(pp_schedule)
        tps = [1] + [t for t in divisors(inner) if 1 < t <= tp_cap and _tp_reason(facts, t) is None
                     and tp_inside][-1:]
        for tp in tps if reason is None else [1]:
            dp = inner // tp
            add(Candidate(name=_name(pp, wrap if dp > 1 else "", tp), **base, pp=pp, dp=dp, tp=tp,
                          shard=wrap if dp > 1 else "none",
                          rule="pp<N> stages, FSDP2 inside, TP none or the largest allowed", skipped=reason))
    # 4. further components (cp, ep): on each combination of 1-3 that applies and has room for them
    for component in components:
        for c in [c for c in out if c.skipped is None and c.shard != "hsdp" and not c.degrees]:  # bases; hsdp<R>: none
            for degree, reason in component.degrees(world, facts, c):
                if degree <= 1 or (c.dp if component.takes_gpus else c.dp * c.tp) % degree:  # ep borrows dp x tp
                    continue
                dp = c.dp // degree if component.takes_gpus else c.dp
                degrees = {**c.degrees, component.key: degree}
                name = _name(c.pp, "" if c.shard == "none" else c.shard, c.tp, degrees)
                add(replace(c, name=name, dp=dp, degrees=degrees, rule=component.rule, skipped=reason))
    if facts.experts:  # an MoE's experts are tensor-parallel only beside ep (distributed/tp_plans_moe.py)
        out = [replace(c, skipped=_MOE_TP) if c.tp > 1 and "ep" not in c.degrees and c.skipped is None else c
               for c in out]
    return out


_MOE_TP = ("TP of a mixture of experts is traced with ep<N> beside it (torchtitan's etp=1: the experts "
           "sharded by ep, not by tp): see ep<N>+fsdp+tp<M>")


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
                      experts=experts, loss=getattr(options, "loss", "plain") or "plain")
