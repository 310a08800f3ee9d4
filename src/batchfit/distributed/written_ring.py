"""torch's ring attention written into the trace instead of run again, where the call is known exactly.

Under cp<N> every attention call (forward, its recomputation, backward) runs torch's ring on fake tensors:
N steps, each a fake attention op and some twenty merge ops, all through FakeTensor dispatch and the
trackers (59% of a cp8 step's tracing time on Llama-3.1-70B). What the ring allocates depends only on
what it is given (fake tensors have no values), and the same layer's attention repeats per block, per
phase and per step. So, as ``trace/written.py`` does for a generation loop, a handler call whose key
(the op; every argument's local and global shape, stride, offset, dtype, device, requires_grad, aliasing
and placements; the mesh; scalar arguments; the phase, grad and autocast modes, torch's cp options) was
recorded before is written instead of run: the same mallocs (requested bytes, op, shape, dtype; the
module is the one it runs in now, as every one the call made was its own) and frees, in order, through
``MemoryTracker.count``; the same collectives appended to ``ShardedTracker.calls`` (in the current
phase); the same FLOPs; and results that are fresh fake tensors (DTensors with the recorded spec) of the
same metadata, their storages counted where the call made them (dK and dV are views of one buffer).

A call that does anything else (leaves alive anything but its results, frees what it did not make, moves
the segment or the phase, allocates on a side stream or the host, labels a buffer, returns an input or a
view of one) is not recorded: it runs every time. ``BATCHFIT_WRITE_RING=0`` (or :data:`ENABLED` False) runs
every call (tests/test_written_ring.py compares the two, event for event).
"""

from __future__ import annotations

import itertools
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from batchfit.trace.memory import active_tracker
from batchfit.trace.written import run_marked

ENABLED = os.environ.get("BATCHFIT_WRITE_RING", "1") != "0"
"""Write repeated ring calls (``BATCHFIT_WRITE_RING=0``: run every one)."""

_keys = itertools.count(1)
_known: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""By tracker: the calls recorded so far, by key (None: one that cannot be written)."""


@dataclass(frozen=True)
class RingCall:
    items: tuple[tuple, ...]
    """("malloc", requested bytes, op, shape, dtype) or ("free", index of the malloc among the call's)."""
    results: tuple[tuple | None, ...]
    """Per leaf of the result: (index of its storage's malloc, None for an empty storage; shape, stride,
    storage offset, dtype, device, DTensor spec or None), or None for a leaf that is not a tensor (in ``leaves``)."""
    leaves: tuple
    spec: object
    calls: tuple
    flops: int


def written(handler: Callable) -> Callable:
    """``handler`` (a DTensor custom op handler: ``(op_call, args, kwargs)``) whose repeated calls are written."""

    def write_or_run(op_call, args, kwargs):
        tracker = active_tracker()
        if not ENABLED or tracker is None or not hasattr(tracker, "calls") or tracker.segment_marks is not None \
                or tracker._propagating or tracker.uncounted or tracker._on_host or not _on_fake(args):
            return handler(op_call, args, kwargs)
        key = _key(tracker, op_call, args, kwargs)
        known = _known.setdefault(tracker, {})
        if key is not None and known.get(key) is not None:
            return _write(tracker, known[key])
        out, made = _record(tracker, lambda: handler(op_call, args, kwargs))
        if key is not None:
            known.setdefault(key, made)
        return out

    return write_or_run


def _on_fake(args) -> bool:
    """Whether every tensor argument is a fake one (its local shard, for a DTensor): a step on real tensors (a
    gloo truth) computes values, which a written call would not."""
    from torch._subclasses.fake_tensor import FakeTensor

    tensors = [getattr(a, "_local_tensor", a) for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)]
    return bool(tensors) and all(isinstance(t, FakeTensor) for t in tensors)


def _tensor_key(t: torch.Tensor, tracker, storages: dict) -> tuple:
    storage = id(t.untyped_storage())
    where = (storage in tracker._live, storage in tracker._host, storage in tracker._pinned)
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad,
            storages.setdefault(storage, len(storages)), where)


def _key(tracker, op_call, args, kwargs) -> tuple | None:
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    leaves, spec = tree_flatten((args, kwargs))
    storages: dict[int, int] = {}
    parts = []
    for leaf in leaves:
        if isinstance(leaf, DTensor):
            local = leaf._local_tensor
            parts.append(("D", _tensor_key(local, tracker, storages), tuple(leaf.shape), leaf.stride(),
                          leaf.requires_grad, tuple(leaf.placements), id(leaf.device_mesh)))
        elif isinstance(leaf, torch.Tensor):
            parts.append(("T", _tensor_key(leaf, tracker, storages)))
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            parts.append((type(leaf), leaf))
        else:
            return None
    stream = torch.cpu.current_stream()
    modes = (torch.is_grad_enabled(), torch.is_autocast_enabled("cuda"), torch.is_autocast_enabled("cpu"),
             torch.get_autocast_dtype("cuda"), torch.get_autocast_dtype("cpu"))
    options = tuple(sorted(vars(cp._cp_options).items())) if hasattr(cp._cp_options, "__dict__") else (
        cp._cp_options.enable_load_balance, cp._cp_options.rotate_method)
    return (op_call, str(spec), tuple(parts), tracker.current_phase, stream is tracker._default_stream,
            tracker.round_bytes, tracker.gloo_scratch, modes, str(options))


