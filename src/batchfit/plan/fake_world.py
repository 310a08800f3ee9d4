"""The fake process group ``plan`` traces a rank on: every rank's collectives answered at once in one
process (``torch.distributed``'s "fake" backend), and the device meshes built on it, by strategy.

Importing this module does not import torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from batchfit.errors import OptionError

_world: list[tuple[int, int]] = []
"""(world size, this process's rank) of the fake process group this module opened, once per session using it."""
_opened: list[int] = [0]
"""Fake worlds opened in this process so far (DTensor's caches hold the last one's process groups)."""
_meshes: dict = {}
"""The meshes built on that group, by strategy: sessions of one strategy share them (a second
``init_device_mesh`` of the same shape makes new groups that DTensor does not always use)."""


def meshes_of(strategy):
    """The device meshes of ``strategy`` on the open fake world (``distributed.build_meshes``), built once."""
    from batchfit.distributed import build_meshes

    if strategy not in _meshes:
        _meshes[strategy] = build_meshes(strategy)
    return _meshes[strategy]


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """A fake process group of ``world_size`` ranks in this process, this process rank ``rank`` (0 for
    ``plan``; another rank for a truth compared rank by rank: its meshes' coordinates, its shards).

    Nested uses of the same world and rank share one group (the depths of a deep trace)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if _world and _world[0] != (world_size, rank):
        raise RuntimeError(f"a fake world of {_world[0][0]} ranks (as rank {_world[0][1]}) is open: close it "
                           f"before one of {world_size} (as rank {rank})")
    if not _world:
        if dist.is_initialized():
            raise OptionError("a torch.distributed process group is already running in this process: "
                              "run batchfit plan outside torchrun (it simulates every rank itself)")
        if _opened[0]:
            _forget_dtensor_decisions()
        _opened[0] += 1
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    _world.append((world_size, rank))
    try:
        yield
    finally:
        _world.pop()
        if not _world:
            _meshes.clear()
            dist.destroy_process_group()


def _forget_dtensor_decisions() -> None:
    """Clear DTensor's caches of sharding and redistribution decisions before any new world: they are
    keyed by device meshes, which compare equal across worlds (``DeviceMesh.__eq__`` leaves out the
    process groups: another rank's mesh, or another strategy's sub-mesh of the same ranks), so the next
    trace would send its collectives to the last world's groups (gone with it: "Could not resolve the
    process group", hf:llama-3.1-70b's fsdp+cp2+tp2 traced after fsdp+tp2 in one process)."""
    import torch
    from torch.distributed.tensor import DTensor, _redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    type(propagator)._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ dispatch fast path's copy
