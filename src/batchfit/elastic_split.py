"""Cutting a batch into micro-batches, and a global batch into micro-batch x accumulation x ranks.

A batch is a tensor, or a tuple / list / dict (``BatchEncoding`` and other mappings too) of
them, nested as deep as the data loader made it. Every tensor with a first dimension is cut
along dim 0, and all of them must agree on how many samples there are: a batch whose
``labels`` have fewer rows than its ``input_ids`` is a bug that cutting would hide. A list of
non-tensors with one entry per sample (the strings of a text batch) is cut the same way;
anything else (a 0-dim tensor, a flag, a name) goes whole to every micro-batch.

Pure functions of the batch, no state: ``ElasticStep`` and the integrations call them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from batchfit.errors import OptionError


def _leaves(batch: Any, where: str = "batch") -> Iterator[tuple[str, Any]]:
    """(path, leaf) of every leaf, paths as a user would write them: batch['labels'][0]."""
    if isinstance(batch, torch.Tensor):
        yield where, batch
    elif isinstance(batch, Mapping):
        for key, value in batch.items():
            yield from _leaves(value, f"{where}[{key!r}]")
    elif isinstance(batch, (tuple, list)) and any(_is_container(x) for x in batch):
        for i, value in enumerate(batch):
            yield from _leaves(value, f"{where}[{i}]")
    else:
        yield where, batch


def _is_container(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, Mapping)) or (
        isinstance(x, (tuple, list)) and any(_is_container(y) for y in x))


def batch_size(batch: Any) -> int:
    """Samples in ``batch``: the first dimension of its tensors, which must all agree."""
    sizes = {path: leaf.shape[0] for path, leaf in _leaves(batch)
             if isinstance(leaf, torch.Tensor) and leaf.dim() > 0}
    if not sizes:
        raise OptionError("the batch holds no tensor with a batch dimension: give a tensor, or a tuple, "
                          "list or dict of tensors whose first dimension is the sample")
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{path} has {n}" for path, n in sizes.items())
        raise OptionError(f"the batch's tensors disagree on the number of samples ({listed}): ElasticStep cuts "
                          "every tensor along dim 0, so give each one row per sample (a scalar as a 0-dim tensor)")
    return next(iter(sizes.values()))


def _cut(batch: Any, start: int, stop: int, total: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[start:stop] if batch.dim() > 0 else batch
    if isinstance(batch, Mapping):
        items = {key: _cut(value, start, stop, total) for key, value in batch.items()}
        try:
            return type(batch)(items)  # BatchEncoding, OrderedDict, dict
        except TypeError:  # a mapping type that cannot be built from a dict
            return items
    if isinstance(batch, (tuple, list)):
        if any(_is_container(x) for x in batch):
            items = [_cut(x, start, stop, total) for x in batch]
        elif len(batch) == total:  # one entry per sample: the texts, ids or paths of a batch
            items = list(batch[start:stop])
        else:
            return batch
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
            return type(batch)(*items)
        return type(batch)(items)
    return batch


def split_batch(batch: Any, micro_batch: int) -> list[Any]:
    """``batch`` as consecutive micro-batches of ``micro_batch`` samples (the last may be smaller).

    Tensors are sliced (views: no copy, no memory); every sample lands in exactly one micro-batch.
    """
    if micro_batch < 1:
        raise OptionError(f"micro_batch must be 1 or more, got {micro_batch}")
    total = batch_size(batch)
    return [_cut(batch, start, min(start + micro_batch, total), total) for start in range(0, total, micro_batch)]


def take_samples(batch: Any, n: int) -> Any:
    """A batch of ``n`` samples made of ``batch``'s samples, repeated as needed (for tracing a
    size the data loader never produced; on fake tensors only the shapes matter)."""
    total = batch_size(batch)

    def take(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if x.dim() == 0:
                return x
            index = torch.arange(n, device=x.device) % total
            return x[index]
        if isinstance(x, Mapping):
            items = {key: take(value) for key, value in x.items()}
            try:
                return type(x)(items)
            except TypeError:
                return items
        if isinstance(x, (tuple, list)):
            if any(_is_container(y) for y in x):
                items = [take(y) for y in x]
            elif len(x) == total:
                items = [x[i % total] for i in range(n)]
            else:
                return x
            return type(x)(*items) if isinstance(x, tuple) and hasattr(x, "_fields") else type(x)(items)
        return x

    return take(batch)


def split_global_batch(global_batch: int, max_micro_batch: int, *, world_size: int = 1,
                       multiple_of: int = 1) -> tuple[int, int]:
    """(micro-batch per rank, accumulation steps) with micro x accumulation x world_size == global_batch.

    The fewest accumulation steps whose micro-batch is at most ``max_micro_batch`` and a multiple
    of ``multiple_of``: the largest micro-batch that fits, so the fewest, fullest steps.
    """
    for name, value in (("global_batch", global_batch), ("world_size", world_size), ("multiple_of", multiple_of)):
        if value < 1:
            raise OptionError(f"{name} must be 1 or more, got {value}")
    if global_batch % world_size:
        raise OptionError(f"global_batch {global_batch} does not split evenly over {world_size} devices: "
                          f"use a multiple of {world_size}, e.g. {math.ceil(global_batch / world_size) * world_size}")
    per_rank = global_batch // world_size
    cap = min(max_micro_batch, per_rank)
    for micro in range(cap - cap % multiple_of, 0, -multiple_of):
        if per_rank % micro == 0:
            return micro, per_rank // micro
    step = multiple_of * world_size
    raise OptionError(f"no micro-batch of at most {max_micro_batch} samples (a multiple of {multiple_of}) divides "
                      f"the {per_rank} samples per device of global_batch {global_batch}: use a global_batch that "
                      f"is a multiple of {step}, e.g. {max(1, round(global_batch / step)) * step}")
