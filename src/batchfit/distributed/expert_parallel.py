"""Expert parallelism (``ep<N>+fsdp``): each rank keeps experts / N of every MoE layer, and tokens
travel to their experts' rank and back by all-to-all, as torchtitan does it.

torchtitan (``torchtitan/distributed/expert_parallel.py: ExpertParallel``, applied in
``models/*/infra/parallelize.py: apply_moe_ep_tp``, the experts FSDP-sharded in ``apply_fsdp`` over
``dp_shard_mod_ep``) shards the stacked expert weights on dim 0 over the ep mesh, and wraps the
experts' forward in a dispatch and a combine:

1. each rank counts its routed tokens per (global) expert and swaps the counts with an
   all-to-all (``num_tokens_per_expert_group``), whose sums are the all-to-all's splits;
2. ``all_to_all_single_autograd`` sends each (token, expert) row to its expert's rank: the
   dispatch buffer, rows by source rank then local expert;
3. the rows are permuted local-expert-major (``models/common/moe/utils.py: _permute``, no padding
   in bf16) and the local experts run as one
   grouped GEMM per projection (``torch._grouped_mm`` with the per-expert offsets);
4. the rows are put back in arrival order (``_unpermute``) and a second all-to-all returns them
   to their tokens' rank (the combine buffer), where they are weighted and summed per token.

:class:`ExpertParallelExperts` is that, around the weights of an HF experts module
(``@use_experts_implementation``: Qwen3-MoE, Mixtral, DeepSeek-V3's stacked ``gate_up_proj`` /
``down_proj``), the rank's slice of them only. The same module runs on real tensors (a gloo run,
the router's real counts read with ``tolist()``, as torchtitan does) and on fake ones (``plan``: the
fake process group answers every collective at once). Fake tensors have no counts: there each
source rank routes its tokens by the stated ``--routing`` (``trace/routing.py: tokens_per_expert``,
every rank alike), so the traced rank (rank 0, experts 0 .. E/N-1) receives N x what one rank
routes to those experts: under ``worst`` every token's top_k experts are rank 0's, the bound.

With tensor parallelism (``ep<N>+fsdp+tp<M>``, torchtitan's default ``expert_tensor_parallel_degree = 1``)
the ep ranks include the tp ranks (``distributed/strategy.py: _ep_tp_meshes``), the MoE block's input is
all-gathered over tp (``distributed/tp_plans_moe.py``), and each tp rank dispatches only its contiguous
1/tp of the block's tokens (``token_mesh``: torchtitan's ``ReordererSequenceParallel``), filling those rows
of the block's output; the tp ranks' outputs are summed by the block's reduce-scatter.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from batchfit.errors import OptionError
from batchfit.options import Routing

LAYOUT = ("torchtitan's etp=1 layout: ep<N> borrows the dp x tp ranks (the sparse mesh (efsdp, ep), ep "
          "innermost), each tp rank dispatching 1/tp of its MoE block's all-gathered tokens "
          "(ReordererSequenceParallel); attention, norms, shared experts, embedding and head tensor-parallel; "
          "the router replicated; the experts FSDP-sharded over the dp x tp / ep ranks holding the same ones")
"""The layout in words, for every output of a plan with ep<N> and tp<M> (``expert_parallel.ep_approximations``)."""


def _experts_modules(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, experts module) of every HF MoE layer's experts in ``model``."""
    from batchfit.trace.routing import moe_experts

    found = []
    names = dict(model.named_modules())
    for name, module in moe_experts(model):
        parent_name, _, attr = name.rpartition(".")
        found.append((names[parent_name] if parent_name else model, attr, module))
    return found


def apply_expert_parallel(model: nn.Module, ep_mesh, *, routing: Routing = Routing("balanced"), name: str = "ep",
                          token_mesh=None) -> nn.Module:
    """Every HF experts module of ``model`` replaced by an :class:`ExpertParallelExperts` holding this
    rank's experts / ep experts (in place); ``token_mesh`` (the tp mesh under ep<N>+...+tp<M>): each of
    its ranks dispatches its 1/tp of the tokens (torchtitan's ``ReordererSequenceParallel``). One-line
    errors for a model without experts, and for an expert count the ep degree does not divide."""
    ep = ep_mesh.size()
    found = _experts_modules(model)
    if not found:
        raise OptionError(f"{name}: {type(model).__name__} has no mixture-of-experts layers to shard "
                          "(ep<N> is for MoE models such as hf:qwen3-moe-30b-a3b): drop ep<N>, e.g. fsdp")
    for parent, attr, experts in found:
        if experts.num_experts % ep:
            good = [d for d in range(2, experts.num_experts + 1) if experts.num_experts % d == 0]
            raise OptionError(f"{name}: {experts.num_experts} experts per layer do not split over ep{ep}: use "
                              f"ep<N> with N dividing {experts.num_experts} (e.g. {', '.join(map(str, good[:6]))})")
        setattr(parent, attr, ExpertParallelExperts(experts, ep_mesh, routing=routing, token_mesh=token_mesh))
    return model