def _device(call: RingCall, at: int) -> torch.device:
    return next(r[5] for r in call.results if r is not None and r[0] == at)


def _record(tracker, run: Callable) -> tuple[object, RingCall | None]:
    """Run the call, and what it did where it can be written again (None where it cannot)."""
    start_event, start_clock, start_window = len(tracker.events), tracker.clock, len(tracker._window)
    start_calls, start_flops, phase = len(tracker.calls), tracker.flops, tracker.current_phase
    module = tracker._module_stack[-1] if tracker._module_stack else None
    host = set(tracker._host)
    out, marks = run_marked(tracker, run)
    events = tracker.events[start_event:]
    if (marks or tracker.current_phase != phase or tracker.clock - start_clock != len(events)
            or not tracker._host <= host or len(tracker.calls) < start_calls):
        return out, None
    records = tracker._window[start_window:]
    index = {record.seq: i for i, record in enumerate(records)}
    mallocs = [ident for kind, ident, _ in events if kind == "malloc"]
    if mallocs != [record.seq for record in records] or any(ident in tracker.streams for ident in mallocs) \
            or any(r.role is not None or r.module != module or r.phase != phase for r in records):
        return out, None
    items: list[tuple] = []
    freed = set()
    for kind, ident, requested in events:
        if kind == "malloc":
            r = records[index[ident]]
            items.append(("malloc", requested, r.op, r.shape, r.dtype))
        elif kind == "free" and ident in index:
            items.append(("free", index[ident]))
            freed.add(ident)
        else:
            return out, None
    alive = {ident for ident in mallocs if ident not in freed}
    leaves, spec = tree_flatten(out)
    results: list[tuple | None] = []
    kept: list = []
    dtypes: dict[int, torch.dtype] = {}
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            if leaf is not None and not isinstance(leaf, (bool, int, float, str)):
                return out, None
            results.append(None)
            kept.append(leaf)
            continue
        dspec, local = (leaf._spec, leaf._local_tensor) if isinstance(leaf, DTensor) else (None, leaf)
        if leaf.requires_grad or local.requires_grad or not hasattr(local, "fake_mode"):
            return out, None
        storage = local.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:
            at = None
        else:
            held = tracker._live.get(id(storage))
            if held is None or held.seq not in alive or dtypes.setdefault(held.seq, local.dtype) != local.dtype:
                return out, None
            at = index[held.seq]
            if items[[i for i, item in enumerate(items) if item[0] == "malloc"][at]][1] != nbytes \
                    or nbytes % local.element_size():
                return out, None
        results.append((at, tuple(local.shape), local.stride(), local.storage_offset(), local.dtype, local.device,
                        dspec))
        kept.append(None)
    if set(dtypes) != alive:  # something else survives the call
        return out, None
    return out, RingCall(tuple(items), tuple(results), tuple(kept), spec,
                         tuple(tracker.calls[start_calls:]), tracker.flops - start_flops)


def _write(tracker, call: RingCall) -> object:
    """Count the recorded allocations and frees again, append its collectives and FLOPs; the results
    are made for real: each result storage an empty tensor of its bytes (counted as the op that made it),
    the results views of it at their shapes, strides and offsets (dK and dV share one buffer)."""
    module = tracker._module_stack[-1] if tracker._module_stack else None
    kinds = {r[0]: r[4] for r in call.results if r is not None and r[0] is not None}  # malloc index: dtype
    bases: dict[int, torch.Tensor] = {}
    keys: list[int] = []
    try:
        for item in call.items:
            if item[0] == "malloc":
                _, requested, op, shape, dtype = item
                kind = kinds.get(len(keys))
                if kind is not None:  # a result's storage: made for real, freed when the results die
                    base = torch.empty(requested // kind.itemsize, dtype=kind, device=_device(call, len(keys)))
                    key = id(base.untyped_storage())
                    record = tracker._live[key]
                    record.op, record.module, record.shape, record.dtype = op, module, shape, dtype
                    bases[len(keys)] = base
                else:
                    key = -next(_keys)
                    tracker.count(key, requested, op=op, shape=shape, dtype=dtype, module=module)
                keys.append(key)
            else:
                tracker._free(keys[item[1]])
    except BaseException:  # out of memory on the virtual device: what was written dies, as tensors would
        for key in keys:
            if key < 0:
                tracker._free(key)
        raise
    tracker.calls.extend(call.calls)
    tracker.flops += call.flops
    leaves = []
    for result, value in zip(call.results, call.leaves):
        if result is None:
            leaves.append(value)
            continue
        at, shape, stride, offset, dtype, device, dspec = result
        local = (torch.empty_strided(shape, stride, dtype=dtype, device=device) if at is None
                 else bases[at].as_strided(shape, stride, offset))
        leaves.append(local if dspec is None else DTensor(local, dspec, requires_grad=False))
    return tree_unflatten(leaves, call.spec)
