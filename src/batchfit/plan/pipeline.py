"""Pipeline-parallel strategies in ``plan``: ``pp<N>`` alone or before another strategy
(``pp4+fsdp``, ``pp2+fsdp+tp2``), each pipeline rank's stages traced on the fake process group.

A pp<N>+X strategy on W GPUs is N pipeline ranks, each running X on W/N GPUs. Rank r's step
(its stage modules, ``distributed/pipeline.py``) is traced as ``sharded.ShardedSession`` traces
any rank 0: X applied with torch's own code on a fake process group of W/N ranks, then the
micro-batch forwards and backwards in the order torch's schedule runs them. Every pipeline
rank is traced (they differ: the first holds the most in-flight micro-batches under 1F1B, the
first the embeddings, the last the head and the loss); the plan's peak is the largest.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from batchfit.distributed import parallelisms
from batchfit.distributed.pp_schedules import check_pipeline, parse_schedule
from batchfit.distributed.strategy import Strategy
from batchfit.distributed.strategy_name import stage_strategy
from batchfit.errors import OptionError


@dataclass(frozen=True, kw_only=True)
class StagePoint:
    """One pipeline rank's traced step."""

    rank: int
    """The pipeline rank (it holds stages rank, rank + pp, ... looped; rank and 2 pp - 1 - rank V-shaped)."""
    stages: tuple[int, ...]
    """The stage indices it holds."""
    in_flight: int
    """The most stage-micro-batches it holds activations for at once (forwarded, not yet through B or W),
    from the schedule's action order."""
    point: object
    """Its ``sharded.ShardedPoint``."""


