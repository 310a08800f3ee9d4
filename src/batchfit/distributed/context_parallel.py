"""Context parallelism (cp<N>) with torch's own ring attention: one rank's step on sequence/N.

torch's ``context_parallel`` (``torch/distributed/tensor/experimental/_context_parallel/_attention.py``)
does two things, and a rank of a cp<N> run here does both with torch's own functions:

1. **Shard the sequence** (``_context_parallel_buffers``, what ``context_parallel(buffers=...)``
   and torchtitan's ``prepare_context_parallel_input`` call): the batch's tokens and labels (seq
   dim 1) and the model's position tables (RoPE's cos / sin, seq dim 0), each rearranged by the
   head-tail load balancer (``_load_balancer.py: _HeadTailLoadBalancer``: rank r keeps chunks r
   and 2N-1-r of 2N, so every rank has the same causal work; it needs the sequence to divide by
   2N) and cut to the rank's S/N (``distribute_tensor(..., Shard(seq_dim)).to_local()``).
2. **Ring attention** (``_enable_context_parallel_dispatcher_impl``): ``F.scaled_dot_product_attention``
   is monkey-patched to wrap q, k, v as DTensors sharded on the sequence, and DTensor's dispatcher
   sends the CUDA attention ops (``_scaled_dot_product_flash_attention``, ``_efficient_attention``,
   ``_cudnn_attention`` and their backwards) to ``_templated_ring_attention`` /
   ``_templated_ring_attention_backward``. Their buffers are torch's, made on the rank's tensors:

   - forward, per attention call: ``torch.cat([key.flatten(), value.flatten()])`` (2 x b x kv heads
     x S/N x d), all-gathered once over the cp group (``_AllGatherRotater``, torch's default
     rotate method: the whole K/V, N times that, alive through the loop), a fresh cat of the
     current K/V block at each of the N-1 steps that send; per step the attention op's output
     and logsumexp, merged into fp32 accumulators (``_SDPAMerger``: ``convert_to_f32`` upcasts
     out and lse; the merge's sigmoid / logsigmoid temporaries; ``_partial_update``'s torch.cat
     when only half of the queries attend);
   - backward: the same K/V all-gather again, fp32 gradient accumulators for q, k, v
     (``torch.zeros_like(..., dtype=float32)``), and the dK/dV of each step sent on by
     ``_AllToAllRotater`` (``permute_tensor``: one fp32 2 x b x kv heads x S/N x d buffer in
     flight per step, N steps).

On the trace, torch's ring runs as it is on the fake process group over the CUDA attention op
the trace already mirrors (``trace/cuda_attention.py`` calls ``_scaled_dot_product_flash_attention``
/ the efficient op on the DTensors; the dispatcher turns each into the ring on the local fake
tensors). A CPU run (the gloo truth, and the trace with CPU semantics that it is compared with)
reaches SDPA's CPU kernel, ``_scaled_dot_product_flash_attention_for_cpu``, which torch's table
does not name: :func:`ring_attention` with ``cpu=True`` adds it (and its backward) to the same
dispatcher table, running the same ``_templated_ring_attention`` with the CPU op.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from batchfit.errors import OptionError

ROPE_BUFFER_NAMES = ("rope_cos", "rope_sin", "freqs_cis")
"""Position tables sharded with the batch (seq dim 0): the zoo's Llama and torchtitan's freqs_cis."""


def check_sequence(seq_len: int | None, cp: int) -> None:
    """One line when ``seq_len`` cannot be cut as torch's head-tail load balancer cuts it."""
    if seq_len is None:
        raise OptionError(f"cp{cp}: context parallelism shards the sequence, and this workload has no sequence "
                          "length (tokens_per_sample): use a language model, or drop cp<N>")
    if seq_len % (2 * cp):
        good = [n for n in (2, 4, 8, 16, 32) if seq_len % (2 * n) == 0]
        raise OptionError(f"cp{cp}: the sequence length {seq_len} must divide by 2 x cp = {2 * cp} (torch's head-tail "
                          f"load balancing cuts it in 2 x cp chunks): use `seq_len` a multiple of {2 * cp}"
                          + (f", or cp<N> with N in {', '.join(map(str, good))}" if good else ""))


def _load_balancer(seq_len: int, cp: int, device):
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    return _HeadTailLoadBalancer(seq_len, cp, device)


def shard_sequence(tensors: list, seq_dims: list[int], mesh, seq_len: int) -> list:
    """Each tensor's shard of this rank, by torch's own ``_context_parallel_buffers`` (head-tail
    rearranged, then cut on ``seq_dims``), as ``context_parallel(buffers=...)`` shards them."""
    from torch.distributed.tensor.experimental._context_parallel._attention import _context_parallel_buffers

    if not tensors:
        return []
    return _context_parallel_buffers(mesh, tensors, seq_dims, _load_balancer(seq_len, mesh.size(), tensors[0].device))


