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

import copy
import itertools
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from batchfit.trace.memory import active_tracker
from batchfit.trace.written import run_marked

ENABLED = os.environ.get("BATCHFIT_WRITE_RING", "1") != "0"
"""Write repeated ring calls (``BATCHFIT_WRITE_RING=0``: run every one)."""

_keys = itertools.count(1)
KNOWN_CALLS = 4096
"""How many recorded calls this process keeps (the least recently used go first)."""
_known: OrderedDict[tuple, RingCall | None] = OrderedDict()
"""The calls recorded so far in this process, by key (None: one that cannot be written). Shared by every
tracker: the key holds all of a tracker's state the call depends on, and a call's collectives name their
groups by mesh dimension, its results' specs no mesh: the depth sessions of one size, the fresh sessions
a reserved probe opens and the steps after them write what the first recorded."""


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
    """The collectives, each one's group as the index of its mesh dimension (the mesh the arguments are on)."""
    flops: int


def written(handler: Callable) -> Callable:
    """``handler`` (a DTensor custom op handler: ``(op_call, args, kwargs)``) whose repeated calls are written."""

    def write_or_run(op_call, args, kwargs):
        tracker = active_tracker()
        if not ENABLED or tracker is None or not hasattr(tracker, "calls") or tracker.segment_marks is not None \
                or tracker._propagating or tracker.uncounted or tracker._on_host or not _on_fake(args):
            return handler(op_call, args, kwargs)
        mesh = _mesh(args, kwargs)
        key = _key(tracker, op_call, args, kwargs) if mesh is not None else None
        if key is not None and _known.get(key) is not None:
            _known.move_to_end(key)
            return _write(tracker, _known[key], mesh)
        out, made = _record(tracker, lambda: handler(op_call, args, kwargs), mesh)
        if key is not None and key not in _known:
            _known[key] = made
            while len(_known) > KNOWN_CALLS:
                _known.popitem(last=False)
        return out

    return write_or_run


def _on_fake(args) -> bool:
    """Whether every tensor argument is a fake one (its local shard, for a DTensor): a step on real tensors (a
    gloo truth) computes values, which a written call would not."""
    from torch._subclasses.fake_tensor import FakeTensor

    tensors = [getattr(a, "_local_tensor", a) for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)]
    return bool(tensors) and all(isinstance(t, FakeTensor) for t in tensors)


def _mesh(args, kwargs):
    """The one device mesh of the call's DTensor arguments, or None (none, or several)."""
    meshes = {id(leaf.device_mesh): leaf.device_mesh for leaf in tree_flatten((args, kwargs))[0]
              if isinstance(leaf, DTensor)}
    return next(iter(meshes.values())) if len(meshes) == 1 else None


def _mesh_key(mesh) -> tuple:
    """What of a mesh a ring call depends on: torch's own equality of meshes (ranks, layout, device type,
    dimension names; read without tensors: the mesh's tensor is not to be read under fake tensors) and this
    rank's place in it. Two sessions' meshes alike by it have groups alike dimension by dimension."""
    return (mesh._hash_key(), mesh.get_coordinate())


def _groups(mesh) -> list[str]:
    """The process group name of each of the mesh's dimensions."""
    return [mesh.get_group(dim).group_name for dim in range(mesh.ndim)]


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
                          leaf.requires_grad, tuple(leaf.placements), _mesh_key(leaf.device_mesh)))
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


def _record(tracker, run: Callable, mesh) -> tuple[object, RingCall | None]:
    """Run the call, and what it did where it can be written again (None where it cannot), with no
    reference to ``mesh`` (the arguments'): a tracker whose mesh is laid out alike writes it."""
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
        if dspec is not None:
            if dspec.mesh is not mesh:
                return out, None
            dspec = copy.copy(dspec)
            dspec.mesh, dspec._hash = None, None
        results.append((at, tuple(local.shape), local.stride(), local.storage_offset(), local.dtype, local.device,
                        dspec))
        kept.append(None)
    groups = _groups(mesh)
    calls = tracker.calls[start_calls:]
    if set(dtypes) != alive or any(c.group_name not in groups for c in calls):  # something else survives the call;
        return out, None                                                     # a group off the mesh
    calls = tuple(replace(c, group_name=groups.index(c.group_name)) for c in calls)
    return out, RingCall(tuple(items), tuple(results), tuple(kept), spec, calls, tracker.flops - start_flops)


def _write(tracker, call: RingCall, mesh) -> object:
    """Count the recorded allocations and frees again, append its collectives (on ``mesh``'s groups) and FLOPs;
    the results are made for real: each result storage an empty tensor of its bytes (counted as the op that
    made it), the results views of it at their shapes, strides and offsets (dK and dV share one buffer), each
    DTensor's spec on ``mesh``."""
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
    groups = _groups(mesh)
    tracker.calls.extend(replace(c, group_name=groups[c.group_name]) for c in call.calls)
    tracker.flops += call.flops
    leaves = []
    for result, value in zip(call.results, call.leaves):
        if result is None:
            leaves.append(value)
            continue
        at, shape, stride, offset, dtype, device, dspec = result
        local = (torch.empty_strided(shape, stride, dtype=dtype, device=device) if at is None
                 else bases[at].as_strided(shape, stride, offset))
        if dspec is not None:
            dspec = copy.copy(dspec)
            dspec.mesh, dspec._hash = mesh, None
        leaves.append(local if dspec is None else DTensor(local, dspec, requires_grad=False))
    return tree_unflatten(leaves, call.spec)
