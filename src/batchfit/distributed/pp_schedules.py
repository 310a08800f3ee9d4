"""Pipeline schedules: their names (``--pp-schedule``), the rules torch enforces for them, where
their stages sit, the order of each rank's actions (torch's own), and what that order implies
(micro-batches in flight, the bubble).

Schedules (torch 2.13, ``torch/distributed/pipelining/schedules.py``; the torchtitan name is what
``[parallelism] pipeline_parallel_schedule`` reads, accepted here too):

=====================  =============================  =====================  ==================
--pp-schedule          torch class                    torchtitan             stages per rank
=====================  =============================  =====================  ==================
gpipe                  ScheduleGPipe                  GPipe                  1
1f1b                   Schedule1F1B                   1F1B                   1
interleaved-1f1b[:V]   ScheduleInterleaved1F1B        Interleaved1F1B        V (2), looped
interleaved-zb[:V]     ScheduleInterleavedZeroBubble  InterleavedZeroBubble  V (2), looped
zbv                    ScheduleZBVZeroBubble          ZBVZeroBubble          2, V-shaped
dualpipev              ScheduleDualPipeV              DualPipeV              2, V-shaped
=====================  =============================  =====================  ==================

The zero-bubble schedules (Qi et al. 2023, arXiv 2401.10241) split a micro-batch's backward into
I (BACKWARD_INPUT: the gradient of the stage input only, ``_backward.py: stage_backward_input``,
which keeps the autograd graph and the gradients reaching each weight) and W (BACKWARD_WEIGHT:
``stage_backward_weight``, the weight gradients from what I kept), run later to fill the bubble.
Looped placement: rank r holds stages r, r + p, ...; V-shaped (``_utils.py:
generate_stage_to_rank_mapping(style="v")``): rank r holds stages r and 2p - 1 - r, so rank 0
holds the embeddings and the head.

Action kinds: F (forward), B (full backward), I, W, and R (REDUCE_GRAD: FSDP2's reduce-scatter of
a stage's accumulated gradients, where torch's ``_add_reduce_grad`` puts it, after the stage's
last B or W). No torch at import: ``plan``'s grammar and ``--help`` read the names and rules.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from fractions import Fraction

from batchfit.errors import OptionError


@dataclass(frozen=True)
class ScheduleKind:
    """One schedule family as torch and torchtitan name it."""

    torch_class: str
    torchtitan: str
    stages_per_rank: int | None
    """Fixed stages per rank; None: V, given as name:V (default 2)."""
    placement: str
    """'loop' (rank r: r, r + p, ...) or 'v' (rank r: r and 2p - 1 - r)."""
    splits_backward: bool
    """Runs I and W actions (the zero-bubble family)."""


KINDS: dict[str, ScheduleKind] = {
    "gpipe": ScheduleKind("ScheduleGPipe", "GPipe", 1, "loop", False),
    "1f1b": ScheduleKind("Schedule1F1B", "1F1B", 1, "loop", False),
    "interleaved-1f1b": ScheduleKind("ScheduleInterleaved1F1B", "Interleaved1F1B", None, "loop", False),
    "interleaved-zb": ScheduleKind("ScheduleInterleavedZeroBubble", "InterleavedZeroBubble", None, "loop", True),
    "zbv": ScheduleKind("ScheduleZBVZeroBubble", "ZBVZeroBubble", 2, "v", True),
    "dualpipev": ScheduleKind("ScheduleDualPipeV", "DualPipeV", 2, "v", True),
}
SCHEDULES = tuple(KINDS)
_ALIASES = {"zero-bubble": "interleaved-zb", "interleaved-zero-bubble": "interleaved-zb",
            **{kind.torchtitan.lower(): name for name, kind in KINDS.items()}}
_SCHEDULE = re.compile(r"^([a-z0-9-]+)(?::(\d+))?$")
CHOICES = "gpipe, 1f1b, interleaved-1f1b[:V], interleaved-zb[:V], zbv or dualpipev"


@dataclass(frozen=True, kw_only=True)
class PipelineSchedule:
    """A pipeline schedule as ``--pp-schedule`` names it."""

    kind: str
    """A key of KINDS: "gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev"."""
    virtual: int = 1
    """Stages per rank (V of the interleaved schedules; 2 for zbv and dualpipev; 1 otherwise)."""
    microbatches: int = 0
    """Micro-batches per step (``--microbatches``; 0: as many as the pipeline ranks)."""

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.virtual}" if KINDS[self.kind].stages_per_rank is None else self.kind

    @property
    def splits_backward(self) -> bool:
        return KINDS[self.kind].splits_backward

    @property
    def torchtitan_name(self) -> str:
        return KINDS[self.kind].torchtitan


def parse_schedule(text: str, microbatches: int = 0) -> PipelineSchedule:
    """A --pp-schedule value: batchfit's name (``interleaved-zb:2``) or torchtitan's
    (``InterleavedZeroBubble``), with :V for the interleaved ones (default 2)."""
    shown = text.strip()
    match = _SCHEDULE.match(shown.lower())
    kind = _ALIASES.get(match.group(1), match.group(1)) if match else None
    if kind not in KINDS:
        raise OptionError(f"unknown pipeline schedule '{shown}': use {CHOICES} (or torchtitan's name, e.g. "
                          "ZBVZeroBubble), e.g. `pp_schedule` interleaved-1f1b:2")
    fixed = KINDS[kind].stages_per_rank
    virtual = match.group(2)
    if virtual is not None and fixed is not None:
        what = f"exactly {fixed} stages per rank (V-shaped)" if fixed > 1 else "one stage per rank"
        raise OptionError(f"`pp_schedule` {shown}: {kind} places {what}: only interleaved-1f1b and "
                          "interleaved-zb take :V (stages per rank)")
    v = fixed if fixed is not None else int(virtual) if virtual is not None else 2
    if v < 2 and fixed is None:
        # torchtitan's pipeline_llm: "Multi-stage schedule requires at least 2 stages per rank"
        raise OptionError(f"`pp_schedule` {shown}: {kind} needs 2 or more stages per rank, e.g. {kind}:2 "
                          "(or use 1f1b)")
    if microbatches < 0:
        raise OptionError(f"`microbatches` must be 1 or more, got {microbatches}")
    return PipelineSchedule(kind=kind, virtual=v, microbatches=microbatches)


def _stage_advice(n_layers: int, virtual: int) -> str:
    """What to use instead, as a sentence: the pp degrees whose ``virtual`` stages per rank split
    the layers equally."""
    if n_layers < 2:
        return "one layer cannot be split into stages: drop pp"
    pps = [d // virtual for d in range(2, n_layers + 1) if n_layers % d == 0 and d % virtual == 0 and d >= 2 * virtual]
    names = [f"pp{p}" for p in pps]
    listed = " or ".join(names) if len(names) < 3 else f"{', '.join(names[:-1])} or {names[-1]}"
    per = f" ({virtual} stages per rank)" if virtual > 1 else ""
    return f"use {listed}{per}" if pps else f"use fewer stages per rank than {virtual}, e.g. `pp_schedule` 1f1b"


def check_pipeline(schedule: PipelineSchedule, pp: int, n_layers: int | None) -> int:
    """The micro-batch count of ``schedule`` on ``pp`` ranks (checked); one-line errors for a
    layer count the stages do not divide and for the micro-batch counts torch refuses."""
    m = schedule.microbatches or pp
    stages = pp * schedule.virtual
    name = schedule.name
    if n_layers is not None and n_layers % stages:
        per = f" ({schedule.virtual} per rank)" if schedule.virtual > 1 else ""
        layers = f"{n_layers} layers do" if n_layers != 1 else "1 layer does"
        raise OptionError(f"pp{pp} with {name}: {layers} not split into {stages} equal stages{per}: "
                          f"{_stage_advice(n_layers, schedule.virtual)}")
    if schedule.kind in ("1f1b", "interleaved-1f1b") and m < pp:
        # Schedule1F1B raises below the stage count; batchfit asks the same of interleaved-1f1b.
        raise OptionError(f"{name} on pp{pp} needs at least {pp} micro-batches (one per stage), got {m}: "
                          f"`microbatches` {pp} or more, or `pp_schedule` gpipe")
    if schedule.kind in ("interleaved-1f1b", "interleaved-zb"):
        rounds = max(1, m // pp)  # ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble __init__
        if m % rounds:
            raise OptionError(f"{name} on pp{pp}: {m} micro-batches must be a multiple of {rounds} "
                              f"(micro-batches // ranks, torch's rule): e.g. `microbatches` {rounds * pp}")
    if schedule.kind == "dualpipev" and m < stages:
        raise OptionError(f"dualpipev on pp{pp} needs at least {stages} micro-batches (one per stage, torch's "
                          f"ScheduleDualPipeV), got {m}: `microbatches` {stages} or more")
    return m


def check_inner(schedule: PipelineSchedule, name: str, shard: str) -> None:
    """The data-parallel wrap a zero-bubble schedule can train with, checked before any trace.

    torch 2.13's split backward computes weight gradients with ``torch.autograd.grad`` from the
    module's parameters as they are at I: FSDP2 that reshards after forward holds its sharded
    parameters then, so ``stage_backward_input`` finds no parameter group and the blocks' weight
    gradients are never computed; DDP's all-reduce hooks sit on AccumulateGrad, which
    ``autograd.grad`` never runs, so gradients are not synchronized (both seen on gloo: the
    sharded case leaves every gradient None, the DDP case all-reduces no bucket).
    """
    if not schedule.splits_backward or shard in ("none", "fsdp-noreshard"):
        return
    if shard == "fsdp":
        raise OptionError(f"{name} with {schedule.name}: FSDP2 that reshards after forward loses the blocks' weight "
                          "gradients in torch's split backward (I reads the sharded parameters): use "
                          f"{name.replace('fsdp', 'fsdp-noreshard', 1)} (torchtitan's default under pp) or "
                          "`pp_schedule` interleaved-1f1b")
    raise OptionError(f"{name} with {schedule.name}: {shard} inside a zero-bubble pipeline does not reduce the "
                      "gradients torch's split backward computes (autograd.grad runs no AccumulateGrad hook): use "
                      "pp<N>+fsdp-noreshard[+tp<T>] or `pp_schedule` interleaved-1f1b")


def rank_stages(schedule: PipelineSchedule, pp: int, rank: int) -> list[int]:
    """The stage indices pipeline rank ``rank`` holds, lowest first (torch's mapping)."""
    from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping

    return generate_rank_to_stage_mapping(pp, pp * schedule.virtual, style=KINDS[schedule.kind].placement)[rank]


def rank_actions(schedule: PipelineSchedule, pp: int, rank: int) -> list[tuple[str, int, int]]:
    """Rank ``rank``'s computation in the order torch's runtime runs it: (kind, stage, micro-batch),
    kind F, B, I, W or R (REDUCE_GRAD; micro-batch -1)."""
    m = schedule.microbatches or pp
    if schedule.kind in ("gpipe", "1f1b"):
        return _single_stage_order(schedule.kind, pp, m, rank) + [("R", rank, -1)]
    from torch.distributed.pipelining import schedules as S

    actions = _torch_order(schedule, pp, m, rank)
    out = []
    for action in S._add_reduce_grad(actions, m):  # the runtime's own lowering pass places REDUCE_GRAD
        for a in action.sub_actions if action.computation_type == S.OVERLAP_F_B else (action,):
            kind = _KIND_OF[a.computation_type.name]
            out.append((kind, a.stage_index, -1 if kind == "R" else a.microbatch_index))
    return out


_KIND_OF = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W", "REDUCE_GRAD": "R"}


def _torch_order(schedule: PipelineSchedule, pp: int, m: int, rank: int) -> list:
    """``_calculate_single_rank_operations`` of the schedule's class, called on a stand-in ``self``
    holding only what it reads (the constructors need real stages and a process group)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules as S

    cls = getattr(S, KINDS[schedule.kind].torch_class)
    if schedule.kind in ("interleaved-1f1b", "interleaved-zb"):
        rounds = max(1, m // pp)
        me = SimpleNamespace(n_local_stages=schedule.virtual, pp_group_size=pp, _n_microbatches=m,
                             number_of_rounds=rounds, microbatches_per_round=m // rounds)
    else:  # zbv, dualpipev
        me = SimpleNamespace(pp_group_size=pp, _n_microbatches=m, num_stages=2 * pp)
    return [a for a in cls._calculate_single_rank_operations(me, rank) if a is not None]


def _single_stage_order(kind: str, pp: int, m: int, stage: int) -> list[tuple[str, int, int]]:
    """The order ``ScheduleGPipe._step_microbatches`` / ``Schedule1F1B._step_microbatches`` run
    (torch's runtime loops: their ``_get_pipeline_order`` is only a picture, and for 1F1B's last
    rank it starts at micro-batch 1). GPipe: every forward, then every backward. 1F1B:
    min(m, pp - stage) warm-up forwards, then one backward and one forward until the forwards
    are done, then the remaining backwards."""
    if kind == "gpipe":
        return [("F", stage, i) for i in range(m)] + [("B", stage, i) for i in range(m)]
    warmup = min(m, pp - stage)
    out = [("F", stage, i) for i in range(warmup)]
    f, b = warmup, 0
    while True:
        out.append(("B", stage, b))
        b += 1
        if f == m:
            break
        out.append(("F", stage, f))
        f += 1
    out += [("B", stage, i) for i in range(b, m)]
    return out


def in_flight(actions: list[tuple[str, int, int]]) -> int:
    """The most stage-micro-batches a rank holds activations for at once: forwarded, and not yet
    through B or W (I keeps the autograd graph for W)."""
    live = most = 0
    for kind, _, _ in actions:
        live += {"F": 1, "B": -1, "W": -1}.get(kind, 0)
        most = max(most, live)
    return most


UNIT_TIMES = {"F": Fraction(1), "I": Fraction(1), "W": Fraction(1), "B": Fraction(2)}
"""A stage's forward, input-gradient and weight-gradient times, relative (Qi et al. 2023's
T_F = T_B = T_W: a matmul's input and weight gradients each cost one forward)."""


@functools.lru_cache(maxsize=256)
def bubble_fraction(schedule: PipelineSchedule, pp: int) -> float:
    """The idle share of a pipeline step: torch's action lists of every rank played at
    UNIT_TIMES / V per action (a rank's layers split over its V stages), each action starting
    when its rank is free and its inputs are there (F after the previous stage's F, I or B after
    the next stage's, W after its I), sends taking no time; (makespan - work) / makespan.

    By hand (tests/test_pipeline.py): (p-1)/(m+p-1) for GPipe and 1F1B (Narayanan et al. 2021,
    arXiv 2104.04473, sec. 2.2); ((p-1)/V) / (m + (p-1)/V) for interleaved 1F1B (sec. 2.2.1);
    the zero-bubble ones leave only the ranks' staggered start, (p-1) stage forwards, a bubble of
    (p-1)/(3Vm) of the work (ZB-H1's (p-1)(T_F + T_B - T_W), Qi et al. sec. 2.1, over V stages)
    where torch's order reaches it (interleaved-zb from m = p, zbv from m = 3p/2, dualpipev).
    Qi et al. call ZB-V's bubble zero: their optimizer post-validation lets steps overlap, which
    hides that stagger; torch's optimizer step waits for every rank, so it stays here."""
    if pp <= 1:
        return 0.0
    m = schedule.microbatches or pp
    v = schedule.virtual
    ranks = {r: [(k, s, mb) for k, s, mb in rank_actions(schedule, pp, r) if k != "R"] for r in range(pp)}
    done: dict[tuple[str, int, int], Fraction] = {}
    clock = dict.fromkeys(ranks, Fraction(0))
    nxt = dict.fromkeys(ranks, 0)
    last = pp * v - 1
    while any(nxt[r] < len(ranks[r]) for r in ranks):
        moved = False
        for r, acts in ranks.items():
            while nxt[r] < len(acts):
                kind, s, mb = acts[nxt[r]]
                if kind == "F":
                    needs = [("F", s - 1, mb)] if s > 0 else []
                elif kind == "W":
                    needs = [("I", s, mb)]
                else:  # I or B: this stage's forward, the next stage's input gradient
                    needs = [("F", s, mb)] + ([("I", s + 1, mb)] if s < last else [])
                if any(n not in done for n in needs):
                    break
                end = max([clock[r], *(done[n] for n in needs)]) + UNIT_TIMES[kind] / v
                clock[r] = end
                done[("I" if kind == "B" else kind, s, mb)] = end
                if kind == "B":
                    done[("W", s, mb)] = end
                nxt[r] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"{schedule.name} on pp{pp} with {m} micro-batches: torch's order deadlocks")
    makespan = max(clock.values())
    work = 3 * m  # every rank: m micro-batches of F + I + W over its layers
    return float((makespan - work) / makespan)