def sharded_make_batch(make_batch: Callable, mesh, seq_len: int) -> Callable:
    """``make_batch`` whose tensors with ``seq_len`` positions on dim 1 (tokens, labels) come out
    as this rank's S/N: the whole batch is made (a data loader hands every cp rank the whole
    sequence, as torchtitan's does) and sharded."""

    def make(batch_size: int, device) -> Any:
        import torch
        from torch.utils._pytree import tree_flatten, tree_unflatten

        batch = make_batch(batch_size, device)
        leaves, spec = tree_flatten(batch)
        places = [i for i, t in enumerate(leaves)
                  if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == seq_len]
        shards = shard_sequence([leaves[i] for i in places], [1] * len(places), mesh, seq_len)
        for i, shard in zip(places, shards):
            leaves[i] = shard
        return tree_unflatten(leaves, spec)

    return make


def shard_position_tables(model, mesh, seq_len: int) -> int:
    """The model's position tables (``ROPE_BUFFER_NAMES``, seq dim 0) replaced by this rank's
    shards, as ``context_parallel(buffers=[..., freqs_cis])`` shards them in place; returns how
    many. The zoo's Llama cuts its tables to the input's length, so it reads the shard whole."""
    sharded = 0
    for module in model.modules():
        for name, buffer in list(module._buffers.items()):
            if name in ROPE_BUFFER_NAMES and buffer is not None and buffer.dim() >= 1 and buffer.shape[0] == seq_len:
                module._buffers[name] = shard_sequence([buffer], [0], mesh, seq_len)[0]
                sharded += 1
    return sharded


# --- the CPU flash kernel through torch's ring (the gloo truth, and its trace) ----------------

def _cpu_ring_forward(op_call, args, kwargs):
    """``_scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal, *,
    attn_mask, scale)`` on DTensors sharded on the sequence: torch's ``_templated_ring_attention``
    with the CPU op, as ``_scaled_dot_product_ring_flash_attention`` runs the CUDA one."""
    import torch
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention

    query, key, value, *rest = args
    dropout_p = rest[0] if rest else kwargs.get("dropout_p", 0.0)
    is_causal = rest[1] if len(rest) > 1 else kwargs.get("is_causal", False)
    if kwargs.get("attn_mask") is not None:
        raise NotImplementedError("context parallelism's ring takes no attention mask (torch's neither)")
    mesh = query.device_mesh
    out, lse = _templated_ring_attention(
        mesh.get_group(), 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        query.to_local(), key.to_local(), value.to_local(), is_causal=is_causal, dropout_p=dropout_p,
        scale=kwargs.get("scale"))
    return tuple(DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in (out, lse))


def _cpu_ring_backward(op_call, args, kwargs):
    """``_scaled_dot_product_flash_attention_for_cpu_backward(grad_out, query, key, value, out,
    logsumexp, dropout_p, is_causal, *, attn_mask, scale)``: ``_templated_ring_attention_backward``."""
    import torch
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _templated_ring_attention_backward,
    )

    grad_out, query, key, value, out, lse, *rest = args
    dropout_p = rest[0] if rest else kwargs.get("dropout_p", 0.0)
    is_causal = rest[1] if len(rest) > 1 else kwargs.get("is_causal", False)
    mesh = query.device_mesh
    grads = _templated_ring_attention_backward(
        mesh.get_group(), 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out=grad_out.to_local(), grad_out_name="grad_out", query=query.to_local(), key=key.to_local(),
        value=value.to_local(), out=out.to_local(), logsumexp=lse.to_local(), is_causal=is_causal,
        dropout_p=dropout_p, scale=kwargs.get("scale"))
    return tuple(DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in grads[:3])


_entered: list[object] = []
"""The meshes of the :func:`ring_attention` contexts open in this process: torch's dispatcher is
process-wide, so it is enabled by the first and disabled by the last (plan's depth sessions, 2, 3
and 4 blocks, are open together)."""


