"""Pipeline stages of an HF causal LM, cut by the model's own ``base_model_pp_plan``.

Every transformers decoder config names the base model's pipeline parts in order
(``base_model_pp_plan``: Llama's ``embed_tokens``, ``layers``, ``norm``; GPT-NeoX's ``embed_in``,
``emb_dropout``, ``layers``, ``final_layer_norm``), and the causal LM its head (``_pp_plan``:
``lm_head``). Stage s of S keeps layers [s L/S, (s+1) L/S) (torchtitan's even split, as the zoo's
stages: ``pipeline.split_stage``); the parts before ``layers`` stay on the first stage only, the parts
after it and the head on the last only; elsewhere each becomes a pass-through with no parameters
(transformers' own ``PipelineIdentityLayer``, ``transformers/distributed/pipeline_parallel.py``).

A stage runs the model's own forward, as transformers' pipeline forward does: the first stage from the
token ids, a later one from the hidden state it received, handed in as ``inputs_embeds``; the last
through the causal LM's forward (its head, and what the family does to the logits: Granite's scaling,
Gemma's soft-capping), the others through the base model's (its last hidden state is what they send).
So each stage numbers the positions, builds its rotary tables and its causal mask itself, from the
hidden state's sequence length, as the whole model would (no position ids or mask travel between
stages: torch's schedules hand inputs to the first stage only). What the base forward does per layer
index reads the stage's own copy of the config, whose ``layer_types`` (sliding or full attention, per
layer) and ``num_hidden_layers`` are the stage's slice. Granite's ``embedding_multiplier``, which its
base forward applies to ``inputs_embeds`` whatever made them, is applied by the first stage only.

The loss is the causal LM's own (``loss_function``: transformers' ``ForCausalLMLoss``), on the last
stage's logits and the micro-batch's labels, as the model's forward computes it from ``labels``.
A head tied to the embedding is kept by the last stage (transformers' split keeps the tie there too);
the first stage's embedding is its own copy, the sum of the two gradients (one all-reduce of the
embedding between the two stages) is not traced.
"""

from __future__ import annotations

import copy
import types

from torch import nn

LAYERS = "layers"
"""The base model's ModuleList in every ``base_model_pp_plan``."""


class PassThrough(nn.Module):
    """A part this stage does not hold: returns its first input (transformers' PipelineIdentityLayer)."""

    def forward(self, *args, **kwargs):
        return args[0] if args else next(iter(kwargs.values()))


class _AppliedOnce:
    """Granite's ``embedding_multiplier`` on a stage after the first: ``x * it`` is ``x`` itself (the
    first stage multiplied already; a plain 1.0 would still copy the hidden state, which the first layer
    then keeps for backward)."""

    def __rmul__(self, other):
        return other


def pp_parts(model: nn.Module) -> tuple[nn.Module, list[str], list[str]] | None:
    """(the base model, its parts before ``layers``, its parts after it) from the config's
    ``base_model_pp_plan``; None when the model is no HF causal LM with one."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_pp_plan", None)
    prefix = getattr(model, "base_model_prefix", None)
    base = getattr(model, prefix, None) if prefix else None
    if not plan or base is None or LAYERS not in plan or not isinstance(getattr(base, LAYERS, None), nn.ModuleList):
        return None
    if not getattr(type(model), "_pp_plan", None) or model.get_output_embeddings() is None:
        return None
    names = list(plan)
    at = names.index(LAYERS)
    return base, names[:at], names[at + 1:]


def hf_layers(model: nn.Module) -> nn.ModuleList | None:
    parts = pp_parts(model)
    return getattr(parts[0], LAYERS) if parts else None


def hidden_size(model: nn.Module) -> int:
    return model.config.hidden_size


def _head_names(model: nn.Module) -> list[str]:
    return list(type(model)._pp_plan)


def split_hf_stage(model: nn.Module, stage: int, stages: int) -> nn.Module:
    """Stage ``stage`` of ``stages`` of the HF causal LM ``model``, in place (the module docstring)."""
    base, before, after = pp_parts(model)
    layers = getattr(base, LAYERS)
    per = len(layers) // stages
    first, last = stage * per, (stage + 1) * per
    setattr(base, LAYERS, nn.ModuleList(list(layers)[first:last]))
    config = copy.copy(base.config)  # the model's forward reads the stage's layers by index in it
    config.num_hidden_layers = per
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[first:last]
    base.config = config
    if stage > 0:
        for name in before:
            setattr(base, name, PassThrough())
        if getattr(base, "embedding_multiplier", None) is not None:
            base.embedding_multiplier = _AppliedOnce()
    if stage < stages - 1:
        for name in after:
            setattr(base, name, PassThrough())
        for name in _head_names(model):
            setattr(model, name, PassThrough())
    model._batchfit_hf_stage = (stage == 0, stage == stages - 1)
    model.forward = types.MethodType(_stage_forward, model)
    return model


def _stage_forward(self, x):
    """A stage's forward: token ids (the first stage) or the received hidden state in, the logits
    (the last) or the hidden state to send out. Under a sequence-parallel TP plan
    (``tp_pieces.hf_root_plan``) the hidden state travels as this rank's sequence shard, a plain
    tensor (what torch's PipelineStage sends), and is the residual stream's DTensor again inside."""
    first, last = self._batchfit_hf_stage
    mesh = getattr(self, "_batchfit_sequence_parallel", None)
    if not first and mesh is not None:
        from torch.distributed.tensor import DTensor, Shard

        x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
    inputs = {"input_ids": x} if first else {"inputs_embeds": x}
    if last:
        return type(self).forward(self, **inputs).logits
    out = getattr(self, self.base_model_prefix)(**inputs).last_hidden_state
    return out.to_local() if mesh is not None else out


def is_hf_stage(module: nn.Module) -> bool:
    return hasattr(module, "_batchfit_hf_stage")


def hf_stage_loss(module: nn.Module, logits, labels):
    """The causal LM's loss from the last stage's logits (what its forward computes from ``labels``)."""
    return module.loss_function(logits=logits, labels=labels, vocab_size=module.config.vocab_size)
