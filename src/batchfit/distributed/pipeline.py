"""Pipeline parallelism: a model cut into stages, what a pipeline rank holds, and the FSDP2 / DDP
calls torch's ``PipelineStage`` makes around a micro-batch's backward.

What is mirrored, and from where (torch 2.13, ``torch/distributed/pipelining``):

- The split is torchtitan's (``pipeline_module_split`` in
  ``torchtitan/distributed/pipeline_parallel.py``, with ``pipeline_parallel_first_stage_less_layers``
  and ``..._last_stage_less_layers`` at 0): stage s keeps blocks [s*L/S, (s+1)*L/S); the
  embeddings sit on the first stage, the final norm and the head on the last; a stage without
  them passes hidden states on (an HF causal LM is cut by its config's own ``base_model_pp_plan``:
  ``pipeline_hf.py``). Which stages a rank holds is the schedule's
  (``pp_schedules.rank_stages``: looped, or V-shaped for zbv / dualpipev).
- The order each rank runs its actions in is torch's (``pp_schedules.rank_actions``); the step
  that runs them, with ``PipelineStage``'s buffers, is ``pipeline_run.PipelineRun``.

Not mirrored (written in the approximations): the send/receive themselves move no memory of
their own here (NCCL's P2P buffers are outside the caching allocator); the hidden state a
stage receives is (micro-batch, sequence, d_model) in the stage parameters' dtype.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import TYPE_CHECKING

from batchfit.errors import OptionError
from batchfit.options import Checkpointing

if TYPE_CHECKING:
    from torch import nn

def _zoo_blocks(model: nn.Module) -> nn.ModuleList | None:
    blocks = getattr(model, "blocks", None)
    return blocks if blocks is not None and all(hasattr(model, a) for a in ("embed", "norm", "head")) else None


def pipeline_layers(model: nn.Module) -> int | None:
    """The blocks a pipeline splits: a zoo transformer's, or an HF causal LM's ``layers`` (its config's
    ``base_model_pp_plan``, ``pipeline_hf.py``); None when the model has no such split."""
    from batchfit.distributed.pipeline_hf import hf_layers

    blocks = _zoo_blocks(model)
    blocks = blocks if blocks is not None else hf_layers(model)
    return None if blocks is None else len(blocks)


def n_layers_of(model: nn.Module) -> int:
    n = pipeline_layers(model)
    if n is None:
        raise OptionError(f"pipeline parallelism needs a model with embed, blocks, norm and head (batchfit's "
                          f"zoo transformers) or an HF causal LM whose config has a base_model_pp_plan; "
                          f"{type(model).__name__} has neither: use fsdp / tp strategies")
    return n


def hidden_size_of(model: nn.Module) -> int:
    """The width of the hidden state a stage sends."""
    from batchfit.distributed.pipeline_hf import hidden_size

    return model.embed.embedding_dim if _zoo_blocks(model) is not None else hidden_size(model)


def sends_sequence_shard(model: nn.Module, tp: int) -> bool:
    """Whether a stage of ``model`` under tp<``tp``> sends 1/tp of the sequence: with sequence parallelism (the
    zoo's Llama plan, the Llama-shaped HF families') the residual stream a stage sends holds 1/tp of it (the
    embedding's Rowwise output is Shard(1), local); an HF model's own plan leaves it whole."""
    from batchfit.distributed.pipeline_hf import pp_parts
    from batchfit.distributed.tp_plans import sequence_parallel

    return tp > 1 and (getattr(model, "pos", None) is None if pp_parts(model) is None else sequence_parallel(model))


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
    """Stage ``stage`` of ``stages`` of ``model``, in place (torchtitan's pipeline_module_split); an HF
    causal LM by its own ``base_model_pp_plan`` (``pipeline_hf.split_hf_stage``)."""
    from torch import nn

    from batchfit.distributed.pipeline_hf import split_hf_stage

    n_layers_of(model)  # refuses a model with no split
    blocks = _zoo_blocks(model)
    if blocks is None:
        return split_hf_stage(model, stage, stages)
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
    """The stage modules one pipeline rank holds (V of them under the interleaved and V-shaped
    schedules): what the optimizer steps over. Each stage is called by itself, as PipelineStage calls its submodule."""

    def __new__(cls, stages: list[nn.Module], indices: list[int]):
        from torch import nn

        holder = nn.Module()
        holder.stages = nn.ModuleList(stages)
        holder.stage_indices = list(indices)
        return holder


def build_rank(build_model: Callable[[], nn.Module], stages: int, indices: list[int],
               checkpointing: Checkpointing = Checkpointing("none")) -> nn.Module:
    """The stage modules ``indices`` of a model cut into ``stages`` (one pipeline rank's, from
    ``pp_schedules.rank_stages``). ``checkpointing`` (--checkpointing) is applied to each stage's
    own blocks, as torchtitan applies AC per stage model (the step's own pass would pick one
    stack of the rank)."""
    from batchfit.train.step import _checkpoint_blocks

    modules = [split_stage(build_model(), s, stages) for s in indices]
    if checkpointing.kind != "none":
        for stage in modules:
            _checkpoint_blocks(stage, checkpointing, preserve_rng_state=False)  # fake tensors: no CPU RNG snapshot
    return RankStages(modules, list(indices))


def backward_sync(module, *, last: bool):
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


def reduce_grad(module) -> None:
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


def _tied_hf_head(workload) -> bool:
    """Whether ``workload``'s model is an HF causal LM whose head is tied to its embedding (built on meta)."""
    import torch

    from batchfit.distributed.pipeline_hf import pp_parts

    try:
        with torch.device("meta"):
            model = workload.build_model()
    except Exception:  # the sessions say why a model does not build
        return False
    return pp_parts(model) is not None and model.get_output_embeddings().weight is model.get_input_embeddings().weight


def pipeline_approximations(strategies, workload=None) -> list:
    """What a plan with pp<N> strategies says in every output: how a pipeline rank was traced."""
    from batchfit.trace.approximation import Approximation

    pipelined = [s for s in strategies if getattr(s, "pp", 1) > 1]
    if not pipelined:
        return []
    tied = [Approximation(
        what="the HF model's head is tied to its embedding: under pp<N> the first stage holds the embedding and the "
             "last the head, each its own copy (as transformers' pipeline split keeps them); the all-reduce that sums "
             "their gradients between the two ranks is neither traced nor timed",
        may_differ_by="one all-reduce of vocabulary x hidden elements per step (time only: NCCL works in place)",
        source="distributed/pipeline_hf.py; docs/tracing/pipeline.md")] if (
        workload is not None and _tied_hf_head(workload)) else []
    names = sorted({f"{s.name} ({s.pp_schedule})" for s in pipelined})
    dualpipe = any(s.pp_schedule == "dualpipev" for s in pipelined)
    return [Approximation(
        what=f"{', '.join(names)}: each pipeline rank's step traced in torch's schedule order (its own action "
             "lists; a zero-bubble schedule's I and W run torch's stage_backward_input / stage_backward_weight) with "
             "PipelineStage's receive buffers, forward cache and the runtime's pending sends mirrored "
             "(distributed/pipeline_run.py), not torch's PipelineStage itself; the point-to-point sends move no bytes "
             "of their own; the bubble is torch's order played at T_F = T_B = T_W (Qi et al. 2023's assumption), "
             "sends taking no time, the optimizer step waiting for every rank"
             + ("; DualPipeV's overlapped forward and backward run one after the other, as torch's runtime runs "
                "them (torchtitan's overlap_callback runs them on two threads: their transients may coincide)"
                if dualpipe else ""),
        may_differ_by="on gloo (2 and 4 ranks, tests/test_pipeline.py, benchmarks/pp_gloo.py): every rank within "
                      "90 B for each schedule, with and without full activation checkpointing (an HF Qwen3 cut by its "
                      "base_model_pp_plan, 1F1B and ZBV with full checkpointing on 2 ranks: within 72 B; pp2 x "
                      "tp2 on an HF Llama, 4 ranks: the first pipeline rank 0.56% under, the last within 52 "
                      "B); NCCL's P2P staging buffers (outside the caching allocator) are not counted",
        source="tests/test_pipeline.py; tests/test_pipeline_hf.py; benchmarks/pp_gloo.py; "
               "docs/tracing/pipeline.md")] + tied
