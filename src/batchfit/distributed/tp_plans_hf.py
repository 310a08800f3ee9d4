"""Tensor-parallel plans read from an HF model's own ``base_model_tp_plan`` (and its causal LM's
``_tp_plan`` for the head), for the families batchfit has no hand plan for (Phi-3, GPT-NeoX, OLMo 2,
Gemma 3, Starcoder2, Cohere, Phi, ...).

transformers' plan maps module-name globs (``layers.*.self_attn.q_proj``) to style names, which it
applies with its own ``TensorParallelLayer`` classes (``distributed/tensor_parallel.py``); here each name
becomes torch's DTensor style with the input and output layouts transformers registers for it
(transformers 5.x ``ALL_PARALLEL_STYLES``), applied with ``parallelize_module``. The layouts, so the
collectives and the shards each rank holds, are transformers'; the code that runs them is torch's:

- ``colwise``: ``ColwiseParallel()`` (input replicated, output sharded on the last dim, local);
- ``colwise_gather_output`` / ``colwise_rep``: ``ColwiseParallel(output_layouts=Replicate())``, the
  output all-gathered: Phi-3's fused qkv_proj / gate_up_proj and OLMo 2's q/k/v (whose q/k norms
  span every head) run attention on every head on every rank, as transformers runs them;
- ``rowwise``: ``RowwiseParallel()`` (input sharded on the last dim, output all-reduced);
- ``rowwise_split_input`` / ``rowwise_rep``: ``RowwiseParallel(input_layouts=Replicate())``, the
  whole input cut locally (no collective) before the row-split matmul;
- ``embedding_rowwise``: ``RowwiseParallel(input_layouts=Replicate())`` on the embedding (vocabulary
  rows split, the output all-reduced);
- ``replicated_with_grad_allreduce`` / ``replicate``: left whole (a replicated DTensor, as every
  parameter a plan leaves: ``tp_pieces.replicate_rest``).

No sequence parallelism: transformers' plans have none, so the norms and the residual stream stay
whole on every rank (batchfit's hand plans for the Llama-shaped families split them: ``tp_plans.py``).
The head (``_tp_plan``'s ``colwise_gather_output``) keeps its logits sharded on the vocabulary under
``--tp-loss sharded`` (the loss under ``loss_parallel``) or gathers them (``gathered``); a head tied to
an embedding the plan leaves whole stays whole too (``replicated`` loss).

A plan that cannot be honest is refused in one line (:func:`hf_plan_refusal`): a style with no DTensor
counterpart here (packed MoE experts, MLA's projections, ...), or a fused projection split by columns
whose parts would not split by heads (GPT-NeoX's ``query_key_value`` is laid out head by head, so its
column split is a split by heads; another fused q/k/v or gate/up matrix split as one is not).
"""

from __future__ import annotations

import re

from torch import nn

from batchfit.train.losses import TP_LOSS_ATTR

WHOLE = ("replicated_with_grad_allreduce", "replicate")
"""Styles that leave the module's parameters whole on every rank."""
STYLES = ("colwise", "colwise_gather_output", "colwise_rep", "rowwise", "rowwise_split_input", "rowwise_rep",
          "embedding_rowwise", *WHOLE)
"""transformers' style names this file maps to DTensor styles."""
FUSED = ("qkv_proj", "gate_up_proj", "c_attn", "Wqkv", "query_key_value", "qkv")
"""Names of fused projections (several matrices stacked by output rows)."""
PER_HEAD_FUSED = {("gpt_neox", "query_key_value")}
"""Fused projections laid out head by head (GPT-NeoX views its output as [..., heads, 3 x head_size]):
a column split of the whole matrix gives each rank whole heads."""


def _base(model: nn.Module) -> nn.Module | None:
    return getattr(model, getattr(model, "base_model_prefix", "") or "", None)


def _own_plan(model: nn.Module) -> dict[str, str] | None:
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_tp_plan", None)
    return dict(plan) if plan else None


def _matches(glob: str, names: list[str]) -> list[str]:
    pattern = re.compile("^" + re.escape(glob).replace(r"\*", r"[^.]+") + "$")
    return [n for n in names if pattern.match(n)]