def shard_experts(model: nn.Module, mesh, **fsdp_kwargs) -> None:
    """FSDP2 on each :class:`ExpertParallelExperts` over ``mesh`` (dp / ep ranks holding the same
    experts), before the blocks are sharded over all dp ranks (their FSDP groups then leave the
    experts out), as torchtitan's ``apply_fsdp`` does with ``dp_shard_mod_ep``: on dim 1 when that
    mesh has more ranks than local experts (its ``shard_placement_fn``), else on dim 0."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    def placement(param):
        return Shard(1) if mesh.size() > param.shape[0] else Shard(0)

    for module in model.modules():
        if isinstance(module, ExpertParallelExperts):
            fully_shard(module, mesh=mesh, shard_placement_fn=placement, **fsdp_kwargs)


def experts_elsewhere(model: nn.Module) -> int:
    """Expert parameters the other ranks of this rank's ep group hold (the model's total less this rank's)."""
    return sum((m.ep - 1) * (m.gate_up_proj.numel() + m.down_proj.numel())
               for m in model.modules() if isinstance(m, ExpertParallelExperts))


def dispatch_label(call, strategy, meshes) -> tuple[str, int] | None:
    """Under ep<N> every all-to-all is expert parallelism's dispatch or combine (no other parallelism calls
    one): ``Collective.group`` "ep", ep ranks; None for any other collective."""
    return ("ep", strategy.ep) if call.op == "all_to_all" else None


def ep_approximations(strategies, routing: str) -> list:
    """What an ep<N> trace runs differently from a GPU, for every output (empty without ep)."""
    from batchfit.trace.approximation import Approximation

    names = sorted({s.name for s in strategies if getattr(s, "ep", 1) > 1})
    if not names:
        return []
    with_tp = sorted({s.name for s in strategies if getattr(s, "ep", 1) > 1 and s.tp > 1})
    layout = [] if not with_tp else [Approximation(
        what=f"expert parallelism with tensor parallelism ({', '.join(with_tp)}): {LAYOUT}",
        may_differ_by="nothing for the layout traced (torchtitan 0.2.2's default, expert_tensor_parallel_degree "
                      "1); with expert_tensor_parallel_degree = tp (not traced) the experts' matrices would be "
                      "TP-sharded too, ep would borrow only dp ranks, and each rank would dispatch all of its tokens",
        source="docs/tracing/experts.md, Expert parallelism with tensor parallelism",
        detail="the MoE block's input is all-gathered over tp (every tp rank holds the block's B x S tokens), each "
               "tp rank dispatches its contiguous 1/tp of them (ReordererSequenceParallel), the block's output is "
               "reduce-scattered onto the sequence shards; needs B x S divisible by tp")]
    return layout + [Approximation(
        what=f"expert parallelism ({', '.join(names)}): rank 0 traced, every rank routing its tokens by "
             f"--routing {routing}; rank 0 holds experts 0 .. E/ep-1",
        may_differ_by="the dispatch and combine buffers and the grouped GEMM's rows of rank 0 follow the stated "
                      "routing (worst: every token's experts are rank 0's, the bound); a real router's imbalance "
                      "between ranks moves rows (hidden x dtype bytes each, a few tensors per MoE layer) to "
                      "whichever rank is hottest: take the most of --routing balanced and worst",
        source="docs/tracing/experts.md, Expert parallelism",
        detail="torchtitan's dispatch (ExpertParallel: all-to-all, _permute local-expert-major, torch._grouped_mm, "
               "_unpermute, all-to-all) around HF's stacked expert weights, the routing weights applied after the "
               "combine (HF's order); torchtitan's float8 / MXFP8 paths pad each expert's rows to 16 / 32 (not "
               "traced: at most local experts x 32 rows more)")]


def _local_slice(param: torch.Tensor, lo: int, hi: int) -> nn.Parameter:
    with torch.no_grad():
        return nn.Parameter(param.detach()[lo:hi].clone(), requires_grad=param.requires_grad)


