"""The pieces every tensor-parallel plan is built from: PyTorch's DTensor styles, the head's style
for the loss it keeps (sharded on the vocabulary or gathered), the heads check, the HF root,
attention and dense-MLP plans, and the replication of what a plan leaves whole. The dense plans
(``tp_plans.py``) and the mixture-of-experts plan (``tp_plans_moe.py``) both stand on them; the
plans' layout and its sources are written in ``tp_plans.py``."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from batchfit.errors import OptionError

Parallelize = Callable[[nn.Module, "DeviceMesh"], nn.Module]  # noqa: F821


def styles():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel
    return Replicate, Shard, ColwiseParallel, RowwiseParallel, PrepareModuleInput, SequenceParallel


def head_style(loss: str):
    """The output head's style: its logits kept sharded on the vocabulary (for loss_parallel)
    or all-gathered onto every rank. Its input is the sequence-sharded residual stream."""
    Replicate, Shard, Colwise, *_ = styles()
    if loss == "sharded":
        return Colwise(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    return Colwise(input_layouts=Shard(1), output_layouts=Replicate())


def check_heads(name: str, heads: int, kv_heads: int, tp: int) -> None:
    if heads % tp or kv_heads % tp:
        raise OptionError(f"tp{tp} needs the attention heads of {name} ({heads} query, {kv_heads} key/value) "
                          f"to divide by {tp}: pick a tensor-parallel degree that divides {kv_heads}")


def replicate_rest(model: nn.Module, mesh, skip: tuple[type, ...] = ()) -> nn.Module:
    """Every parameter the plan left whole becomes a replicated DTensor, as torchtitan's plans
    leave none: an optimizer step over DTensors and plain tensors together (foreach, as on
    CUDA) refuses the mix. A module holding such parameters takes plain tensors in (made
    replicated DTensors) and gives plain tensors out, unless its caller already works in
    DTensors (then it is one step of a larger replicated module). Modules of a ``skip`` type keep
    theirs (the expert-parallel experts: sharded on their own mesh, DTensors once FSDP2 wraps them)."""
    from torch.distributed.tensor import DTensor, Replicate

    replicated: dict[int, nn.Parameter] = {}  # tied parameters stay tied
    for module in model.modules():
        if isinstance(module, skip):
            continue
        own = [(name, p) for name, p in module.named_parameters(recurse=False) if not isinstance(p, DTensor)]
        if not own:
            continue
        for name, param in own:
            if id(param) not in replicated:
                local = DTensor.from_local(param.data, mesh, [Replicate()], run_check=False)
                replicated[id(param)] = nn.Parameter(local, requires_grad=param.requires_grad)
            module._parameters[name] = replicated[id(param)]
        converted: list[bool] = []

        def to_dtensor(module, args, kwargs, converted=converted):
            plain = [isinstance(a, torch.Tensor) and not isinstance(a, DTensor) for a in (*args, *kwargs.values())]
            converted.append(any(plain))
            wrap = lambda a: (DTensor.from_local(a, mesh, [Replicate()], run_check=False)  # noqa: E731
                              if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a)
            return tuple(wrap(a) for a in args), {k: wrap(v) for k, v in kwargs.items()}

        def to_local(module, args, kwargs, output, converted=converted):
            if converted.pop():
                return output.to_local() if isinstance(output, DTensor) else output
            return output

        module.register_forward_pre_hook(to_dtensor, with_kwargs=True)
        module.register_forward_hook(to_local, with_kwargs=True)
    return model


def hf_root_plan(model: nn.Module, mesh, loss: str) -> None:
    """An HF causal LM's embedding (split by vocabulary rows), final norm (sequence-parallel) and head
    (``head_style``); the heads of its config checked against the tp degree."""
    from torch.distributed.tensor.parallel import parallelize_module

    Replicate, Shard, Colwise, Rowwise, PrepareInput, SequenceParallel = styles()
    config = model.config
    check_heads(config.model_type, config.num_attention_heads,
                 getattr(config, "num_key_value_heads", None) or config.num_attention_heads, mesh.size())
    # The residual stream stays a DTensor (use_local_output=False): HF numbers the positions
    # by the embedding output's sequence length, which must be the whole sequence's.
    plan = {
        "model.embed_tokens": Rowwise(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        "model.norm": SequenceParallel(),
        "lm_head": head_style(loss),
    }
    # A pipeline stage holds some of them (distributed/pipeline_hf.py): the others are parameter-free
    # pass-throughs, and the residual stream it receives or sends is this rank's sequence shard.
    parallelize_module(model, mesh, {name: style for name, style in plan.items() if holds(model, name)})
    model._batchfit_sequence_parallel = mesh


def holds(model: nn.Module, name: str) -> bool:
    """Whether ``model`` holds the part ``name`` (a pipeline stage keeps pass-throughs for the others)."""
    return any(True for _ in model.get_submodule(name).parameters())


def hf_attention_plan(layer: nn.Module) -> dict:
    """One HF decoder layer's attention and its two norms: q/k/v by columns, o by rows onto the
    sequence shards; Qwen3's per-head q/k norms sequence-parallel over the heads (torchtitan's qwen3
    plan: ``SequenceParallel(sequence_dim=2)``), their weights' gradients summed over the tp ranks."""
    Replicate, Shard, Colwise, Rowwise, PrepareInput, SequenceParallel = styles()
    plan = {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                  desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                  use_local_output=True),
        "self_attn.q_proj": Colwise(), "self_attn.k_proj": Colwise(), "self_attn.v_proj": Colwise(),
        "self_attn.o_proj": Rowwise(output_layouts=Shard(1), use_local_output=False),
        "post_attention_layernorm": SequenceParallel(),
    }
    for norm in ("q_norm", "k_norm"):
        if isinstance(getattr(layer.self_attn, norm, None), nn.Module):
            plan[f"self_attn.{norm}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def hf_dense_mlp_plan(prefix: str = "mlp") -> dict:
    """An HF gate/up/down MLP: gate and up by columns, down by rows onto the sequence shards."""
    Replicate, Shard, Colwise, Rowwise, PrepareInput, _ = styles()
    return {
        prefix: PrepareInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True),
        f"{prefix}.gate_proj": Colwise(), f"{prefix}.up_proj": Colwise(),
        f"{prefix}.down_proj": Rowwise(output_layouts=Shard(1), use_local_output=False),
    }
