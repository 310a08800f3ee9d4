"""Activation checkpointing policies for the model's main stack of blocks (``--checkpointing``).

``full`` recomputes every block in backward; ``every:N`` recomputes every N-th block and keeps
the others' activations; ``selective`` wraps every block but keeps the outputs of the ops that
are expensive to recompute (matmuls, attention), torchtitan's per-op policy. All three wrap a
block's forward in ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``; ``selective``
adds a ``context_fn`` built by ``create_selective_checkpoint_contexts``, exactly as a user's
own SAC policy would, so the tracer sees both the same way: the policy runs as a dispatch
mode inside the tracker's, and what it saves stays alive as the tensors it keeps.

Mirrored from torchtitan (github.com/pytorch/torchtitan):

- ``every:N`` is its layer-frequency AC (``_apply_layer_sac`` in
  torchtitan/distributed/activation_checkpoint.py up to commit 1f029641, removed from later
  versions): a counter incremented before the test, so the block at index ``i`` is
  checkpointed when ``(i + 1) % N == 0`` (every:2 on 4 blocks: blocks 1 and 3).
- ``selective`` is ``SelectiveAC`` in torchtitan/distributed/activation_checkpoint.py
  (commit b5bcd76c, August 2026): save the ops of ``_get_default_save_ops`` (the partitioner's
  compute-intensive ops, SDPA kernels, ``max``, flex attention, ``linear``, ``topk``, reduce-
  scatter and all-to-all), except every second ``mm``/``linear`` of a block (its
  ``forward_mm_count``), and recompute all else. Earlier torchtitan (the per-model
  ``_op_sac_save_list`` of torchtitan/models/llama3/infra/parallelize.py, up to 1f029641) saved
  the same ops without ``addmm``/``bmm``/convolution, which Llama (no biases) never runs.

Two additions: PyTorch's CPU flash-attention op, which a real CPU step runs, and the op the
tracer runs where CUDA runs its memory-efficient kernel (``batchfit::cuda_efficient_attention``
in ``trace/cuda_attention.py``: the aten op without its host-side seed and offset). Without them
the trace would recompute the attention that a GPU keeps. A user's own policy that names
``aten._scaled_dot_product_efficient_attention`` does not see the tracer's op (a known limit,
docs/tracing/checkpointing.md): on fp32 or masked attention it is traced as recomputed.

A third, over transformers' MoE layers (``selective_context_fn``): the router's logits are kept
and ``topk`` recomputed from them, the same routing, since HF's routers divide topk's output in
place, which a cached tensor must not see.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from batchfit.options import Checkpointing

FORCE_RECOMPUTE_MM_FQNS: tuple[str, ...] = ("moe.router.gate",)
"""torchtitan's ``force_recompute_mm_shapes_by_fqns`` default: an mm with the RHS shape of
these Linear layers is always recomputed (and not counted)."""


def checkpointed_blocks(policy: Checkpointing, blocks: int) -> list[int]:
    """The indices of the blocks that ``policy`` wraps in a checkpoint."""
    if policy.kind in ("full", "selective"):
        return list(range(blocks))
    every = policy.every or 1
    # torchtitan's _apply_layer_sac: `_layer_sac_count += 1; if _layer_sac_count % ac_freq == 0`.
    return [i for i in range(blocks) if (i + 1) % every == 0]


def _resolve(root: object, path: str) -> object | None:
    """``root.a.b.c``, or None where the op is not registered (an optional backend)."""
    for part in path.split("."):
        root = getattr(root, part, None)
        if root is None:
            return None
    return root


SAVE_OPS: tuple[tuple[object, str], ...] = (
    (torch.ops.aten, "_scaled_dot_product_cudnn_attention.default"),
    (torch.ops.aten, "_scaled_dot_product_attention_math.default"),
    (torch.ops.aten, "_scaled_dot_product_fused_attention_overrideable.default"),
    (torch.ops.aten, "_scaled_dot_product_flash_attention.default"),  # also in compute_intensive_ops
    (torch.ops.aten, "_scaled_dot_product_efficient_attention.default"),  # also in compute_intensive_ops
    (torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu.default"),  # batchfit's addition (see above)
    (torch.ops, "batchfit.cuda_efficient_attention.default"),  # the tracer's memory-efficient kernel (see above)
    (torch.ops.aten, "max.default"),  # low-precision training's amax
    (torch._higher_order_ops, "flex_attention"),
    (torch.ops.aten, "linear.default"),
    (torch.ops.aten, "topk.default"),  # MoE routing stays the same in recomputation
    (torch._higher_order_ops, "inductor_compiled_code"),
    (torch.ops, "torch_attn._varlen_attn.default"),
    (torch.ops, "_c10d_functional.reduce_scatter_tensor.default"),
    (torch.ops, "_c10d_functional.all_to_all_single.default"),
    (torch.ops, "deepep.dispatch.default"), (torch.ops, "deepep.combine.default"),
    (torch.ops, "hybridep.dispatch.default"), (torch.ops, "hybridep.combine.default"),
)
"""torchtitan's compute and communication ops beyond the partitioner's list, by path: each is
kept where the installed torch (and its optional backends) registers it, skipped elsewhere."""


def save_ops() -> set:
    """The ops whose outputs ``selective`` keeps: torchtitan's ``_get_default_save_ops``
    plus the CPU flash-attention kernel."""
    from torch._functorch.partitioners import get_default_op_list

    ops = {op.default for op in get_default_op_list().compute_intensive_ops}  # mm, addmm, bmm, SDPA, ...
    for root, path in SAVE_OPS:
        try:
            op = _resolve(root, path)
        except (AttributeError, RuntimeError):  # torch.ops raises for an unknown namespace's op
            op = None
        if op is not None:
            ops.add(op)
    return ops


def _force_recompute_shapes(block: nn.Module, base_fqn: str) -> set[torch.Size]:
    """The (in, out) shapes of the block's Linear layers named in FORCE_RECOMPUTE_MM_FQNS."""
    shapes = set()
    for name, module in block.named_modules():
        fqn = f"{base_fqn}.{name}" if name else base_fqn
        if isinstance(module, nn.Linear) and any(f in fqn for f in FORCE_RECOMPUTE_MM_FQNS):
            out_features, in_features = module.weight.shape
            shapes.add(torch.Size((in_features, out_features)))
    return shapes