class PipelineSession:
    """Every pipeline rank of ``strategy`` (pp > 1), each a ``ShardedSession`` of its inner
    strategy over stage modules, run in torch's schedule order. ``trace`` returns the largest
    rank's ShardedPoint (as ShardedSession does) and keeps each rank's in :attr:`stage_points`."""

    def __init__(self, workload, options, device, strategy: Strategy, *, cuda_semantics: bool = True,
                 ranks: list[int] | None = None) -> None:
        import torch

        from batchfit.distributed.pipeline import build_rank, hidden_size_of, n_layers_of, sends_sequence_shard
        from batchfit.distributed.pipeline_hf import pp_parts
        from batchfit.distributed.pp_schedules import rank_actions, rank_stages
        from batchfit.plan.sharded import ShardedSession

        self.strategy = strategy
        self.workload, self.options, self.device = workload, options, device
        self.cuda_semantics = cuda_semantics
        self.schedule = parse_schedule(strategy.pp_schedule or "1f1b", strategy.microbatches)
        for own in parallelisms.registered():  # cp: its ring is not traced inside a pipeline's stages yet
            if own.in_pipeline and own.used_by(strategy):
                raise OptionError(f"{strategy.name}: {own.in_pipeline}")
        if options.checkpointing == "selective" and self.schedule.splits_backward:
            # torch's split backward runs autograd through a stage twice (I, then W), and selective
            # checkpointing caches each region's ops for one backward ("Trying to backward an extra time")
            raise OptionError(f"{strategy.name} with {self.schedule.name}: selective checkpointing lets a region "
                              "backward once, and a zero-bubble schedule runs each stage's backward twice (input, "
                              "then weights): use `checkpointing` full, or `pp_schedule` interleaved-1f1b")
        if options.loss != "plain":
            raise OptionError(f"{strategy.name}: `loss` {options.loss} is not traced under pipeline parallelism yet "
                              "(the last stage computes the plain loss from its logits): use `loss` plain")
        with torch.device("meta"):
            probe = workload.build_model()
        check_pipeline(self.schedule, strategy.pp, n_layers_of(probe))
        self.layers_per_stage = n_layers_of(probe) // (strategy.pp * self.schedule.virtual)
        self.d_model = hidden_size_of(probe)
        sp = sends_sequence_shard(probe, strategy.tp)  # TP's sequence parallelism: 1/tp of the sequence sent
        if sp and pp_parts(probe) is not None and self.schedule.splits_backward:
            raise OptionError(f"{strategy.name} with {self.schedule.name}: an HF stage under "
                              "sequence-parallel TP sends its sequence shard as a view of the residual stream's "
                              "DTensor, which torch's stage_backward_input cannot detach in place: use `pp_schedule` "
                              "1f1b, gpipe or interleaved-1f1b, or drop tp")
        self.seq_len = workload.tokens_per_sample // (strategy.tp if sp else 1)
        del probe
        self.ranks = list(range(strategy.pp)) if ranks is None else ranks
        self.actions = {r: rank_actions(self.schedule, strategy.pp, r) for r in self.ranks}
        self.stages_of = {r: rank_stages(self.schedule, strategy.pp, r) for r in self.ranks}
        self._build_rank = build_rank
        self._sharded = ShardedSession
        self.stage_points: list[StagePoint] = []
        """Each traced pipeline rank at the last local batch traced."""
        self.by_batch: dict[int, list[StagePoint]] = {}
        """Each pipeline rank, by local batch."""
        self._streams: dict[int, tuple] = {}

    def _trace_rank(self, rank: int, local_batch: int):
        from batchfit.distributed.pipeline_run import PipelineRun
        from batchfit.distributed.pp_schedules import in_flight

        pp, v = self.strategy.pp, self.schedule.virtual
        build = self.workload.build_model
        policy = self.options.checkpointing_spec
        stages = self.stages_of[rank]
        staged = dataclasses.replace(self.workload,
                                     build_model=lambda: self._build_rank(build, pp * v, stages, policy))
        options = dataclasses.replace(self.options, checkpointing="none")  # applied per stage by build_rank
        with self._sharded(staged, options, self.device, stage_strategy(self.strategy),
                           cuda_semantics=self.cuda_semantics) as session:
            step = session.session.step
            step.run = PipelineRun(step, actions=self.actions[rank], microbatches=self.strategy.microbatches,
                                   stages=pp * v, d_model=self.d_model, seq_len=self.seq_len,
                                   sends=self.schedule.kind if self.schedule.kind in ("gpipe", "1f1b") else "runtime")
            point = session.trace(local_batch)
            stream = (session.fresh_stream, session.fresh_steps, getattr(session, "fresh_streams", {}))
        return StagePoint(rank=rank, stages=tuple(stages), in_flight=in_flight(self.actions[rank]), point=point), stream

    def trace(self, local_batch: int):
        """Each pipeline rank's step at ``local_batch`` samples per step (``microbatches`` micro-batches
        of local_batch / microbatches); the largest rank's point."""
        m = self.strategy.microbatches
        if local_batch < 1 or local_batch % m:
            raise OptionError(f"{self.strategy.name}: the local batch ({local_batch}) must be a multiple of the "
                              f"{m} micro-batches: `multiple_of` {m}, or `microbatches` that divides it")
        traced = [self._trace_rank(r, local_batch) for r in self.ranks]
        self.stage_points = [stage for stage, _ in traced]
        worst, stream = max(traced, key=lambda t: t[0].point.peak_bytes)
        self._streams[local_batch] = stream
        self.by_batch[local_batch] = self.stage_points
        # The pipeline runs at the pace of its slowest stage: the time model takes the most FLOPs of any
        # rank (the last, with the head and the loss, for a large vocabulary), not the largest peak's.
        return dataclasses.replace(worst.point, strategy=self.strategy,
                                   flops=max(s.point.flops for s in self.stage_points),
                                   stage_peak_bytes=tuple(s.point.peak_bytes for s in self.stage_points))

    def reserved(self, local_batch: int):
        """The reserved peak (``plan.reserved.ReservedReplay``) of the rank with the largest
        allocated peak at ``local_batch``: its fresh process's stream through the allocator model."""
        from batchfit.plan.reserved import replay_steps

        if local_batch not in self._streams:
            self.trace(local_batch)
        events, starts, streams = self._streams[local_batch]
        return replay_steps(events, starts, self.device, streams)

    def close(self) -> None:
        pass

    def __enter__(self) -> PipelineSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def pipeline_or(open_session):
    """``open_session`` for every strategy but pp<N>, which gets a :class:`PipelineSession`
    (each pipeline rank traced whole: the depth extrapolation cuts whole models, not stages)."""

    def open_any(workload, options, device, strategy, **kw):
        if getattr(strategy, "pp", 1) > 1:
            return PipelineSession(workload, options, device, strategy, **kw)
        return open_session(workload, options, device, strategy, **kw)

    return open_any
