"""Mixture-of-experts layers on fake tensors: how many tokens each expert sees, by a stated routing.

A router picks each token's top-k experts by the values of its logits, and fake tensors have
none: the expert loop of HF's MoE layers (``transformers/models/qwen3_moe/modeling_qwen3_moe.py:
Qwen3MoeExperts.forward``, the same in Mixtral, DeepSeek-V3 and gpt-oss: the "eager" experts
implementation) asks ``nonzero()`` for the experts hit and ``torch.where(expert_mask[e])`` for each
expert's tokens, whose sizes are those values. Here those reads are answered by the routing the
user states (``--routing``), so each expert runs on the number of tokens that routing gives it:

- ``balanced``: tokens x top_k / experts each (the remainder one more to the first experts);
- ``capacity:F``: as uneven as a capacity of ceil(F x tokens x top_k / experts) per expert allows
  (experts filled to capacity in turn, at most every token each; routed tokens beyond the
  capacity of all experts dropped, as capacity-factor routers do);
- ``worst``: every token to the same top_k experts (the bound).

HF's grouped-GEMM implementation (``transformers/integrations/moe.py: grouped_mm_experts_forward``,
HF's default where ``grouped_mm`` runs) allocates tokens x top_k rows whatever the routing: it
reads no values and traces as it is; the routing then decides nothing on one GPU, and is still
named in every output (with expert parallelism it would decide how many tokens each rank gets).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from batchfit.options import Routing
from batchfit.trace.approximation import Approximation


def tokens_per_expert(routing: Routing, tokens: int, top_k: int, experts: int) -> list[int]:
    """How many tokens each expert gets under ``routing`` (``options.ROUTINGS``'s grammar)."""
    routed = tokens * top_k
    if routing.kind == "balanced":
        base, extra = divmod(routed, experts)
        return [base + (e < extra) for e in range(experts)]
    if routing.kind == "worst":
        return [tokens if e < top_k else 0 for e in range(experts)]
    factor = routing.capacity_factor or 1.0
    capacity = min(math.ceil(factor * routed / experts), tokens)
    counts, left = [], routed
    for _ in range(experts):
        counts.append(min(capacity, left))
        left -= counts[-1]
    return counts


def routing_line(routing: Routing) -> str:
    """The routing in words, for every output."""
    if routing.kind == "balanced":
        return "balanced (each expert gets tokens x top_k / experts)"
    if routing.kind == "worst":
        return "worst (every token to the same top_k experts: the bound)"
    factor = f"{routing.capacity_factor:g}"
    return (f"capacity:{factor} (experts filled to a capacity of ceil({factor} x tokens x top_k / experts) "
            "in turn, tokens beyond it dropped)")


def moe_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The expert modules of HF's MoE layers (``@use_experts_implementation``): an int
    ``num_experts`` and their weights stacked in 3-D parameters, one slice per expert."""
    found = []
    for name, module in model.named_modules():
        experts = getattr(module, "num_experts", None)
        if isinstance(experts, int) and any(p.dim() == 3 and p.shape[0] == experts
                                            for p in module.parameters(recurse=False)):
            found.append((name, module))
    return found


def routing_approximation(model: nn.Module, routing: Routing) -> list[Approximation]:
    """The routing a trace of an MoE model assumed, said on every output (empty for a dense model)."""
    experts = moe_experts(model)
    if not experts:
        return []
    impls = sorted({str(getattr(getattr(m, "config", None), "_experts_implementation", None) or "eager")
                    for _, m in experts})
    note = ("; grouped_mm allocates tokens x top_k rows whatever the routing"
            if "grouped_mm" in impls else "")
    return [Approximation(
        what=f"MoE routing assumed: {routing_line(routing)}",
        may_differ_by="what a real router's routing moves between experts: the rows add up to tokens x "
                      "top_k under any routing, but HF's expert loop holds one weight-sized gradient per expert "
                      "hit (a tiny Qwen3-MoE: balanced +6.7% over worst, a random router between them): take "
                      "the most of --routing balanced and worst",
        source="docs/tracing/experts.md, Mixture of experts: routing and expert parallelism",
        detail=f"{len(experts)} MoE layers, experts implementation {'/'.join(impls)}{note}")]


@dataclass
class _Frame:
    """One call of an experts module: the experts its routing hits, with their token counts."""

    hit: list[int]
    counts: list[int]
    experts: int
    current: int = -1
    """Where the loop is in ``hit``: each iteration begins by comparing its expert with the
    sentinel (``if expert_idx == self.num_experts``), a bool read."""


class RoutedExperts(TorchDispatchMode):
    """Answers the value reads of HF's expert loop by the routing, inside the experts' forward only.

    Pushed above the fake mode (``TraceSession.tracing``); hooks on the experts modules open a
    frame for each call (the checkpointed recomputation calls them again, and is answered again)."""

    def __init__(self, model: nn.Module, routing: Routing) -> None:
        super().__init__()
        self.routing = routing
        self._local = threading.local()
        self.handles = []
        self.expert_shapes = {(tuple(p.shape), p.dtype) for _, m in moe_experts(model)
                              for p in m.parameters(recurse=False) if p.dim() > 1 and p.shape[0] == m.num_experts}
        """The stacked expert weights' (and biases') shapes: each expert's slice sends its gradient back
        through ``select_backward``, a whole-weight-sized tensor, summed by the autograd engine."""
        for _, module in moe_experts(model):
            self.handles.append(module.register_forward_pre_hook(self._enter, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._exit, always_call=True))

    def _frames(self) -> list[_Frame]:
        if not hasattr(self._local, "frames"):
            self._local.frames = []
        return self._local.frames

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        index = args[1] if len(args) > 1 else kwargs.get("top_k_index", kwargs.get("router_indices"))
        if hidden is None or index is None:
            self._frames().append(_Frame([], [], module.num_experts))
            return
        counts = tokens_per_expert(self.routing, int(hidden.shape[0]), int(index.shape[-1]), module.num_experts)
        self._frames().append(_Frame([e for e, n in enumerate(counts) if n], counts, module.num_experts))

    def _exit(self, module: nn.Module, args: tuple, output) -> None:
        if self._frames():
            self._frames().pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is torch.ops.aten.add.Tensor and torch._C._current_graph_task_id() != -1  # in backward
                and not torch.is_grad_enabled() and len(args) == 2 and not kwargs
                and all(isinstance(a, torch.Tensor) and (tuple(a.shape), a.dtype) in self.expert_shapes
                        and a._base is None for a in args)):
            # The autograd engine sums the experts' gradients of one stacked weight in place on a
            # real tensor (torch/csrc/autograd/input_buffer.cpp: can_accumulate_inplace, the buffer
            # holding the only reference), out of place on a tensor subclass such as a fake one:
            # one weight-sized buffer more per sum, which a GPU never holds.
            return args[0].add_(args[1])
        frames = self._frames()
        if not (frames and frames[-1].counts):
            return func(*args, **kwargs)
        frame = frames[-1]
        if func is torch.ops.aten.nonzero.default:
            mask = args[0]  # the one-hot expert mask is int64; the hit test's is bool
            if mask.dim() == 1 and mask.numel() in (frame.experts, frame.experts + 1):
                rows = len(frame.hit)  # expert_hit = torch.greater(expert_mask.sum(...), 0).nonzero()
            elif mask.dim() == 2 and 0 <= frame.current < len(frame.hit):
                rows = frame.counts[frame.hit[frame.current]]  # torch.where(expert_mask[expert_idx])
            else:
                return func(*args, **kwargs)
            return torch.empty((rows, mask.dim()), dtype=torch.long, device=mask.device)
        if func is torch.ops.aten._local_scalar_dense.default:
            if args[0].dtype == torch.bool:  # `if expert_idx == self.num_experts`, once per expert hit
                frame.current += 1
                return False  # the hit list holds no sentinel
            if not args[0].is_floating_point() and 0 <= frame.current < len(frame.hit):
                return frame.hit[frame.current]  # expert_mask[expert_idx], gate_up_proj[expert_idx], ...
        return func(*args, **kwargs)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def workload_routing_approximation(workload, options, *, expert_parallel: bool = False) -> list[Approximation]:
    """:func:`routing_approximation` of the model ``workload`` builds, built on the meta device (no
    memory), for an engine that does not hold the traced model itself (``plan``). ``expert_parallel``:
    every strategy is ep<N>, whose experts run as one grouped GEMM (``distributed/expert_parallel.py``),
    not HF's loop: the line says so."""
    with torch.device("meta"):
        model = workload.build_model()
    found = routing_approximation(model, options.routing_spec)
    if expert_parallel and found:
        (line,) = found
        found = [dataclasses.replace(
            line, may_differ_by="what a real router's routing moves between experts and ranks (see the expert "
                                "parallelism line): take the most of --routing balanced and worst",
            detail=line.detail.split(", experts implementation")[0] + ", experts run by ep<N>'s grouped GEMM")]
    return found
