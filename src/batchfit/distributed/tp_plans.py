"""Tensor-parallel plans: which linear layers split by columns, which by rows, per architecture
(the HF mixture-of-experts decoders', beside expert parallelism: ``tp_plans_moe.py``; any other HF
model's own ``base_model_tp_plan``: ``tp_plans_hf.py``).

A plan is ``parallelize(model, tp_mesh) -> model``, applied with PyTorch's DTensor
``parallelize_module``. Decoder LMs (the zoo's transformers, HF Llama, Qwen2/3, Mistral, Granite,
Gemma) get the
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

import torch
from torch import nn

from batchfit.distributed.tp_pieces import (
    Parallelize,
    check_heads,
    head_style,
    hf_attention_plan,
    hf_dense_mlp_plan,
    hf_root_plan,
    holds,
    replicate_rest,
    styles,
)
from batchfit.distributed.tp_plans_hf import hf_own_plan, hf_plan_refusal
from batchfit.train.losses import TP_LOSS_ATTR
from batchfit.workload import check_tp_loss

DECODER_TYPES = ("llama", "qwen2", "mistral", "qwen3", "granite", "gemma")
"""HF decoders whose layers are Llama's module tree (input_layernorm, self_attn.{q,k,v,o}_proj,
post_attention_layernorm, mlp.{gate,up,down}_proj; Qwen3's per-head q/k norms besides): the hand
plan below, kept over their own ``base_model_tp_plan`` (``tp_plans_hf.py``) because it adds
sequence parallelism (the norms and the residual stream between blocks hold 1/tp of the sequence),
which transformers' plans lack; Granite's and Gemma's scalar multipliers act on DTensors as on
tensors. Gemma 2/3, OLMo 2 and Phi-3 are not this tree (extra norms around the attention and MLP,
norms over every head, fused projections): their own plan."""


def _zoo_transformer(model: nn.Module, mesh, *, loss: str = "sharded") -> nn.Module:
    """batchfit.zoo.transformer.Transformer (GPT-2 or Llama blocks, fused qkv and gate+up)."""
    from torch.distributed.tensor.parallel import parallelize_module

    Replicate, Shard, Colwise, Rowwise, PrepareInput, SequenceParallel = styles()
    tp = mesh.size()
    cfg = model.cfg
    check_heads(type(model).__name__, cfg.n_heads, cfg.n_kv_heads or cfg.n_heads, tp)
    # Llama blocks: the PyTorch example's plan. GPT-2 blocks (learned positions added to the
    # embedding, often a tied head): the blocks only, as for HF GPT-2.
    sequence_parallel = model.pos is None
    if sequence_parallel:
        parallelize_module(model, mesh, {
            "embed": Rowwise(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "head": head_style(loss),
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
    return replicate_rest(model, mesh)


def _hf_decoder(model: nn.Module, mesh, *, loss: str = "sharded") -> nn.Module:
    """HF LlamaForCausalLM and its relatives (``DECODER_TYPES``): separate q/k/v and gate/up."""
    from torch.distributed.tensor.parallel import parallelize_module

    hf_root_plan(model, mesh, loss)
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {**hf_attention_plan(layer), **hf_dense_mlp_plan()})
    tied = getattr(model.config, "tie_word_embeddings", False)
    if tied and holds(model, "lm_head") and holds(model, "model.embed_tokens"):  # both ends (no pipeline cut)
        model.lm_head.weight = model.model.embed_tokens.weight  # both split by vocabulary rows
    setattr(model, TP_LOSS_ATTR, loss)
    return replicate_rest(model, mesh)


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

    _, _, Colwise, Rowwise, _, _ = styles()
    tp = mesh.size()
    check_heads("gpt2", model.config.n_head, model.config.n_head, tp)
    for block in model.transformer.h:
        for parent, name in ((block.attn, "c_attn"), (block.attn, "c_proj"), (block.mlp, "c_fc"),
                             (block.mlp, "c_proj")):
            setattr(parent, name, _conv1d_as_linear(getattr(parent, name)))
        parallelize_module(block, mesh, {"attn.c_attn": Colwise(), "attn.c_proj": Rowwise(),
                                         "mlp.c_fc": Colwise(), "mlp.c_proj": Rowwise()})
        block.attn.split_size //= tp
        block.attn.num_heads //= tp
    setattr(model, TP_LOSS_ATTR, "replicated")
    return replicate_rest(model, mesh)


def _hf_bert(model: nn.Module, mesh, *, loss: str = "sharded") -> nn.Module:
    from torch.distributed.tensor.parallel import parallelize_module

    _, _, Colwise, Rowwise, _, _ = styles()
    tp = mesh.size()
    check_heads("bert", model.config.num_attention_heads, model.config.num_attention_heads, tp)
    for layer in model.bert.encoder.layer:
        parallelize_module(layer, mesh, {
            "attention.self.query": Colwise(), "attention.self.key": Colwise(), "attention.self.value": Colwise(),
            "attention.output.dense": Rowwise(), "intermediate.dense": Colwise(), "output.dense": Rowwise(),
        })
        attention = layer.attention.self
        attention.num_attention_heads //= tp
        attention.all_head_size //= tp
    setattr(model, TP_LOSS_ATTR, "replicated")
    return replicate_rest(model, mesh)


def tp_plan(model: nn.Module, loss: str = "sharded") -> Parallelize | None:
    """The shipped plan for ``model``, or None when there is none; ``loss`` ("sharded" or
    "gathered") is how a plan that splits the head by the vocabulary leaves its logits."""
    from batchfit.distributed.tp_plans_moe import MOE_TYPES, hf_moe_decoder
    from batchfit.zoo.transformer import Transformer

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
        elif own_plan_applies(model):
            plan = hf_own_plan
    return functools.partial(plan, loss=loss) if plan is not None else None


def own_plan_applies(model: nn.Module) -> bool:
    """Whether an HF causal LM without a hand plan has its own ``base_model_tp_plan`` that is traced here."""
    return (getattr(getattr(model, "config", None), "base_model_tp_plan", None) is not None
            and hasattr(model, "get_output_embeddings") and hf_plan_refusal(model) is None)


def no_plan_reason(model: nn.Module) -> str:
    """Why ``tp_plan(model)`` is None, in a few words (the refusals name it)."""
    if getattr(getattr(model, "config", None), "base_model_tp_plan", None) and hasattr(model, "get_output_embeddings"):
        return hf_plan_refusal(model) or "its own tp plan does not apply"
    return "no shipped plan and no base_model_tp_plan in its config"


def sequence_parallel(model: nn.Module) -> bool:
    """Whether the shipped plan of an HF ``model`` splits the residual stream by the sequence (the hand
    plans of ``DECODER_TYPES`` and ``tp_plans_moe``; the models' own plans do not)."""
    from batchfit.distributed.tp_plans_moe import MOE_TYPES

    return getattr(getattr(model, "config", None), "model_type", None) in (*DECODER_TYPES, *MOE_TYPES)
