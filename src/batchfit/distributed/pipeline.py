"""Pipeline parallelism: a model cut into stages, and one pipeline rank's step in the order
``torch.distributed.pipelining``'s schedule runs it.

What is mirrored, and from where (torch 2.13, ``torch/distributed/pipelining``):

- The order of forward (F) and full-backward (B) micro-batch actions of each rank is torch's:
  ``ScheduleInterleaved1F1B._calculate_single_rank_operations`` (``schedules.py``; the runtime
  executes exactly that list) called on a stand-in ``self`` holding only what it reads, and for
  GPipe and 1F1B the loops of ``ScheduleGPipe._step_microbatches`` /
  ``Schedule1F1B._step_microbatches`` written out (``_single_stage_order``).
- The split is torchtitan's (``pipeline_module_split`` in
  ``torchtitan/distributed/pipeline_parallel.py``): stage s keeps blocks
  [s*L/S, (s+1)*L/S); the embeddings sit on the first stage, the final norm and the head on
  the last; a stage without them passes hidden states on.
- What a stage holds besides its activations is ``stage.py``'s ``PipelineStage``: for each
  micro-batch a receive buffer of the input activation (stages after the first;
  ``_create_act_recv_info``) and of the output gradient (stages before the last;
  ``_create_grad_recv_info``), made once and kept between steps; the input activation's
  gradient accumulates in the receive buffer's ``.grad`` and stays until the next step's
  ``clear_runtime_states``; a forward's output and inputs stay in ``fwd_cache`` until that
  micro-batch's backward; the last stage's loss scaled by 1/micro-batches (``scale_grads``).

Not mirrored (written in the approximations): the send/receive themselves move no memory of
their own here (NCCL's P2P buffers are outside the caching allocator); the hidden state a
stage receives is (micro-batch, sequence, d_model) in the stage parameters' dtype.
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchfit.errors import OptionError

if TYPE_CHECKING:
    import torch
    from torch import nn

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
_SCHEDULE = re.compile(r"^(gpipe|1f1b|interleaved-1f1b)(?::(\d+))?$")


@dataclass(frozen=True, kw_only=True)
class PipelineSchedule:
    """A pipeline schedule as ``--pp-schedule`` names it."""

    kind: str
    """"gpipe", "1f1b" or "interleaved-1f1b"."""
    virtual: int = 1
    """Stages per rank (interleaved-1f1b:V; 1 otherwise)."""
    microbatches: int = 0
    """Micro-batches per step (``--microbatches``; 0: as many as the stages)."""

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.virtual}" if self.kind == "interleaved-1f1b" else self.kind


def parse_schedule(text: str, microbatches: int = 0) -> PipelineSchedule:
    """'gpipe', '1f1b', 'interleaved-1f1b' or 'interleaved-1f1b:V' (V stages per rank, default 2)."""
    match = _SCHEDULE.match(text.strip().lower())
    if match is None:
        raise OptionError(f"unknown pipeline schedule '{text.strip()}': use gpipe, 1f1b or interleaved-1f1b[:V], "
                          "e.g. --pp-schedule interleaved-1f1b:2")
    kind, virtual = match.group(1), match.group(2)
    if virtual is not None and kind != "interleaved-1f1b":
        raise OptionError(f"--pp-schedule {text.strip()}: only interleaved-1f1b takes :V (stages per rank)")
    v = int(virtual) if virtual is not None else (2 if kind == "interleaved-1f1b" else 1)
    if v < 2 and kind == "interleaved-1f1b":
        raise OptionError(f"--pp-schedule {text.strip()}: interleaved-1f1b needs 2 or more stages per rank, "
                          "e.g. interleaved-1f1b:2 (or use 1f1b)")
    if microbatches < 0:
        raise OptionError(f"--microbatches must be 1 or more, got {microbatches}")
    return PipelineSchedule(kind=kind, virtual=v, microbatches=microbatches)


def check_pipeline(schedule: PipelineSchedule, pp: int, n_layers: int | None) -> int:
    """The micro-batch count of ``schedule`` on ``pp`` ranks (checked); one-line errors for a
    layer count the stages do not divide, or fewer micro-batches than 1F1B's stages."""
    m = schedule.microbatches or pp
    stages = pp * schedule.virtual
    if n_layers is not None and n_layers % stages:
        good = [d for d in range(1, n_layers + 1) if n_layers % d == 0 and d > 1]
        raise OptionError(f"pp{pp} with {schedule.name}: {n_layers} layers do not split into {stages} equal stages: "
                          f"use a stage count in {', '.join(map(str, good)) or '(none: one layer cannot be split)'}")
    if schedule.kind != "gpipe" and m < pp:
        raise OptionError(f"{schedule.name} on pp{pp} needs at least {pp} micro-batches (one per stage), got {m}: "
                          f"--microbatches {pp} or more, or --pp-schedule gpipe")
    if schedule.kind == "interleaved-1f1b":
        rounds = max(1, m // pp)
        if m % rounds:
            raise OptionError(f"interleaved-1f1b on pp{pp}: {m} micro-batches must be a multiple of "
                              f"{rounds} (micro-batches // stages, torch's rule): e.g. --microbatches {rounds * pp}")
    return m


def rank_actions(schedule: PipelineSchedule, pp: int, rank: int) -> list[tuple[str, int, int]]:
    """Rank ``rank``'s computation in torch's order: ("F" | "B", stage index, micro-batch)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules as S

    m = schedule.microbatches or pp
    if schedule.kind == "interleaved-1f1b":
        rounds = max(1, m // pp)
        me = SimpleNamespace(n_local_stages=schedule.virtual, pp_group_size=pp, _n_microbatches=m,
                             number_of_rounds=rounds, microbatches_per_round=m // rounds)
        actions = S.ScheduleInterleaved1F1B._calculate_single_rank_operations(me, rank)
    else:
        return _single_stage_order(schedule.kind, pp, m, rank)
    out = []
    for action in actions:
        if action is None:
            continue
        kind = getattr(action.computation_type, "value", action.computation_type)
        if kind in ("F", "FORWARD"):
            out.append(("F", action.stage_index, action.microbatch_index))
        elif kind in ("B", "FULL_BACKWARD"):
            out.append(("B", action.stage_index, action.microbatch_index))
    return out


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
    """The most micro-batch forwards a rank holds at once (forwarded, not yet backwarded)."""
    live = most = 0
    for kind, _, _ in actions:
        live += 1 if kind == "F" else -1
        most = max(most, live)
    return most


def bubble_fraction(schedule: PipelineSchedule, pp: int) -> float:
    """The idle share of a pipeline step: (p-1)/(m+p-1) for GPipe and 1F1B (Huang et al. 2019,
    GPipe, sec. 2.2; Narayanan et al. 2021, arXiv 2104.04473, sec. 2.2), the bubble time divided
    by V for interleaved 1F1B (same paper, sec. 2.2.1: (p-1)/(V m) of the ideal time)."""
    m = schedule.microbatches or pp
    if pp <= 1:
        return 0.0
    bubble = (pp - 1) / schedule.virtual  # in micro-batch times
    return bubble / (m + bubble)


def _blocks_of(model: nn.Module) -> nn.ModuleList:
    blocks = getattr(model, "blocks", None)
    if blocks is None or not all(hasattr(model, a) for a in ("embed", "norm", "head")):
        raise OptionError(f"pipeline parallelism needs a model with embed, blocks, norm and head (batchfit's "
                          f"zoo transformers); {type(model).__name__} has no such split yet: use fsdp / tp strategies")
    return blocks


def n_layers_of(model: nn.Module) -> int:
    return len(_blocks_of(model))


def _stage_forward(self, x):
    """A stage's forward (torchtitan's Transformer.forward, which skips what the stage lacks)."""
    import torch

    if self.embed is not None:
        idx = x
        x = self.embed(idx)
        if self.pos is not None:
            x = x + self.pos(torch.arange(idx.shape[1], device=idx.device))
    # The whole sequence's rotary tables (the model's forward cuts them to the tokens, here the
    # zoo's full training length): a received hidden state under sequence parallelism holds 1/tp of it.
    rope = (self.rope_cos, self.rope_sin) if getattr(self, "pos", None) is None and hasattr(self, "rope_cos") else None
    for block in self.blocks:
        x = block(x, rope)
    if self.head is not None:
        return self.head(self.norm(x))
    return x


def split_stage(model: nn.Module, stage: int, stages: int) -> nn.Module:
    """Stage ``stage`` of ``stages`` of ``model``, in place (torchtitan's pipeline_module_split)."""
    from torch import nn

    blocks = _blocks_of(model)
    per = len(blocks) // stages
    model.blocks = nn.ModuleList(list(blocks)[stage * per:(stage + 1) * per])
    if stage > 0:
        model.embed = None
        if getattr(model, "pos", None) is not None:
            model.pos = None
    if stage < stages - 1:
        model.norm = None
        model.head = None
    model.forward = types.MethodType(_stage_forward, model)
    return model


class RankStages:
    """The stage modules one pipeline rank holds (V of them under interleaved 1F1B): what the
    optimizer steps over. Each stage is called by itself, as PipelineStage calls its submodule."""

    def __new__(cls, stages: list[nn.Module], indices: list[int]):
        from torch import nn

        holder = nn.Module()
        holder.stages = nn.ModuleList(stages)
        holder.stage_indices = list(indices)
        return holder


def build_rank(build_model: Callable[[], nn.Module], pp: int, rank: int, virtual: int,
               checkpointing: str = "none") -> nn.Module:
    """The stages of pipeline rank ``rank``: stage ``rank + k pp`` for k < ``virtual`` (torch's
    interleaved layout: ``ScheduleInterleaved1F1B``'s ``local_index * pp_group_size + rank``).
    ``checkpointing`` (--checkpointing) is applied to each stage's own blocks, as torchtitan
    applies AC per stage model (the step's own pass would pick one stack of the rank)."""
    from batchfit.train.step import _checkpoint_blocks

    indices = [rank + k * pp for k in range(virtual)]
    stages = [split_stage(build_model(), s, pp * virtual) for s in indices]
    if checkpointing != "none":
        for stage in stages:
            _checkpoint_blocks(stage, checkpointing, preserve_rng_state=False)  # fake tensors: no CPU RNG snapshot
    return RankStages(stages, indices)


def _backward_sync(module, *, last: bool):
    """What ``PipelineStage.backward_maybe_with_nosync`` does around a micro-batch's backward:
    under FSDP2 no reduce-scatter and no reshard after it (the stage's parameters stay gathered,
    its unsharded gradients accumulate, until REDUCE_GRAD); under DDP ``no_sync`` but for the
    stage's last backward."""
    import contextlib

    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, FSDPModule):
        module.set_is_last_backward(False)
        module.set_reshard_after_backward(False)
        module.set_requires_gradient_sync(False)
    elif isinstance(module, DistributedDataParallel) and not last:
        return module.no_sync()
    return contextlib.nullcontext()