@contextlib.contextmanager
def ring_attention(mesh, *, cpu: bool = False) -> Iterator[None]:
    """torch's context-parallel dispatcher while entered: SDPA monkey-patched, the attention ops
    sent to the ring, load balancing on (the batch and position tables come head-tail sharded
    from :func:`sharded_make_batch` / :func:`shard_position_tables`), torch's default rotate
    method (all-gather of K/V in forward, all-to-all of dK/dV in backward). ``cpu=True`` also sends
    the CPU flash kernel (and its backward) through the same ring."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    from batchfit.distributed.written_ring import written

    if _entered:
        if _entered[0] is not mesh:
            raise RuntimeError("a context-parallel ring over another mesh is open: close it first")
        _entered.append(mesh)
        try:
            yield
        finally:
            _entered.pop()
        return
    _entered.append(mesh)
    before = cp._cp_options.enable_load_balance
    cp._cp_options.enable_load_balance = True
    cp._dispatch_mode = cp._DispatchMode.MONKEY_PATCH
    cp._enable_context_parallel_dispatcher_impl(seq_dim=2, mesh=mesh)
    dispatcher = DTensor._op_dispatcher
    handlers = {op: written(handler) for op, handler in cp.custom_ops.items()}  # repeats written: written_ring.py
    if cpu:
        aten = torch.ops.aten
        handlers[aten._scaled_dot_product_flash_attention_for_cpu.default] = written(_cpu_ring_forward)
        handlers[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = written(_cpu_ring_backward)
    dispatcher._custom_op_handlers = {**dispatcher._custom_op_handlers, **handlers}
    try:
        yield
    finally:
        _entered.pop()
        cp._disable_context_parallel_dispatcher_impl()
        cp._cp_options.enable_load_balance = before


def on_fake_mesh(workload, strategy, meshes, *, cpu: bool, enter: Callable):
    """``workload`` as a cp rank runs it on the fake mesh (``plan/sharded.py``): its batch and position
    tables cut to this rank's sequence/N (head-tail), torch's ring attention entered for the session
    (``enter``: the session's ``ExitStack.enter_context``)."""
    seq_len, mesh, build = workload.tokens_per_sample, meshes.cp, workload.build_model
    check_sequence(seq_len, strategy.cp)
    enter(ring_attention(mesh, cpu=cpu))

    def build_sharded():
        model = build()
        shard_position_tables(model, mesh, seq_len)
        return model

    return dataclasses.replace(workload, build_model=build_sharded,
                               make_batch=sharded_make_batch(workload.make_batch, mesh, seq_len))


def _through_ring(call, meshes) -> bool:
    """Whether a traced collective ``call`` is the ring's (its K/V all-gather, its dK/dV passed on)."""
    return call.functional and call.group_name in meshes.ring_groups


def ring_label(call, strategy, meshes) -> tuple[str, int] | None:
    """The ring's collectives are cp's (``Collective.group`` "cp", cp ranks); None for any other."""
    return ("cp", strategy.cp) if _through_ring(call, meshes) else None


def check_ring(strategy, meshes, calls) -> None:
    """cp<N> with no attention through the ring: the model calls no F.scaled_dot_product_attention."""
    if not any(_through_ring(call, meshes) for call in calls):
        raise OptionError(f"{strategy.name}: the model runs no attention through "
                          "F.scaled_dot_product_attention, which context parallelism's ring replaces "
                          "(torch's context_parallel): use a model with SDPA attention, or drop cp<N>")


def context_parallel_approximations(strategies) -> list:
    """What a plan with cp<N> among ``strategies`` says in every output: rank 0 of the ring is traced,
    and the other cp ranks take torch's other load-balancing branch."""
    from batchfit.trace.approximation import Approximation

    names = sorted({s.name for s in strategies if getattr(s, "cp", 1) > 1})
    if not names:
        return []
    return [Approximation(
        what=f"{', '.join(names)}: rank 0 of the context-parallel ring traced (torch's _templated_ring_attention "
             "on the fake process group); ranks r > 0 take the ring's other head-tail branch (K/V halves at steps "
             "i <= r instead of half the queries), and NCCL's own all-gather / all-to-all staging is not counted",
        may_differ_by="-1.4% to +0.4% of each rank's real peak under cp2 (2 and 4 gloo ranks, tiny Llama, the CPU "
                      "flash kernel through the same ring), -0.3% to -3.2% under cp4 (4 gloo ranks on 2 cores: the "
                      "real peak varies run to run by 162 KB, in buffers held until a collective completes); the "
                      "position tables are sharded once, as torchtitan's _context_parallel_shard path does: torch's "
                      "context_parallel(buffers=...) also keeps a clone of each table it restores for the step (seq x "
                      "head_dim x 4 B for a RoPE cos + sin pair: 64 MiB at seq 131072, head 128), not counted",
        source="tests/test_context_parallel.py; docs/tracing/context-parallel.md")]


# Its registry entry's rules (``distributed/parallelisms.py``): the ring's span and bytes on a link for the time
# model, Accelerate's keys, and why a pipeline does not run it yet.

NOT_IN_PIPELINE = ("context parallelism inside a pipeline is not traced yet: use fsdp+cp<N>[+tp<T>] without pp, or "
                   "pp<N>+fsdp without cp")


def ring_span(collective, strategy) -> int:
    """Consecutive ranks one ring's collective spans: cp x tp (the mesh puts tp innermost)."""
    return collective.group_size * strategy.tp


def ring_pass(collective) -> float | None:
    """Bytes on a link per byte of the ring's dK/dV pass (permute_tensor sends a whole buffer to the next rank:
    1.0); None for the all-gathers, a ring's."""
    return 1.0 if collective.op == "all_to_all" else None


def accelerate_keys(row, degree: int) -> dict[str, object]:
    """torch's ring with its default all-gather rotation (what the trace ran), under FSDP2 (Accelerate's only)."""
    if row.shard not in ("fsdp", "fsdp-noreshard"):
        raise OptionError(f"the recommended {row.strategy}: Accelerate runs context parallelism with FSDP2 only: "
                          "emit the YAML (`emit` config.yaml), or plan fsdp+cp<N> strategies")
    return {"parallelism_config_cp_size": degree, "parallelism_config_cp_comm_strategy": "allgather"}
