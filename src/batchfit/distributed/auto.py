"""What the candidate rules of ``plan --strategies auto`` read and list, below the registry that holds them.

Each parallelism's rule (``distributed/parallelisms.py``: ``Parallelism.auto_combinations``, ``auto``,
``auto_skip``) reads a model's :class:`ModelFacts` and an :class:`AutoContext` (the world, the pipeline
schedule and its micro-batches) and lists :class:`Candidate` rows; ``plan/candidates.py`` iterates over
the registry, names the rows and ranks nothing. Pure Python: :func:`model_facts` imports torch when it
builds the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class ModelFacts:
    """What the rules read of a model (``model_facts`` builds it on the meta device)."""

    name: str
    """The workload's name, for the reasons."""
    n_layers: int | None = None
    """Blocks a pipeline splits; None: the model has no embed / blocks / norm / head split."""
    pp_tp_split_backward: bool = True
    """Whether TP composes inside its pipeline under a split-backward (zero-bubble) schedule: not for
    an HF model on a sequence-parallel plan (``plan/pipeline.py`` says why)."""
    heads: int | None = None
    """Attention query heads (None: not known, not checked)."""
    kv_heads: int | None = None
    """Attention key/value heads (None: as many as ``heads``)."""
    tp_plan: bool = False
    """Whether a tensor-parallel plan applies (the workload's own ``parallelize`` or a shipped one)."""
    tp_missing: str | None = None
    """Why no shipped plan applies, when none does (``tp_plans.no_plan_reason``)."""
    experts: int | None = None
    """Routed experts of a mixture-of-experts model (for the ep component); None: a dense model."""
    loss: str = "plain"
    """--loss: pipelines trace the plain loss only."""
    seq_len: int | None = None
    """Tokens per sample (the cp component's rule reads it); None: not a sequence model."""
    unread: str | None = None
    """Why the model could not be built on the meta device (then TP is left to the tracer, pp skipped)."""


@dataclass(frozen=True, kw_only=True)
class AutoContext:
    """What a rule reads besides the model: the world's shape and the pipeline schedule asked for."""

    gpus: int
    nodes: int = 1
    gpus_per_node: int
    pp_schedule: str = "1f1b"
    """--pp-schedule: which pipelines apply (its micro-batches, a zero-bubble schedule's split backward)."""
    microbatches: int = 0
    """--microbatches (0: the schedule's default)."""


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One combination of a world: its strategy name, degrees, and why it is skipped (or None)."""

    name: str = ""
    """As ``--strategies`` names it: 'fsdp', 'pp2+fsdp+tp4', ...; '' in a rule's row, which
    ``plan/candidates.py`` names from its degrees (``StrategyName`` writes it)."""
    gpus: int
    nodes: int = 1
    pp: int = 1
    dp: int = 1
    """Data-parallel ranks (samples split over them): GPUs / (pp x tp x cp)."""
    tp: int = 1
    degrees: dict[str, int] = field(default_factory=dict)
    """Degrees of further components (``cp``, ``ep``): ``Parallelism.auto``."""
    shard: str = "none"
    """The data-parallel wrap: 'ddp', 'fsdp', 'fsdp-noreshard', 'hsdp', 'zero1', 'zero2' or 'none'."""
    replicas: int = 1
    rule: str = ""
    """The rule (``plan/candidates.py``'s docstring) that made it."""
    skipped: str | None = None
    """Why it cannot apply to this model, when it cannot (it is then not traced)."""


def model_facts(workload, options=None) -> ModelFacts:
    """The facts the rules read, from ``workload``'s model built on the meta device (no memory)."""
    import torch

    from batchfit.distributed.pipeline import pipeline_layers
    from batchfit.distributed.pipeline_hf import hf_layers
    from batchfit.distributed.tp_plans import no_plan_reason, sequence_parallel, tp_plan

    try:
        with torch.device("meta"):
            model = workload.build_model()
    except Exception as error:  # a model that cannot be built without memory: the tracer decides TP
        return ModelFacts(name=workload.name, tp_plan=True, unread=f"{type(error).__name__}: {error}"[:200],
                          loss=getattr(options, "loss", "plain") or "plain", seq_len=workload.tokens_per_sample)
    n_layers = pipeline_layers(model)
    pp_tp_split_backward = hf_layers(model) is None or not sequence_parallel(model)
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    heads = getattr(cfg, "n_heads", None) or getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "n_kv_heads", None) or getattr(cfg, "num_key_value_heads", None)
    experts = next((getattr(cfg, k) for k in ("n_experts", "num_experts", "num_local_experts", "n_routed_experts")
                    if isinstance(getattr(cfg, k, None), int)), None)
    has_plan = workload.parallelize is not None or tp_plan(model) is not None
    tp_missing = None if has_plan else no_plan_reason(model)
    return ModelFacts(name=workload.name, n_layers=n_layers, pp_tp_split_backward=pp_tp_split_backward,
                      heads=heads if isinstance(heads, int) else None,
                      kv_heads=kv if isinstance(kv, int) else None, tp_plan=has_plan, tp_missing=tp_missing,
                      experts=experts, loss=getattr(options, "loss", "plain") or "plain",
                      seq_len=workload.tokens_per_sample)