def _hf_router_shapes(block: nn.Module, base_fqn: str) -> set[torch.Size]:
    """The mm RHS shapes (hidden, experts) of the routers of transformers' MoE layers in ``block``:
    a 2-D ``weight`` of [experts, hidden] beside an experts module (an int ``num_experts`` and its
    weights stacked in 3-D parameters, ``trace/routing.py: moe_experts``). torchtitan's own router
    (FORCE_RECOMPUTE_MM_FQNS) is not one: it keeps torchtitan's rule."""
    experts = set()
    for module in block.modules():
        count = getattr(module, "num_experts", None)
        if isinstance(count, int) and any(p.dim() == 3 and p.shape[0] == count
                                          for p in module.parameters(recurse=False)):
            experts.add(count)
    shapes = set()
    for name, module in block.named_modules():
        fqn = f"{base_fqn}.{name}" if name else base_fqn
        weight = getattr(module, "weight", None)
        if (isinstance(weight, nn.Parameter) and weight.dim() == 2 and weight.shape[0] in experts
                and not any(f in fqn for f in FORCE_RECOMPUTE_MM_FQNS)):
            shapes.add(torch.Size((weight.shape[1], weight.shape[0])))
    return shapes


def selective_context_fn(block: nn.Module, base_fqn: str = "") -> Callable[[], tuple]:
    """The ``context_fn`` of torchtitan's ``SelectiveAC`` for one block: a fresh mm counter
    for each run of the block (forward and recomputation counted apart).

    Over a transformers MoE layer, the routing is kept by saving the router's logits (its mm,
    not counted as one of the block's) and recomputing ``topk`` from them, the same routing:
    torchtitan keeps ``topk``'s output, which HF's routers then normalize in place
    (``router_top_value /= ...``: Mixtral, Qwen3-MoE with norm_topk_prob), and a tensor that
    selective checkpointing cached must not change ("Tensor cached during selective activation
    checkpoint has been mutated", on a GPU as on fake tensors)."""
    saved = save_ops()
    recompute_shapes = _force_recompute_shapes(block, base_fqn)
    router_shapes = _hf_router_shapes(block, base_fqn)
    aten = torch.ops.aten
    mm_ops = (aten.mm.default, aten.linear.default)

    def context_fn() -> tuple:
        count = {"forward": 0, "recompute": 0}

        def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
            if (func == aten._to_copy.default and "cuda" in str(args[0].device)
                    and str(kwargs.get("device")) == "cpu"):
                return CheckpointPolicy.MUST_SAVE  # a device-to-host copy is never redone
            mode = "recompute" if ctx.is_recompute else "forward"
            if func in mm_ops:
                shape = args[1].shape
                if func == aten.linear.default:  # the weight is (out, in); mm's RHS is (in, out)
                    shape = torch.Size((shape[1], shape[0]))
                if shape in recompute_shapes:
                    return CheckpointPolicy.PREFER_RECOMPUTE
                if shape in router_shapes:
                    return CheckpointPolicy.MUST_SAVE  # the routing, recomputed from these logits
                count[mode] += 1
            if func == aten.topk.default and router_shapes:
                return CheckpointPolicy.PREFER_RECOMPUTE  # HF's router mutates its output (see above)
            if func in saved:
                if func in mm_ops and count[mode] % 2 == 0:
                    return CheckpointPolicy.PREFER_RECOMPUTE  # every second mm
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context_fn