def resolved_plan(model: nn.Module) -> dict[str, str]:
    """{module name under the base model: style} for every module the model's own plan names."""
    base = _base(model)
    names = [name for name, _ in base.named_modules() if name]
    out: dict[str, str] = {}
    for glob, style in (_own_plan(model) or {}).items():
        for name in _matches(glob, names):
            out[name] = style
    return out


def _head(model: nn.Module) -> tuple[str, str] | None:
    """(the head's attribute on the causal LM, its style in ``_tp_plan``), or None."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, style in (getattr(model, "_tp_plan", None) or {}).items():
        if head is not None and getattr(model, name, None) is head:
            return name, style
    return None


def hf_plan_refusal(model: nn.Module) -> str | None:
    """Why the model's own ``base_model_tp_plan`` cannot be traced honestly here; None when it can."""
    config = model.config
    kind = config.model_type
    if _base(model) is None:
        return f"{type(model).__name__} has no base model ({model.base_model_prefix!r}) to read its tp plan on"
    plan = resolved_plan(model)
    if not plan:
        return f"{kind}'s base_model_tp_plan names no module of {type(model).__name__}"
    for name, style in plan.items():
        if style not in STYLES:
            return f"{kind}'s own tp plan puts {name} under transformers' {style!r}, which has no DTensor style here"
        leaf = name.rsplit(".", 1)[-1]
        if style == "colwise" and leaf in FUSED and (kind, leaf) not in PER_HEAD_FUSED:
            return (f"{kind}'s own tp plan splits the fused {leaf} by columns as one matrix: its parts would not "
                    "split by heads (each rank would hold a slice across q, k and v); not traced")
    head = _head(model)
    if head is not None and not head[1].startswith("colwise"):
        return f"{kind}'s own tp plan splits its head {head[0]} as {head[1]!r}: only a colwise head is traced"
    return None


def hf_own_plan(model: nn.Module, mesh, *, loss: str = "sharded") -> nn.Module:
    """The model's own ``base_model_tp_plan`` (the module docstring), applied on ``mesh``."""
    from torch.distributed.tensor.parallel import parallelize_module

    from batchfit.distributed.tp_pieces import check_heads, holds, replicate_rest, styles
    from batchfit.errors import OptionError

    Replicate, Shard, Colwise, Rowwise, _, _ = styles()
    reason = hf_plan_refusal(model)
    if reason is not None:
        raise OptionError(f"tp{mesh.size()}: {reason}: use fsdp / ddp strategies")
    config = model.config
    check_heads(config.model_type, config.num_attention_heads,
                getattr(config, "num_key_value_heads", None) or config.num_attention_heads, mesh.size())
    made = {
        "colwise": lambda: Colwise(),
        "colwise_gather_output": lambda: Colwise(output_layouts=Replicate()),
        "colwise_rep": lambda: Colwise(output_layouts=Replicate()),
        "rowwise": lambda: Rowwise(),
        "rowwise_split_input": lambda: Rowwise(input_layouts=Replicate()),
        "rowwise_rep": lambda: Rowwise(input_layouts=Replicate()),
        "embedding_rowwise": lambda: Rowwise(input_layouts=Replicate()),
    }
    base = _base(model)
    plan = resolved_plan(model)
    # A pipeline stage (distributed/pipeline_hf.py) holds parameter-free pass-throughs for the parts it lacks.
    parallelize_module(base, mesh, {name: made[style]() for name, style in plan.items()
                                    if style not in WHOLE and holds(base, name)})
    embedding = model.get_input_embeddings()
    embed_split = any(base.get_submodule(name) is embedding for name, style in plan.items()
                      if style == "embedding_rowwise")
    tied = getattr(config, "tie_word_embeddings", False)
    head = _head(model)
    tp_loss = "replicated"
    if head is not None and holds(model, head[0]) and (embed_split or not tied):
        name, _ = head
        style = (Colwise(output_layouts=Shard(-1), use_local_output=False) if loss == "sharded"
                 else Colwise(output_layouts=Replicate()))
        parallelize_module(model, mesh, {name: style})
        if tied and any(True for _ in embedding.parameters()):  # both split by vocabulary rows (no pipeline cut)
            getattr(model, name).weight = embedding.weight
        tp_loss = loss
    setattr(model, TP_LOSS_ATTR, tp_loss)
    return replicate_rest(model, mesh)
