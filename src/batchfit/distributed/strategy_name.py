"""Strategy names, parsed once: ``pp2+ep4+fsdp+tp2`` into typed degrees, as torchtitan's
``ParallelDims`` holds them, then laid on a world of GPUs (a ``Strategy``).

The one place that reads a strategy name (``tests/test_layout.py`` checks it): everything
downstream reads the degrees of :class:`StrategyName` or of the resolved ``Strategy``, never the
text. Names (components joined by ``+``; pp first, the others in any order, written back as
``[pp<N>+][ep<N>+]<wrap>[+cp<N>][+tp<N>]``):

    ddp               DistributedDataParallel over all GPUs
    fsdp              FSDP2, parameters resharded after forward (ZeRO-3)
    fsdp-noreshard    FSDP2 with reshard_after_forward=False: a block's gathered parameters kept
                      from its forward to its backward (ZeRO-2-like then), sharded at rest
    zero1, zero2      DDP + torch's ZeroRedundancyOptimizer: optimizer state (zero2: and gradients) sharded
    hsdp<R>           FSDP2 sharded within groups of world/R GPUs, replicated R times
    tp<N>             tensor parallelism over all N GPUs (for data parallelism over the rest, fsdp+tp<N>)
    fsdp+tp<N>        a 2-D mesh: TP over groups of N GPUs, FSDP2 across the groups
    fsdp+cp<N>[+tp<T>], ddp+cp<N>
                      context parallelism: each rank holds sequence/N of its samples (torch's ring,
                      ``distributed/context_parallel.py``); FSDP2 / DDP over dp x cp
    pp<N>[+X]         a pipeline of N stages, each running X (any name above) on world/N GPUs
    ep<N>+X           expert parallelism (``distributed/expert_parallel.py``): each MoE layer's experts
                      split over groups of N ranks borrowed from dp x tp (torchtitan's etp=1), X being
                      fsdp, fsdp-noreshard, fsdp+tp<M> or tp<M>

On one GPU every strategy is the plain single-GPU step (``shard`` "none"). Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from batchfit.distributed import parallelisms
from batchfit.errors import OptionError

SHARDS = ("none", "ddp", "fsdp", "fsdp-noreshard", "hsdp", "zero1", "zero2")
"""The data-parallel wraps: "none" is no wrapper (tp<N> alone, pp<N> alone, one GPU)."""
FSDP_SHARDS = ("fsdp", "fsdp-noreshard", "hsdp")
"""The wraps that are FSDP2 (``fully_shard``)."""

FIELDS = ("tp", "cp", "ep", "pp")
"""The degrees with a field of their own on StrategyName and Strategy; a registered parallelism without
one (a new one, a test's toy) keeps its degree in ``StrategyName.more``."""
_WRAP_ORDER = 2
"""Where the wrap stands in a name written back: after pp (0) and ep (1), before cp (3) and tp (4)."""
NAMES_HELP = ("ddp, fsdp, fsdp-noreshard, zero1, zero2, hsdp<R>, tp<N>, fsdp[-noreshard]+tp<N>, fsdp+cp<N>[+tp<T>], "
              "ddp+cp<N>, pp<N>[+any of these], ep<N>+fsdp[+tp<M>] or auto")


def field_degrees(layout) -> dict[str, int]:
    """``layout``'s degree of each parallelism with a field of its own (:data:`FIELDS`), as a plan row's
    fields take them: from a ``Strategy``, a plan row or an auto ``Candidate`` (``parallelisms.degree_of``)."""
    return {key: parallelisms.degree_of(layout, key) for key in FIELDS}


@dataclass(frozen=True, kw_only=True)
class StrategyName:
    """A strategy name's parts, world-independent: the data-parallel wrap and the degrees."""

    shard: str = "none"
    """The data-parallel wrap as written: one of :data:`SHARDS`."""
    replicas: int = 1
    """hsdp<R>'s replica groups; 1 otherwise."""
    tp: int = 1
    """Tensor-parallel degree (tp<N>); 1 without."""
    cp: int = 1
    """Context-parallel degree (cp<N>); 1 without."""
    ep: int = 1
    """Expert-parallel degree (ep<N>); 1 without."""
    pp: int = 1
    """Pipeline stages (pp<N>); 1 without."""
    more: tuple[tuple[str, int], ...] = ()
    """(key, degree) of each registered parallelism without a field above (``distributed/parallelisms.py``:
    a new one before it gets its field, a test's toy), in the order its name writes them; () without."""

    @classmethod
    def of(cls, *, shard: str = "none", replicas: int = 1, degrees: dict[str, int] | None = None) -> StrategyName:
        """A name's parts from its wrap and ``degrees`` ({key: degree}, each a registered parallelism's)."""
        degrees = {k: d for k, d in (degrees or {}).items() if d > 1}
        order = {p.key: p.name_order for p in parallelisms.registered()}
        more = tuple(sorted(((k, d) for k, d in degrees.items() if k not in FIELDS), key=lambda kd: order[kd[0]]))
        return cls(shard=shard, replicas=replicas, **{k: d for k, d in degrees.items() if k in FIELDS}, more=more)

    def degree(self, key: str) -> int:
        """The degree of parallelism ``key`` ('tp', 'cp', or one in :attr:`more`); 1 without."""
        return getattr(self, key) if key in FIELDS else dict(self.more).get(key, 1)

    @property
    def reshard(self) -> bool:
        """FSDP2's reshard_after_forward: False only for fsdp-noreshard."""
        return self.shard != "fsdp-noreshard"

    @property
    def name(self) -> str:
        """The name, written back in the one order: ``[pp<N>+][ep<N>+]<wrap>[+cp<N>][+tp<N>]``
        (``parse_name(x.name) == x``); "none" for no wrap and no degree (a pipeline's one-GPU stage)."""
        wrap = f"hsdp{self.replicas}" if self.shard == "hsdp" else "" if self.shard == "none" else self.shard
        placed = [(p.name_order, f"{p.key}{self.degree(p.key)}") for p in parallelisms.registered()
                  if p.degree and self.degree(p.key) > 1] + [(_WRAP_ORDER, wrap)]
        return "+".join(part for _, part in sorted(placed, key=lambda op: op[0]) if part) or "none"

    def without_pp(self) -> StrategyName:
        """What each pipeline stage runs."""
        return dataclasses.replace(self, pp=1)


@dataclass(frozen=True)
class Strategy:
    """A strategy laid on a world of GPUs: its degrees as integers (torchtitan's ParallelDims), what
    ``distributed.apply_strategy``, the tracer and the time model read."""

    name: str
    """The name as :attr:`StrategyName.name` writes it back: "ddp", "hsdp2", "fsdp+tp4", "pp2+ep4+fsdp+tp2"."""
    world_size: int
    """GPUs in all (nodes x GPUs per node)."""
    dp: int
    """Data-parallel degree (ranks that see different samples) = world_size // tp."""
    tp: int
    """Tensor-parallel degree (1 when none)."""
    shard: str
    """"none" (one GPU, no wrapper), "ddp", "fsdp", "fsdp-noreshard", "hsdp", "zero1", "zero2"."""
    replicas: int = 1
    """HSDP replica groups (hsdp<R>); 1 otherwise."""
    pp: int = 1
    """Pipeline-parallel degree (pp<N>+...; ``distributed/pipeline.py``): world_size = pp x dp x tp."""
    pp_schedule: str = ""
    """The pipeline schedule as --pp-schedule names it ("1f1b", "gpipe", "interleaved-1f1b:2"); "" without pp."""
    microbatches: int = 0
    """Pipeline micro-batches per step (--microbatches; 0: as many as the stages); 0 without pp."""
    ep: int = 1
    """Expert-parallel degree (ep<N>+fsdp[+tp<M>]; ``distributed/expert_parallel.py``): each rank keeps
    experts / ep of every MoE layer's experts. Borrowed from the dp x tp ranks as torchtitan does with
    its default etp=1 (ep divides dp x tp, world_size unchanged); the experts are FSDP-sharded over the
    other dp x tp / ep ranks."""
    cp: int = 1
    """Context-parallel degree (cp<N>: each rank holds sequence/N of every sample; torch's ring
    attention, ``distributed/context_parallel.py``): world_size = pp x dp x cp x tp, and FSDP / DDP
    run over the dp x cp ranks (torchtitan's dp_shard_cp mesh)."""
    parsed: StrategyName | None = field(default=None, compare=False, repr=False)
    """The name's parts as ``distributed.strategy_name.parse_strategy`` read them (None for a Strategy
    built by hand: :attr:`parts` reads its name then)."""

    @property
    def parts(self) -> StrategyName:
        """The name's wrap and degrees (``distributed/strategy_name.py``)."""
        return self.parsed if self.parsed is not None else parse_name(self.name)

    @property
    def fsdp(self) -> bool:
        """Whether the data-parallel wrap is FSDP2 (fsdp, fsdp-noreshard, hsdp)."""
        return self.shard in FSDP_SHARDS


def parse_name(text: str) -> StrategyName:
    """``text`` (case and spaces ignored) as a :class:`StrategyName`; one line saying what to type
    for a component that is not a strategy's, or one given twice."""
    name = text.strip().lower().replace(" ", "")
    found: dict[str, int] = {}
    shard, replicas = "none", 1
    keys = "|".join(parallelisms.degree_keys())  # every registered degree's token (distributed/parallelisms.py)
    token_pattern = re.compile(rf"^(?:({keys}|hsdp)(\d+)|(ddp|fsdp|fsdp-noreshard|zero1|zero2))$")
    for i, token in enumerate(name.split("+")):
        match = token_pattern.match(token)
        if match is None:
            raise _unknown(text)
        key, degree, wrap = match.group(1), int(match.group(2) or 0), match.group(3)
        if key == "pp" and (i > 0 or "pp" in found):
            raise OptionError(f"{name}: pp<N> comes once, first: e.g. pp2+fsdp+tp2")
        example = dict(pp="pp2+fsdp", cp="fsdp+cp2", ep="ep8+fsdp").get(key, f"fsdp+{key}2")
        if key not in ("pp", "tp", "hsdp", None) and key in found:
            raise OptionError(f"{name}: {key}<N> comes once, e.g. {'fsdp+cp2+tp2' if key == 'cp' else example}")
        if key not in ("tp", "hsdp", None) and degree < 2:
            raise OptionError(f"{name}: {key}<N> needs 2 or more ranks, e.g. {example} (or drop {key}{degree})")
        if key in ("tp", "hsdp") and degree < 1:
            raise OptionError(f"{name}: {key}<N> needs 1 or more ranks, e.g. {'fsdp+tp2' if key == 'tp' else 'hsdp2'}")
        if ((wrap or key == "hsdp") and shard != "none") or (key == "tp" and "tp" in found):  # two wraps, two tp
            raise _unknown(text)
        if key == "hsdp":
            shard, replicas = "hsdp", degree
        elif wrap:
            shard = wrap
        else:
            found[key] = degree
    parts = StrategyName.of(shard=shard, replicas=replicas, degrees=found)
    if parts.name == "none":  # tp1 alone: no wrap, no degree
        raise _unknown(text)
    return parts


def _unknown(text: str) -> OptionError:
    return OptionError(f"`strategies` {text.strip()}: unknown strategy; use {NAMES_HELP}, "
                       "e.g. `strategies` ddp,fsdp,fsdp+tp2")


def _good(world_size: int) -> str:
    """The degrees that divide ``world_size`` GPUs, for a message."""
    return ", ".join(str(d) for d in range(2, world_size + 1) if world_size % d == 0) or "(none: one GPU)"


def check_degree(name: str, key: str, degree: int, world_size: int, *, product: str) -> None:
    """One line for a component (pp<N>, cp<N>) whose degree does not divide ``world_size`` GPUs."""
    if world_size % degree:
        raise OptionError(f"{name} on {world_size} GPUs: {product} must equal the GPU count; use {key}<N> with "
                          f"N in {_good(world_size)}")


def resolve(parts: StrategyName, world_size: int, *, pp_schedule: str = "1f1b", microbatches: int = 0) -> Strategy:
    """``parts`` laid on ``world_size`` GPUs: its data-parallel degree and the checks that need the
    GPU count (a degree that does not divide it, tp<N> that is not every GPU); ``pp_schedule``
    (--pp-schedule) and ``microbatches`` (--microbatches) for a pipeline. The Strategy keeps ``parts``."""
    if world_size < 1:
        raise OptionError(f"the GPU count must be 1 or more, got {world_size}: e.g. `gpus` 8")
    strategy = _resolve(parts, world_size, pp_schedule, microbatches)
    return dataclasses.replace(strategy, name=parts.name, parsed=parts)


def _resolve(parts: StrategyName, world_size: int, pp_schedule: str = "1f1b", microbatches: int = 0) -> Strategy:
    if parts.pp > 1:
        return _pipeline(parts, world_size, pp_schedule, microbatches)
    if parts.more:
        return _registered(parts, world_size)
    name = parts.name
    if parts.cp > 1 and parts.ep > 1:
        raise OptionError(f"'{name}': context and expert parallelism together are not traced; "
                          "plan one of them (e.g. fsdp+cp2 or ep2+fsdp)")
    if parts.cp > 1:
        return _context_parallel(parts, world_size)
    if parts.ep > 1:
        return _expert_parallel(parts, world_size)
    if parts.tp > 1 and parts.shard not in ("none", "fsdp", "fsdp-noreshard"):  # TP composes with FSDP2 only
        raise _unknown(name)
    if parts.shard == "hsdp":
        if world_size % parts.replicas:
            raise OptionError(f"{name} needs a replica count that divides the {world_size} GPUs: "
                              f"use hsdp<R> with R in {_good(world_size)}")
        return (Strategy(name, 1, 1, 1, "none") if world_size == 1 else
                Strategy(name, world_size, world_size, 1, "hsdp", replicas=parts.replicas))
    if parts.tp > 1 and parts.shard == "none":
        if parts.tp != world_size:
            other = (f"tp{world_size}, or fsdp+tp{parts.tp}" if world_size % parts.tp == 0 else f"tp{world_size}")
            raise OptionError(f"{name} on {world_size} GPUs: tp<N> splits the model over all N GPUs; use {other}")
        return Strategy(name, world_size, 1, parts.tp, "none")
    if parts.tp > 1:
        if world_size % parts.tp:
            raise OptionError(f"{name} needs a tensor-parallel degree that divides the {world_size} GPUs: "
                              f"use fsdp+tp<N> with N in {_good(world_size)}")
        return Strategy(name, world_size, world_size // parts.tp, parts.tp, parts.shard)
    return Strategy(name, 1, 1, 1, "none") if world_size == 1 else Strategy(name, world_size, world_size, 1,
                                                                               parts.shard)


def _pipeline(parts: StrategyName, world_size: int, pp_schedule: str, microbatches: int) -> Strategy:
    """pp<N>[+X]: a pipeline of N stages, each running X on world_size / N GPUs (``plan/pipeline.py``)."""
    from batchfit.distributed.pp_schedules import check_inner, check_pipeline, parse_schedule

    name, pp, stage = parts.name, parts.pp, parts.without_pp()
    check_degree(name, "pp", pp, world_size, product=f"pp{pp} x the other degrees")
    schedule = parse_schedule(pp_schedule, microbatches)
    check_pipeline(schedule, pp, None)
    inner_world = world_size // pp
    if stage.name != "none":
        inner = _resolve(stage, inner_world)
    elif inner_world == 1:
        inner = Strategy("none", 1, 1, 1, "none")
    else:
        raise OptionError(f"{name} on {world_size} GPUs: pp{pp} x the other degrees must equal the GPU count; "
                          f"use pp{world_size}, or pp{pp}+fsdp (data parallel over the other {inner_world})")
    check_inner(schedule, name, inner.shard)
    return dataclasses.replace(inner, name=name, world_size=world_size, pp=pp, pp_schedule=schedule.name,
                               microbatches=schedule.microbatches or pp)


def _context_parallel(parts: StrategyName, world_size: int) -> Strategy:
    """cp<N> on W GPUs takes N of them for each data-parallel rank (world = dp x cp x tp), with FSDP2 /
    DDP over dp x cp, as torchtitan's dp_shard_cp mesh (``distributed/context_parallel.py``)."""
    name, cp = parts.name, parts.cp
    check_degree(name, "cp", cp, world_size, product=f"dp x cp{cp} x tp")
    if parts.shard not in ("fsdp-noreshard", "fsdp", "ddp"):
        raise OptionError(f"{name}: cp<N> runs under a data-parallel wrap over dp x cp (torchtitan's): "
                          f"use fsdp+cp{cp}, fsdp+cp{cp}+tp<T> or ddp+cp{cp}")
    if parts.shard == "ddp" and parts.tp > 1:
        raise OptionError(f"{name}: ddp composes with cp<N> alone: use ddp+cp{cp}, or fsdp+cp{cp}+tp<T>")
    inner = _resolve(dataclasses.replace(parts, cp=1), world_size // cp)
    # On world_size // cp == 1 (or == tp) GPUs the rest resolves as one GPU's step; the wrap still
    # runs over the cp ranks.
    return dataclasses.replace(inner, name=name, world_size=world_size, shard=parts.shard, cp=cp)


def _registered(parts: StrategyName, world_size: int) -> Strategy:
    """A registered parallelism without a field of its own (``StrategyName.more``): it takes its degree's
    share of the GPUs (or borrows from dp x tp: ``Parallelism.takes_gpus``) around the rest of the name."""
    (key, degree), name = parts.more[0], parts.name
    takes_gpus = parallelisms.entry(key).takes_gpus
    if takes_gpus:
        check_degree(name, key, degree, world_size, product=f"dp x {key}{degree} x the other degrees")
    rest = dataclasses.replace(parts, more=parts.more[1:])
    inner = _resolve(rest, world_size // degree if takes_gpus else world_size)
    return dataclasses.replace(inner, name=name, world_size=world_size,
                               shard=inner.shard if parts.shard == "none" else parts.shard)


def _expert_parallel(parts: StrategyName, world_size: int) -> Strategy:
    """ep<N>+X: X must be FSDP (fsdp, fsdp-noreshard, fsdp+tp<M>) or tp<M> over every GPU, with N dividing
    the dp x tp ranks it borrows (torchtitan's etp=1: ``distributed/expert_parallel.py``). tp<M> over every
    GPU (no data-parallel ranks) runs FSDP2 over one rank: torchtitan's MoE parallelize applies FSDP
    whenever ep > 1, for the MoE layers' mixed precision."""
    name, ep, rest = parts.name, parts.ep, dataclasses.replace(parts, ep=1)
    if rest.name == "none":
        raise OptionError(f"{name}: ep<N> shards the experts beside FSDP2, which shards the rest (torchtitan's "
                          f"layout): use ep{ep}+fsdp")
    inner = _resolve(rest, world_size)
    if inner.shard == "none" and inner.tp > 1:
        inner = dataclasses.replace(inner, shard="fsdp")  # tp<M> over every GPU: FSDP2 over one rank
    if inner.shard not in ("fsdp", "fsdp-noreshard"):
        raise OptionError(f"{name}: ep<N> composes with fsdp, fsdp-noreshard, fsdp+tp<M> and tp<M> (torchtitan's "
                          f"layout), not {rest.name}: use ep{ep}+fsdp")
    room = inner.dp * inner.tp  # torchtitan's etp=1: ep borrows from dp_shard x tp
    if room % ep:
        good = [d for d in range(2, room + 1) if room % d == 0]
        source = (f"the {inner.dp} data-parallel x {inner.tp} tensor-parallel ranks (etp=1, torchtitan's default)"
                  if inner.tp > 1 else f"the {inner.dp} data-parallel ones")
        what = "is larger than" if ep > room else "must divide"
        raise OptionError(f"{name} on {world_size} GPUs: ep{ep} borrows its ranks from {source} and {what} their "
                          f"{room}: use ep<N> with N in {', '.join(map(str, good)) or '(none)'}")
    return dataclasses.replace(inner, name=name, ep=ep)


def parse_strategy(text: str, world_size: int, *, pp_schedule: str = "1f1b", microbatches: int = 0) -> Strategy:
    """One strategy name on ``world_size`` GPUs: :func:`parse_name`, then :func:`resolve`."""
    return resolve(parse_name(text), world_size, pp_schedule=pp_schedule, microbatches=microbatches)


def stage_strategy(strategy: Strategy) -> Strategy:
    """What each pipeline rank of a pp<N> ``strategy`` runs, on its world_size / pp GPUs."""
    stage = strategy.parts.without_pp()
    return dataclasses.replace(strategy, name=stage.name, parsed=stage, world_size=strategy.world_size // strategy.pp,
                               pp=1, pp_schedule="", microbatches=0)
