"""Tensor-parallel plans: which linear layers split by columns, which by rows, per architecture
(the HF mixture-of-experts decoders', beside expert parallelism: ``tp_plans_moe.py``).

A plan is ``parallelize(model, tp_mesh) -> model``, applied with PyTorch's DTensor
``parallelize_module``. Decoder LMs (the zoo's transformers, HF Llama, Qwen2, Mistral) get the
plan of PyTorch's Llama example (``pytorch/examples/distributed/tensor_parallelism``, as in
torchtitan): in each block q/k/v and gate/up split by columns, o and down by rows, the norms
sequence-parallel (the residual stream between blocks holds 1/N of the sequence), the token
embedding split by rows of the vocabulary (output sharded on the sequence), the head split
by columns.

The loss (``StepOptions.tp_loss``): ``sharded`` (the default) keeps the head's output sharded
on the vocabulary (``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)``) and
the step computes the cross-entropy under ``torch.distributed.tensor.parallel.loss_parallel``
(torchtitan: torchtitan/models/llama3/infra/parallelize.py ``apply_tp`` and
torchtitan/distributed/utils.py ``get_train_context``): each rank holds [B, T, V/N] logits, and
the log-softmax all-reduces a max and a sum per row. ``gathered`` all-gathers the logits
(``output_layouts=Replicate()``, the PyTorch example's plan): every rank holds the whole
[B, T, V]. A plan records which one it built on the model (``train.losses.TP_LOSS_ATTR``),
and the step reads it there.

GPT-2 and BERT (and the zoo's GPT-2 blocks) get the same split of their blocks; their
embeddings, norms and heads stay whole on every rank (no sequence parallelism), as
replicated DTensors: the optimizer's foreach step refuses plain tensors and DTensors
together, so no shipped plan leaves a plain parameter. Their loss is "replicated": each rank
computes the whole head and loss itself (no vocabulary split, so no sharded loss).

Fused projections (the zoo's ``qkv`` and gate+up ``up``, GPT-2's ``c_attn``) split by
columns as one matrix, and each attention module is told its local head counts: each rank
then holds the rows of its own heads, which for real weights means the fused matrix is laid
out head-group by head-group (a permutation at load time). Memory and communication do not
depend on that layout. GPT-2's ``Conv1D`` layers (a transposed ``nn.Linear``) become
``nn.Linear`` with the same weights, which DTensor's styles take.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from batchfit.errors import OptionError
from batchfit.train.losses import TP_LOSS_ATTR
from batchfit.workload import check_tp_loss

Parallelize = Callable[[nn.Module, "DeviceMesh"], nn.Module]  # noqa: F821

DECODER_TYPES = ("llama", "qwen2", "mistral")


def _styles():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    return Replicate, Shard, ColwiseParallel, RowwiseParallel, PrepareModuleInput, SequenceParallel


def _head(loss: str):
    """The output head's style: its logits kept sharded on the vocabulary (for loss_parallel)
    or all-gathered onto every rank. Its input is the sequence-sharded residual stream."""
    Replicate, Shard, Colwise, *_ = _styles()
    if loss == "sharded":
        return Colwise(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    return Colwise(input_layouts=Shard(1), output_layouts=Replicate())


def _check_heads(name: str, heads: int, kv_heads: int, tp: int) -> None:
    if heads % tp or kv_heads % tp:
        raise OptionError(f"tp{tp} needs the attention heads of {name} ({heads} query, {kv_heads} key/value) "
                          f"to divide by {tp}: pick a tensor-parallel degree that divides {kv_heads}")


def _replicate_rest(model: nn.Module, mesh, skip: tuple[type, ...] = ()) -> nn.Module:
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
                replicated[id(param)] = nn.Parameter(DTensor.from_local(param.data, mesh, [Replicate()], run_check=False),
                                                     requires_grad=param.requires_grad)
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


def _zoo_transformer(model: nn.Module, mesh, *, loss: str = "sharded") -> nn.Module:
    """batchfit.zoo.transformer.Transformer (GPT-2 or Llama blocks, fused qkv and gate+up)."""
    from torch.distributed.tensor.parallel import parallelize_module

    Replicate, Shard, Colwise, Rowwise, PrepareInput, SequenceParallel = _styles()
    tp = mesh.size()
    cfg = model.cfg
    _check_heads(type(model).__name__, cfg.n_heads, cfg.n_kv_heads or cfg.n_heads, tp)
    # Llama blocks: the PyTorch example's plan. GPT-2 blocks (learned positions added to the
    # embedding, often a tied head): the blocks only, as for HF GPT-2.
    sequence_parallel = model.pos is None
    if sequence_parallel:
        parallelize_module(model, mesh, {
            "embed": Rowwise(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "head": _head(loss),
        })
    for block in model.blocks:
        block_plan = {
            "attn.qkv": Colwise(),
            "attn.proj": Rowwise(output_layouts=Shard(1)) if sequence_parallel else Rowwise(),
            "mlp.up": Colwise(),
            "mlp.down": Rowwise(output_layouts=Shard(1)) if sequence_parallel else Rowwise(),
        }
        if sequence_parallel:
            block_plan.update({
                "norm1": SequenceParallel(), "norm2": SequenceParallel(),
                "attn": PrepareInput(input_layouts=(Shard(1), None, None),
                                     desired_input_layouts=(Replicate(), None, None), use_local_output=True),
                "mlp": PrepareInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                    use_local_output=True),
            })
        parallelize_module(block, mesh, block_plan)
        block.attn.n_heads //= tp
        block.attn.n_kv_heads //= tp
    if cfg.tied_embeddings and sequence_parallel:
        model.head.weight = model.embed.weight  # both split by vocabulary rows (Shard(0))
    setattr(model, TP_LOSS_ATTR, loss if sequence_parallel else "replicated")
    return _replicate_rest(model, mesh)


def hf_root_plan(model: nn.Module, mesh, loss: str) -> None:
    """An HF causal LM's embedding (split by vocabulary rows), final norm (sequence-parallel) and head
    (``_head``); the heads of its config checked against the tp degree."""
    from torch.distributed.tensor.parallel import parallelize_module

    Replicate, Shard, Colwise, Rowwise, PrepareInput, SequenceParallel = _styles()
    config = model.config
    _check_heads(config.model_type, config.num_attention_heads,
                 getattr(config, "num_key_value_heads", None) or config.num_attention_heads, mesh.size())
    # The residual stream stays a DTensor (use_local_output=False): HF numbers the positions
    # by the embedding output's sequence length, which must be the whole sequence's.
    parallelize_module(model, mesh, {
        "model.embed_tokens": Rowwise(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        "model.norm": SequenceParallel(),
        "lm_head": _head(loss),
    })


def hf_attention_plan(layer: nn.Module) -> dict:
    """One HF decoder layer's attention and its two norms: q/k/v by columns, o by rows onto the
    sequence shards; Qwen3's per-head q/k norms sequence-parallel over the heads (torchtitan's qwen3
    plan: ``SequenceParallel(sequence_dim=2)``), their weights' gradients summed over the tp ranks."""
    Replicate, Shard, Colwise, Rowwise, PrepareInput, SequenceParallel = _styles()
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
    Replicate, Shard, Colwise, Rowwise, PrepareInput, _ = _styles()
    return {
        prefix: PrepareInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True),
        f"{prefix}.gate_proj": Colwise(), f"{prefix}.up_proj": Colwise(),
        f"{prefix}.down_proj": Rowwise(output_layouts=Shard(1), use_local_output=False),
    }


