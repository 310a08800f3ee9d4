"""The memory tracker of a sharded step: what FSDP2, DDP and DTensor do that a plain step does not.

``MemoryTracker`` counts a storage when an op creates it. Three things in a sharded step
escape that, and this tracker sees them:

- FSDP2 frees a block's gathered parameters by ``untyped_storage().resize_(0)`` and gives
  them memory again by ``resize_(n)`` before the next all-gather copies into them: no op
  creates a storage. ``UntypedStorage.resize_`` is wrapped while the tracker is entered (as
  PyTorch's own ``torch/distributed/_tools/mem_tracker.py`` does) and each resize counts
  as a free or an allocation.
- DTensor (tensor parallelism, FSDP2's sharded parameters) is a tensor subclass: an op on
  it is answered ``NotImplemented`` so that DTensor turns it into ops on the local shards,
  which the tracker then sees and counts (as ``fsdp2_mem_tracker.py`` does); so is any other
  wrapper subclass (torchao's float8 tensors, as ``MemoryTracker`` does on one device).
- ``_c10d_functional.wait_tensor`` returns its input on a real device; on fake tensors its
  meta kernel returns a new tensor, which would be counted twice: the input is returned.

Collective buffers get their own category, ``collective``: FSDP2's flat all-gather output
and the gathered (unsharded) parameters copied out of it, the flat reduce-scatter input,
and DDP's gradient buckets. Every collective rank 0 calls is recorded (op, group, bytes,
phase) for the time model. TP's collectives return activations (an all-gathered sequence,
an all-reduced block output): they keep the category of the phase that made them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401 - defines the fsdp:: ops
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils import flop_counter
from torch.utils._python_dispatch import is_traceable_wrapper_subclass_type
from torch.utils._pytree import tree_leaves

from batchfit.trace.memory import CATEGORIES, MemoryTracker

SHARDED_CATEGORIES: tuple[str, ...] = (*CATEGORIES[:-1], "collective", CATEGORIES[-1])

_c10d = torch.ops.c10d
_functional = torch.ops._c10d_functional
_WAIT = _functional.wait_tensor.default
_ALL_GATHER_COPY_IN = torch.ops.fsdp.all_gather_copy_in.default
_CHUNK_CAT = torch.ops.fsdp.chunk_cat.default
_aten = torch.ops.aten


def _cpu_flash(query, key, value, *args, out_val=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_flash_backward(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


# torch.utils.flop_counter's formulas (matmuls, convolutions, the CUDA attention kernels),
# and the same attention formulas for the CPU flash kernel the trace runs in their place.
FLOP_FORMULAS = {
    **flop_counter.flop_registry,
    _aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward,
}


@dataclass(frozen=True)
class CollectiveCall:
    op: str
    group_name: str
    bytes: int
    phase: str
    functional: bool = False
    """A ``_c10d_functional`` op (DTensor's, context parallelism's ring) rather than a c10d one
    (FSDP2's, DDP's): what tells the ring's calls from FSDP2's on a group both use (cp<N>, dp 1)."""


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tensors) if isinstance(t, torch.Tensor))


def _group_name(group) -> str:
    """The name of a process group passed to a c10d op (a ScriptObject in the dispatcher)."""
    if isinstance(group, str):
        return group
    if not isinstance(group, torch._C._distributed_c10d.ProcessGroup):
        group = torch._C._distributed_c10d.ProcessGroup.unbox(group)
    return group.group_name


def _collective(func, args, kwargs) -> tuple[str, str, int] | None:
    """(op, group name, payload bytes of the full tensor) of a collective call, else None.
    Bytes are those of the whole (unsharded) tensor gathered or reduced, per call."""
    packet = func._overloadpacket
    if packet is _c10d._allgather_base_:  # (output, input, group, ...)
        return "all_gather", _group_name(args[2]), _nbytes(args[0])
    if packet is _c10d.allgather_:  # (output lists, inputs, group, ...)
        return "all_gather", _group_name(args[2]), _nbytes(args[0])
    if packet is _c10d._reduce_scatter_base_:  # (output, input, group, ...)
        return "reduce_scatter", _group_name(args[2]), _nbytes(args[1])
    if packet is _c10d.reduce_scatter_:  # (outputs, input lists, group, ...)
        return "reduce_scatter", _group_name(args[2]), _nbytes(args[1])
    if packet is _c10d.allreduce_:  # (tensors, group, ...)
        return "all_reduce", _group_name(args[1]), _nbytes(args[0])
    if packet is _c10d.reduce_:  # (tensors, group, op, root rank, ...): zero2's gradient to its owner
        return "reduce", _group_name(args[1]), _nbytes(args[0])
    if packet is _c10d.broadcast_:  # (tensors, group, ...)
        return "broadcast", _group_name(args[1]), _nbytes(args[0])
    if packet is _functional.all_gather_into_tensor:  # (input, group_size, group_name)
        return "all_gather", args[2], _nbytes(args[0]) * args[1]
    if packet is _functional.reduce_scatter_tensor:  # (input, op, group_size, group_name)
        return "reduce_scatter", args[3], _nbytes(args[0])
    if packet is _functional.all_reduce:  # (input, op, group_name)
        return "all_reduce", args[2], _nbytes(args[0])
    if packet is _functional.all_to_all_single:  # (input, output splits, input splits, group_name)
        return "all_to_all", args[3], _nbytes(args[0])
    if packet is _functional.broadcast:  # (input, src, group_name)
        return "broadcast", args[2], _nbytes(args[0])
    return None


def _patch_propagation(tracker: ShardedTracker):
    """Make DTensor's sharding propagation invisible to ``tracker``; the original, to put back.

    The first time DTensor meets an op at new shapes it runs the op on stand-in tensors of
    the global shape to learn the output's (``_propagate_tensor_meta_non_cached``, then
    cached). On a GPU those are fake tensors that hold no memory; here everything is fake,
    so without this they would be counted (1 GiB for Llama-3.1-8B's embedding under TP)."""
    original = getattr(ShardingPropagator, "_propagate_tensor_meta_non_cached", None)
    if original is None:
        return None

    @functools.wraps(original)
    def propagate(*args, **kwargs):
        tracker._propagating += 1
        try:
            return original(*args, **kwargs)
        finally:
            tracker._propagating -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate
    return original


class ShardedTracker(MemoryTracker):
    """``MemoryTracker`` plus storage resizes, DTensor, and collectives (see the module docstring)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.calls: list[CollectiveCall] = []
        """Every collective called since ``start_window()``."""
        self.flops = 0
        """FLOPs of the ops on this rank's (local) tensors since ``start_window()``, counted by
        torch.utils.flop_counter's formulas: DTensor ops reach here as ops on the shards."""
        self.gloo_scratch = False
        """Count the scratch copies gloo's collectives make (:meth:`_gloo_scratch`): for a trace compared with
        a real gloo run on a CPU (``ShardedSession(cuda_semantics=False, gloo_scratch=True)``); NCCL makes none."""
        self._resize = None
        self._depth = 0
        self._propagate = None
        self._propagating = 0

    # --- storage resizes ----------------------------------------------------------------
    def __enter__(self) -> ShardedTracker:
        if self._depth == 0:
            original = torch.UntypedStorage.resize_
            self._resize = original

            def resize_(storage: torch.UntypedStorage, size: int):
                before = storage.nbytes()
                out = original(storage, size)
                self._resized(storage, before, size)
                return out

            torch.UntypedStorage.resize_ = resize_
            self._propagate = _patch_propagation(self)
        self._depth += 1
        try:
            return super().__enter__()
        except BaseException:
            self._unpatch()
            raise

    def __exit__(self, *exc):
        self._unpatch()
        return super().__exit__(*exc)

    def _unpatch(self) -> None:
        """Put back what ``__enter__`` patched, when the outermost ``with`` ends."""
        self._depth -= 1
        if self._depth == 0 and self._resize is not None:
            torch.UntypedStorage.resize_ = self._resize
            self._resize = None
            if self._propagate is not None:
                ShardingPropagator._propagate_tensor_meta_non_cached = self._propagate
                self._propagate = None

    def _resized(self, storage: torch.UntypedStorage, before: int, after: int) -> None:
        key = id(storage)
        if after == before:
            return
        if key in self._live:  # its memory is given back (or re-sized: counted anew below)
            self._free(key)
        if after > 0:
            # FSDP2 gives memory back only to a gathered parameter (or its all-gather output).
            self.record(key, storage, op="resize_", shape=(after,), dtype="uint8", role="collective")

    # --- ops ----------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            # DTensor runs the op on its local shards, torchao's float8 tensors on their data and
            # scales; those ops come back here (collectives and FLOPs counted once, on them).
            return NotImplemented
        if self._propagating:  # DTensor working out an output's shape: fake tensors on a GPU too
            return func(*args, **(kwargs or {}))
        if isinstance(func, torch._ops.HigherOrderOperator):
            # AOTAutograd's rng wrappers of a recomputed op (compile + checkpointing): counted as the op
            # they wrap by MemoryTracker; no collective, and the recomputed op's FLOPs are not counted
            return super().__torch_dispatch__(func, types, args, kwargs)
        if func is _WAIT:
            return args[0]
        call = _collective(func, args, kwargs or {})
        scratch = self._gloo_scratch(func, args) if self.gloo_scratch else None
        out = super().__torch_dispatch__(func, types, args, kwargs)
        del scratch  # freed as the collective returns
        if call is not None:
            self.calls.append(CollectiveCall(*call, phase=self.current_phase,
                                             functional=func.namespace == "_c10d_functional"))
        formula = FLOP_FORMULAS.get(func._overloadpacket)
        if formula is not None:
            self.flops += formula(*args, **(kwargs or {}), out_val=out)
        if func is _ALL_GATHER_COPY_IN:  # (all-gather input, all-gather output): one flat buffer
            self.mark_collective(out[1])
        elif func is _CHUNK_CAT:  # the flat reduce-scatter input
            self.mark_collective(args[3] if len(args) > 3 else (kwargs or {}).get("out"))
        return out

    def _gloo_scratch(self, func, args) -> torch.Tensor | None:
        """The copy ProcessGroupGloo makes for a reduce-scatter, counted while the op runs: gloo has no
        reduce-scatter of its own and clones the whole input to all-reduce it in place (FSDP2's
        ``_reduce_scatter_base_``, and DTensor's functional reduce-scatter through the coalesced one; torch's
        profiler on a 2-rank gloo run: an ``aten::clone`` of the input's bytes inside the op; the functional
        one keeps it until its wait, taken here as the op's end). FSDP2's gradient reduce-scatter is the one
        that matters: a rank whose peak falls there (an expert-parallel rank that gets no tokens) holds its
        flat gradients twice on gloo, once on NCCL."""
        packet = func._overloadpacket
        if packet is _c10d._reduce_scatter_base_:
            source = args[1]
        elif packet is _functional.reduce_scatter_tensor:  # (input, op, group size, group name)
            source = args[0]
        else:
            return None
        if source is None or not isinstance(source, torch.Tensor):
            return None
        scratch = torch.empty_like(source)
        self._maybe_track(scratch, func, [])
        self.mark_collective(scratch)
        return scratch

    def mark_collective(self, tensor: torch.Tensor | None) -> None:
        """Label ``tensor``'s storage as a collective buffer (unless it is owned by then)."""
        if tensor is None:
            return
        record = self._live.get(id(tensor.untyped_storage()))
        if record is not None and record.role is None:
            record.role = "collective"

    def start_window(self) -> None:
        super().start_window()
        self.calls = []
        self.flops = 0

    @staticmethod
    def _breakdown(live) -> dict[str, int]:
        breakdown = dict.fromkeys(SHARDED_CATEGORIES, 0)
        for record in live:
            breakdown[record.category] += record.nbytes
        return breakdown
