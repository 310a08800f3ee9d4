"""The tensor-parallel plan of HF mixture-of-experts decoders (Qwen3-MoE, Mixtral, Qwen2-MoE) under
``ep<N>+fsdp+tp<M>``: torchtitan's layout for its MoE models, on HF's modules.

torchtitan (``models/llama4/infra/parallelize.py``: ``apply_non_moe_tp`` then ``apply_moe_ep_tp``;
``models/qwen3/infra/parallelize.py`` the same) splits everything but the routed experts as the dense
plans do, and with its default ``expert_tensor_parallel_degree = 1`` lets expert parallelism borrow
the tensor-parallel ranks:

- embedding, final norm, head, attention (q/k/v by columns, o by rows), the norms (sequence-parallel,
  Qwen3's per-head q/k norms over the heads): ``tp_plans.hf_root_plan`` / ``hf_attention_plan``, the
  dense plans' own; the loss under ``loss_parallel`` when the head keeps its logits sharded;
- each MoE block (``mlp``): its input all-gathered from the sequence shards and handed in as a plain
  tensor, its output a partial sum over the tp ranks, reduce-scattered back onto the sequence shards
  (``PrepareModuleInputOutput(Shard(1) -> Replicate, use_local_input; Partial -> Shard(1))``);
- the router (``mlp.gate``) replicated: every tp rank scores every token (torchtitan's ``NoParallel``
  on ``moe.router.gate``; HF's router returns a tuple, so the same hooks are written here);
- the shared experts where the config has them (Qwen2-MoE's ``shared_expert``, DeepSeek-style
  ``shared_experts``): gate/up by columns, down by rows left a partial sum (added to the routed
  experts' partial sum before the block's reduce-scatter); Qwen2-MoE's one-column
  ``shared_expert_gate`` replicated;
- the routed experts: not here. ``distributed/expert_parallel.py`` has replaced them (before this
  plan runs) by the rank's experts / ep on the sparse mesh, each tp rank dispatching its 1/tp of the
  block's tokens (torchtitan's ``ReordererSequenceParallel``) and filling only those rows of the block's
  output: hence the partial sum. FSDP2 wraps them on their own mesh.

A model whose experts are still HF's (``fsdp+tp<M>`` without ep<N>) stops with one line: torchtitan
then tensor-parallelises each expert's matrices (``TensorParallel``), which is not traced here.
DeepSeek-V3's multi-head latent attention has no plan here (``tp_plan`` returns None for it).
"""

from __future__ import annotations

from torch import nn

from batchfit.errors import OptionError
from batchfit.train.losses import TP_LOSS_ATTR

MOE_TYPES = ("qwen3_moe", "mixtral", "qwen2_moe")
"""HF model types whose decoder layers hold ``self_attn`` (q/k/v/o) and an MoE block ``mlp`` with
``gate`` (the router) and ``experts`` (stacked weights, ``@use_experts_implementation``)."""


def _replicated_router(gate: nn.Module, mesh) -> None:
    """torchtitan's ``NoParallel`` for a router that returns a tuple (HF's: logits, weights, indices):
    its parameters (and buffers: DeepSeek-style score-correction biases) replicated DTensors, its input
    made a replicated DTensor, each DTensor of its output handed back as a plain tensor."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    def inputs_in(module, inputs, mesh):
        return tuple(DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
                     if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

    def outputs_out(module, outputs, mesh):
        if isinstance(outputs, DTensor):
            return outputs.to_local()
        return tuple(o.to_local() if isinstance(o, DTensor) else o for o in outputs)

    distribute_module(gate, mesh, None, inputs_in, outputs_out)


def _moe_block_plan(block: nn.Module) -> dict:
    """The MoE block's input / output layouts and its shared experts (the module docstring)."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInputOutput, RowwiseParallel

    plan = {"mlp": PrepareModuleInputOutput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                            use_local_input=True, output_layouts=(Partial(),),
                                            desired_output_layouts=(Shard(1),), use_local_output=False)}
    for name in ("shared_expert", "shared_experts"):
        if isinstance(getattr(block, name, None), nn.Module):
            plan.update({f"mlp.{name}.gate_proj": ColwiseParallel(), f"mlp.{name}.up_proj": ColwiseParallel(),
                         f"mlp.{name}.down_proj": RowwiseParallel(output_layouts=Partial())})
    return plan


def hf_moe_decoder(model: nn.Module, mesh, *, loss: str = "sharded") -> nn.Module:
    """The plan of the module docstring on an HF MoE causal LM whose experts expert parallelism has
    already replaced (``apply_expert_parallel`` with ``token_mesh``)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from batchfit.distributed.expert_parallel import ExpertParallelExperts
    from batchfit.distributed.tp_pieces import hf_attention_plan, hf_dense_mlp_plan, hf_root_plan, holds, replicate_rest
    from batchfit.trace.routing import moe_experts

    tp = mesh.size()
    if moe_experts(model):
        raise OptionError(f"tp{tp} on {model.config.model_type}: the experts are tensor-parallel only beside expert "
                          f"parallelism here (torchtitan's etp=1 layout; its per-expert TensorParallel is not "
                          f"traced): use ep<N>+fsdp+tp{tp}, e.g. ep8+fsdp+tp{tp}")
    hf_root_plan(model, mesh, loss)
    for layer in model.model.layers:
        block = layer.mlp
        moe = isinstance(getattr(block, "experts", None), ExpertParallelExperts)
        parallelize_module(layer, mesh, {**hf_attention_plan(layer),
                                         **(_moe_block_plan(block) if moe else hf_dense_mlp_plan())})
        if moe:
            _replicated_router(block.gate, mesh)
    tied = getattr(model.config, "tie_word_embeddings", False)
    if tied and holds(model, "lm_head") and holds(model, "model.embed_tokens"):  # both ends (no pipeline cut)
        model.lm_head.weight = model.model.embed_tokens.weight  # both split by vocabulary rows
    setattr(model, TP_LOSS_ATTR, loss)
    return replicate_rest(model, mesh, skip=(ExpertParallelExperts,))