def _hf_decoder(model: nn.Module, mesh, *, loss: str = "sharded") -> nn.Module:
    """HF LlamaForCausalLM and its relatives (Qwen2, Mistral): separate q/k/v and gate/up."""
    from torch.distributed.tensor.parallel import parallelize_module

    hf_root_plan(model, mesh, loss)
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {**hf_attention_plan(layer), **hf_dense_mlp_plan()})
    if getattr(model.config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight  # both split by vocabulary rows
    setattr(model, TP_LOSS_ATTR, loss)
    return _replicate_rest(model, mesh)


def _conv1d_as_linear(conv: nn.Module) -> nn.Linear:
    """GPT-2's Conv1D (weight [in, out], ``x @ W + b``) as the nn.Linear that computes the same."""
    n_in, n_out = conv.weight.shape
    linear = nn.Linear(n_in, n_out, device=conv.weight.device, dtype=conv.weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    linear.weight.requires_grad_(conv.weight.requires_grad)
    linear.bias.requires_grad_(conv.bias.requires_grad)
    return linear


def _hf_gpt2(model: nn.Module, mesh, *, loss: str = "sharded") -> nn.Module:
    from torch.distributed.tensor.parallel import parallelize_module

    _, _, Colwise, Rowwise, _, _ = _styles()
    tp = mesh.size()
    _check_heads("gpt2", model.config.n_head, model.config.n_head, tp)
    for block in model.transformer.h:
        for parent, name in ((block.attn, "c_attn"), (block.attn, "c_proj"), (block.mlp, "c_fc"),
                             (block.mlp, "c_proj")):
            setattr(parent, name, _conv1d_as_linear(getattr(parent, name)))
        parallelize_module(block, mesh, {"attn.c_attn": Colwise(), "attn.c_proj": Rowwise(),
                                         "mlp.c_fc": Colwise(), "mlp.c_proj": Rowwise()})
        block.attn.split_size //= tp
        block.attn.num_heads //= tp
    setattr(model, TP_LOSS_ATTR, "replicated")
    return _replicate_rest(model, mesh)


def _hf_bert(model: nn.Module, mesh, *, loss: str = "sharded") -> nn.Module:
    from torch.distributed.tensor.parallel import parallelize_module

    _, _, Colwise, Rowwise, _, _ = _styles()
    tp = mesh.size()
    _check_heads("bert", model.config.num_attention_heads, model.config.num_attention_heads, tp)
    for layer in model.bert.encoder.layer:
        parallelize_module(layer, mesh, {
            "attention.self.query": Colwise(), "attention.self.key": Colwise(), "attention.self.value": Colwise(),
            "attention.output.dense": Rowwise(), "intermediate.dense": Colwise(), "output.dense": Rowwise(),
        })
        attention = layer.attention.self
        attention.num_attention_heads //= tp
        attention.all_head_size //= tp
    setattr(model, TP_LOSS_ATTR, "replicated")
    return _replicate_rest(model, mesh)


def tp_plan(model: nn.Module, loss: str = "sharded") -> Parallelize | None:
    """The shipped plan for ``model``, or None when there is none; ``loss`` ("sharded" or
    "gathered") is how a plan that splits the head by the vocabulary leaves its logits."""
    from batchfit.zoo.transformer import Transformer

    from batchfit.distributed.tp_plans_moe import MOE_TYPES, hf_moe_decoder

    check_tp_loss(loss)
    plan = None
    if isinstance(model, Transformer):
        plan = _zoo_transformer
    else:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type in DECODER_TYPES and hasattr(model, "lm_head"):
            plan = _hf_decoder
        elif model_type in MOE_TYPES and hasattr(model, "lm_head"):
            plan = hf_moe_decoder
        elif model_type == "gpt2" and hasattr(model, "transformer"):
            plan = _hf_gpt2
        elif model_type == "bert" and hasattr(model, "bert"):
            plan = _hf_bert
    return functools.partial(plan, loss=loss) if plan is not None else None