def _reduce_grad(module) -> None:
    """``PipelineStage.perform_reduce_grad`` under FSDP2: the post-backward of every parameter
    group by hand (each reduce-scatters its accumulated gradients and reshards), then the root's
    final callback."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if not isinstance(module, FSDPModule):
        return
    module.set_is_last_backward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    state = fully_shard.state(module)
    for each in state._state_ctx.all_states:
        for group in each._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


class PipelineRun:
    """One optimizer step of a pipeline rank, in torch's action order, on the TrainingStep's
    pieces: replaces ``TrainingStep.run`` (same signature) for a step whose model is a
    :class:`RankStages`. Its batch size is the pipeline's whole local batch, split into
    ``microbatches`` equal micro-batches (``schedule.step(whole batch)`` splits it so)."""

    def __init__(self, step, *, actions: list[tuple[str, int, int]], microbatches: int, stages: int,
                 d_model: int, seq_len: int) -> None:
        self.step = step
        self.actions = actions
        self.m = microbatches
        self.stages = stages
        self.d_model, self.seq_len = d_model, seq_len
        self.act_buffers: dict[tuple[int, int], torch.Tensor] = {}
        self.grad_buffers: dict[tuple[int, int], torch.Tensor] = {}
        self.last_backward = {s: (s, mb) for kind, s, mb in actions if kind == "B"}
        """Each stage's last backward action (DDP syncs in it)."""

    def _buffer(self, table: dict, key: tuple[int, int], micro: int, dtype, requires_grad: bool):
        import torch

        if key not in table:  # made once, kept between steps (PipelineStage's recv infos)
            table[key] = torch.empty((micro, self.seq_len, self.d_model), dtype=dtype,
                                     device=self.step.device).requires_grad_(requires_grad)
        return table[key]

    def __call__(self, batch_size: int, hooks=None):
        import torch

        from batchfit.train.losses import loss_context
        from batchfit.train.step import NoHooks

        step, hooks = self.step, hooks or NoHooks()
        if batch_size % self.m:
            raise OptionError(f"a pipeline step of {self.m} micro-batches needs a local batch that is a multiple of "
                              f"{self.m}, got {batch_size}")
        micro = batch_size // self.m
        holder = step.model
        by_index = dict(zip(holder.stage_indices, holder.stages))
        last_stage = self.stages - 1
        last_context = loss_context(by_index.get(last_stage, holder))  # the TP plan marks the stage
        with step.step_context():
            for buf in self.act_buffers.values():  # clear_runtime_states
                buf.grad = None
            hooks.phase("inputs")
            first, last = 0 in by_index, last_stage in by_index
            # The first stage reads the inputs, the last the targets: each rank keeps only its own.
            batch = None
            if first or last:
                batch = list(step.workload.make_batch(batch_size, step.device))
                batch[0] = batch[0] if first else None
                batch[1:] = batch[1:] if last else [None] * (len(batch) - 1)
            parts = ([tuple(None if t is None else t.tensor_split(self.m)[i] for t in batch) for i in range(self.m)]
                     if batch else None)
            cache: dict[tuple[int, int], tuple] = {}
            loss = None
            phase = None
            for kind, s, mb in self.actions:
                module = by_index[s]
                if kind == "F":
                    if phase != "forward":
                        hooks.phase("forward")
                        phase = "forward"
                    dtype = next(module.parameters()).dtype
                    x = parts[mb][0] if s == 0 else self._buffer(self.act_buffers, (s, mb), micro, dtype, True)
                    with step.forward_autocast(), last_context():
                        out = module(x)
                        if s == last_stage:
                            # The schedule computes the loss from the stage's output, which fwd_cache
                            # keeps until this micro-batch's backward (the logits, not only the loss).
                            logits = out
                            loss_mb = step.loss_fn(lambda _inputs: logits, (x, *parts[mb][1:])) / self.m
                            out = (loss_mb, logits)
                            del logits, loss_mb
                    cache[(s, mb)] = (out, x)
                    del out, x
                else:
                    if phase != "backward":
                        hooks.phase("backward")
                        phase = "backward"
                    out, x = cache.pop((s, mb))
                    with _backward_sync(module, last=self.last_backward[s] == (s, mb)):
                        if s == last_stage:
                            with last_context():  # loss_parallel under a TP plan's sharded loss
                                out[0].backward()
                            loss = out[0].detach()
                        else:
                            grad = self._buffer(self.grad_buffers, (s, mb), micro, out.dtype, False)
                            torch.autograd.backward(out, grad)
                    del out, x
            for module in holder.stages:  # the schedule's REDUCE_GRAD: FSDP2's reduce-scatter, once
                _reduce_grad(module)
            del batch, parts
            hooks.phase("optimizer")
            step.update(hooks=hooks)
            hooks.phase("idle")
        return loss if loss is not None else torch.zeros(())


def pipeline_approximations(strategies) -> list:
    """What a plan with pp<N> strategies says in every output: how a pipeline rank was traced."""
    from batchfit.trace.approximation import Approximation

    names = sorted({s.name for s in strategies if getattr(s, "pp", 1) > 1})
    if not names:
        return []
    return [Approximation(
        what=f"{', '.join(names)}: each pipeline rank's step traced in torch's schedule order with PipelineStage's "
             "receive buffers and forward cache mirrored (distributed/pipeline.py), not torch's PipelineStage itself; "
             "the point-to-point sends move no bytes of their own; the bubble is computed, (p-1)/(m+p-1), /V interleaved",
        may_differ_by="nothing measured beyond 3% per stage (2 gloo stages, GPipe and 1F1B, tests/test_pipeline.py); "
                      "NCCL's P2P staging buffers (outside the caching allocator) are not counted",
        source="tests/test_pipeline.py; docs/tracing.md, Pipeline parallelism")]