class ExpertParallelExperts(nn.Module):
    """One rank's experts of an HF MoE layer under ep<N>: its ``num_experts / N`` slice of the stacked
    weights, and torchtitan's dispatch / combine around them (the module docstring)."""

    def __init__(self, experts: nn.Module, ep_mesh, *, routing: Routing = Routing("balanced"),
                 token_mesh=None) -> None:
        super().__init__()
        if (not getattr(experts, "has_gate", True) or getattr(experts, "has_bias", False)
                or getattr(experts, "has_post_expert_norm", False)
                or not getattr(experts, "is_concatenated", True) or not hasattr(experts, "gate_up_proj")):
            raise OptionError(f"ep<N>: {type(experts).__name__} (biases, no gate, an interleaved gate_up or a "
                              "post-expert norm) is not traced under expert parallelism yet: the stacked "
                              "gate_up_proj / down_proj experts are (Qwen3-MoE, Mixtral, DeepSeek-V3); drop ep<N>")
        self.ep = ep_mesh.size()
        self.group = ep_mesh.get_group()
        self.rank = ep_mesh.get_local_rank()
        self.num_experts = experts.num_experts
        """All experts of the layer (the router's choices); this rank holds ``local_experts``."""
        self.local_experts = experts.num_experts // self.ep
        self.routing = routing
        self.token_split = (token_mesh.get_local_rank(), token_mesh.size()) if token_mesh is not None else (0, 1)
        """(this rank's index, ranks) of the token split: under TP every tensor-parallel rank holds all the
        tokens of its group (the MoE block's input is all-gathered) and dispatches only its 1/tp of them
        (torchtitan's ReordererSequenceParallel, etp=1); (0, 1) without TP."""
        self.is_transposed = bool(getattr(experts, "is_transposed", False))
        self.act_fn = experts.act_fn
        self._apply_gate_of = type(experts)._apply_gate if hasattr(type(experts), "_apply_gate") else None
        lo, hi = self.rank * self.local_experts, (self.rank + 1) * self.local_experts
        self.gate_up_proj = _local_slice(experts.gate_up_proj, lo, hi)
        self.down_proj = _local_slice(experts.down_proj, lo, hi)

    def extra_repr(self) -> str:
        split = f", tokens {self.token_split[0] + 1} of {self.token_split[1]}" if self.token_split[1] > 1 else ""
        return f"experts {self.local_experts} of {self.num_experts} (ep{self.ep} rank {self.rank}{split})"

    def _my_tokens(self, hidden_states, top_k_index, top_k_weights):
        """(first row, hidden_states, top_k_index, top_k_weights) of this rank's share of the tokens: all
        of them without TP; under TP the rank's contiguous 1/tp of the flattened batch x sequence rows,
        views, as torchtitan's ``ReordererSequenceParallel._split_along_first_dim`` takes them."""
        index, ranks = self.token_split
        if ranks == 1:
            return 0, hidden_states, top_k_index, top_k_weights
        tokens = hidden_states.shape[0]
        if tokens % ranks:
            raise OptionError(f"ep<N> with tp{ranks}: {tokens} tokens (batch x sequence) do not split over the "
                              f"{ranks} tensor-parallel ranks (torchtitan's ReordererSequenceParallel needs them to): "
                              f"use a sequence length that divides by {ranks}")
        n = tokens // ranks
        lo = index * n
        return lo, hidden_states[lo:lo + n], top_k_index[lo:lo + n], top_k_weights[lo:lo + n]

    def _splits(self, counts: torch.Tensor, received: torch.Tensor, tokens: int, top_k: int
                ) -> tuple[list[int], list[list[int]]]:
        """(rows this rank sends to each expert, rows each source rank sends to each local expert)."""
        from torch._subclasses.fake_tensor import is_fake

        from batchfit.trace.routing import tokens_per_expert

        if is_fake(counts):  # no values: every rank routes its tokens by the stated routing
            sent = tokens_per_expert(self.routing, tokens, top_k, self.num_experts)
            lo = self.rank * self.local_experts
            return sent, [sent[lo:lo + self.local_experts] for _ in range(self.ep)]
        table = received.view(self.ep, self.local_experts).tolist()  # a device-to-host sync, as torchtitan's
        return counts.tolist(), table

    def _grouped(self, rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """One grouped GEMM over the local experts: ``torch._grouped_mm`` in bf16 (torchtitan's
        ``_run_experts_grouped_mm``; its kernels, and its fake kernel, take bf16 only), else HF's
        fallback op (``transformers/integrations/moe.py: _grouped_mm_fallback``: one output, each
        expert's mm written into its rows; the same tensors, forward and backward)."""
        weight = weight if self.is_transposed else weight.transpose(-2, -1)
        rows = rows.to(weight.dtype)
        if weight.dtype == torch.bfloat16:
            return torch._grouped_mm(rows, weight, offs=offsets)
        try:  # registers torch.ops.transformers.grouped_mm_fallback
            import transformers.integrations.moe  # noqa: F401
        except ImportError as error:
            raise OptionError("ep<N> outside bf16 runs HF's grouped-mm fallback: pip install 'batchfit[hf]'") from error

        return torch.ops.transformers.grouped_mm_fallback(rows, weight, offsets)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd

        everyone = hidden_states  # the output covers every token of the block; this rank fills its share
        first, hidden_states, top_k_index, top_k_weights = self._my_tokens(hidden_states, top_k_index, top_k_weights)
        tokens, top_k = top_k_index.shape[0], top_k_index.shape[-1]
        experts, local = self.num_experts, self.local_experts
        with torch.no_grad():
            expert_ids = top_k_index.reshape(-1)
            _, order = torch.sort(expert_ids, stable=True)  # rows by destination expert, so by rank
            # histc, as HF's grouped_mm_experts_forward counts (bincount's size depends on values)
            counts = torch.histc(expert_ids.float(), bins=experts, min=0, max=experts - 1).long()
            received = torch.ops._c10d_functional.wait_tensor(all_to_all_single(counts, None, None, self.group))
            sent, table = self._splits(counts, received, tokens, top_k)
        input_splits = [sum(sent[r * local:(r + 1) * local]) for r in range(self.ep)]
        output_splits = [sum(row) for row in table]
        rows_out = sum(input_splits)  # tokens x top_k, less what a capacity routing dropped
        with torch.no_grad():
            order = order[:rows_out]
            token_of_row = order // top_k
        routed = hidden_states[token_of_row]
        dispatched = all_to_all_single_autograd(routed, output_splits, input_splits, self.group)
        # arrival order: by source rank, then local expert; the grouped GEMM wants local-expert-major
        # (torchtitan's _permute): segment (r, e) starts at ``starts`` in the arrival order
        starts = [0, *itertools.accumulate(n for row in table for n in row)]
        segments = [(starts[r * local + e], table[r][e]) for e in range(local) for r in range(self.ep)]
        per_expert = [sum(table[r][e] for r in range(self.ep)) for e in range(local)]
        device = hidden_states.device
        with torch.no_grad():  # index tensors made with shapes known from the splits (no values read)
            lengths = torch.tensor([n for _, n in segments], dtype=torch.long, device=device)
            shift = (torch.tensor([a for a, _ in segments], dtype=torch.long, device=device)
                     - (lengths.cumsum(0) - lengths))
            permuted_indices = torch.repeat_interleave(shift, lengths, output_size=sum(per_expert))
            permuted_indices += torch.arange(sum(per_expert), device=device)
            # int32, as _grouped_mm takes them; past 2**31 rows per expert (a plan's search probing an
            # absurd batch on fake tensors, whose values nobody reads) the count is capped, not the shapes
            offsets = torch.tensor([min(n, 2**31 - 1) for n in per_expert], dtype=torch.int32,
                                   device=device).cumsum(0, dtype=torch.int32)
        rows = dispatched[permuted_indices]
        gate_up = self._grouped(rows, self.gate_up_proj, offsets)
        if self._apply_gate_of is not None:
            hidden = self._apply_gate_of(self, gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = self.act_fn(gate) * up
        out = self._grouped(hidden, self.down_proj, offsets)
        unpermuted = out.new_empty(out.shape)
        unpermuted[permuted_indices] = out  # _unpermute: back to arrival order
        combined = all_to_all_single_autograd(unpermuted, input_splits, output_splits, self.group)
        weights = top_k_weights.reshape(-1)[order].unsqueeze(-1)
        # Under TP the other ranks' tokens stay zero here: the block's output is a partial sum over the tp
        # ranks, reduce-scattered onto the sequence shards (the MoE TP plan, distributed/tp_plans_moe.py)
        final = torch.zeros_like(everyone)
        final.index_add_(0, token_of_row + first if first else token_of_row, (combined * weights).to(final.dtype))
        return final
