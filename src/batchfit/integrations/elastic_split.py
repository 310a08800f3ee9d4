"""Cutting a batch into micro-batches, a global batch into micro-batch x accumulation x ranks,
and sizing the micro-batch of a model the user already built (``ElasticStep``, the Lightning
and Hugging Face integrations all start from the same ``plan_global_batch``).

A batch is a tensor, or a tuple / list / dict (``BatchEncoding`` and other mappings too) of
them, nested as deep as the data loader made it. Every tensor with a first dimension is cut
along dim 0, and all of them must agree on how many samples there are: a batch whose
``labels`` have fewer rows than its ``input_ids`` is a bug that cutting would hide. A list of
non-tensors with one entry per sample (the strings of a text batch) is cut the same way;
anything else (a 0-dim tensor, a flag, a name) goes whole to every micro-batch.

The cutting is pure (functions of the batch, no state). The sizing traces a copy of the live
model on fake tensors (``batchfit.estimate``) or probes it (``batchfit.find_max_batch``).
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from batchfit.errors import OptionError
from batchfit.search import largest_micro_batch
from batchfit.workload import StepOptions, Workload

logger = logging.getLogger(__name__)


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


def divide_global_batch(global_batch: int, max_micro_batch: int, *, world_size: int = 1,
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
    micro = largest_micro_batch(per_rank, max_micro_batch, multiple_of)
    if micro:
        return micro, per_rank // micro
    step = multiple_of * world_size
    raise OptionError(f"no micro-batch of at most {max_micro_batch} samples (a multiple of {multiple_of}) divides "
                      f"the {per_rank} samples per device of global_batch {global_batch}: use a global_batch that "
                      f"is a multiple of {step}, e.g. {max(1, round(global_batch / step)) * step}")


# -- a Workload from a live model, and the size it can take -------------------------------------------


def fake_copy(model: nn.Module, keep: tuple[Any, ...] = ()) -> Callable[[], nn.Module]:
    """A ``build_model`` that rebuilds ``model`` with fresh, uninitialised parameters and
    buffers of the same shapes: fake tensors when the tracer calls it, real ones on the
    device a probe builds on (``with device:``). ``keep`` are objects the copy shares
    instead of copying (a trainer the module points back to)."""

    def build() -> nn.Module:
        memo: dict[int, Any] = {id(obj): obj for obj in keep}
        memo.update({id(obj): None for obj in _back_references(model)})
        for t in (*model.parameters(), *model.buffers()):
            new = torch.empty(t.shape, dtype=t.dtype)
            memo[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
        return copy.deepcopy(model, memo)

    return build


def _back_references(model: nn.Module) -> list[Any]:
    """What a module points back to and a copy must not drag along: a Lightning module's trainer."""
    return [ref for m in model.modules() for ref in (getattr(m, "_trainer", None),) if ref is not None]


def live_workload(model: nn.Module, sample_batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor], *, name: str,
                  build_optimizer: Callable | None = None, keep: tuple[Any, ...] = ()) -> Workload:
    """A Workload of a model the user already built, fed with copies of ``sample_batch``'s samples."""
    sample = sample_batch

    def make_batch(n: int, device: torch.device) -> Any:
        return to_device(take_samples(sample, n), device)

    extra = {"build_optimizer": build_optimizer} if build_optimizer is not None else {}
    return Workload(name=name, build_model=fake_copy(model, keep), make_batch=make_batch, loss_fn=loss_fn,
                    description=f"{name} as built by the user", **extra)


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with its tensors on ``device`` (containers kept)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if hasattr(batch, "to") and not isinstance(batch, nn.Module):  # BatchEncoding
        return batch.to(device)
    if isinstance(batch, dict):
        return type(batch)({k: to_device(v, device) for k, v in batch.items()})
    if isinstance(batch, (tuple, list)):
        items = [to_device(x, device) for x in batch]
        return type(batch)(*items) if isinstance(batch, tuple) and hasattr(batch, "_fields") else type(batch)(items)
    return batch


def same_optimizer(optimizer: torch.optim.Optimizer, params) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class and settings over ``params`` (the copy's), for its
    state's bytes. Only the settings its constructor takes: ``defaults`` also holds ones a base
    class added (AdamW's hold Adam's ``decoupled_weight_decay``)."""
    import inspect

    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    return cls(params, **{k: v for k, v in optimizer.defaults.items() if k in accepted})


@dataclass(frozen=True)
class Sizing:
    """The largest micro-batch for a device, and how it was found."""

    micro_batch: int
    """The largest micro-batch under target_util of the device's usable memory (0: none fits)."""
    device_name: str
    source: str
    """'traced' (batchfit.estimate) or 'probed' (batchfit.find_max_batch)."""
    peak_bytes: int | None
    """The traced or measured peak at micro_batch."""
    result: Any
    """The EstimateResult or ProbeResult."""


def size_micro_batch(workload: Workload, *, model: nn.Module, max_batch: int, multiple_of: int = 1,
                     target_util: float = 0.9, gpu: str | None = None, gpu_memory: str | None = None,
                     options: StepOptions | None = None, mode: str = "estimate", limit: str = "reserved",
                     say: Callable[[str], None] | None = None) -> Sizing:
    """The largest micro-batch of ``workload`` for the GPU ``model`` is on, else the GPU named by
    ``gpu`` / ``gpu_memory``, else the one ``resolve_target`` assumes (and says so). ``limit`` is
    what must fit, as ``batchfit estimate --limit`` says: reserved (the caching allocator's
    segments, what a GPU runs out of) or allocated (the tensors alone; fewer traces)."""
    from batchfit.estimator.engine import estimate
    from batchfit.probe.find import find_max_batch
    from batchfit.targets import resolve_target

    if mode not in ("estimate", "probe"):
        raise OptionError(f"unknown mode '{mode}': use estimate (traced, no GPU needed) or probe (measured)")
    say = say or logger.info
    param = next(model.parameters(), None)
    here = f"cuda:{param.device.index or 0}" if param is not None and param.device.type == "cuda" else None
    target = resolve_target(gpu=gpu, gpu_memory=gpu_memory, device=None if gpu or gpu_memory else here, say=say)
    max_batch = max(max_batch, multiple_of)
    if mode == "estimate":
        result = estimate(workload, device=target.device, options=options, target_util=target_util,
                          multiple_of=multiple_of, max_batch=max_batch, suggest=False, limit=limit)
        best = result.max_batch_size_at_target
        point = result.point(best) if best else None
        return Sizing(best, target.device.display_name, "traced", point.peak_bytes if point else None, result)
    result = find_max_batch(workload, target=target, options=options, multiple_of=multiple_of,
                            largest=max_batch, target_util=target_util, limit=limit)
    tier = next((r for r in result.recommendations if r.name == "production"), None)
    best = tier.batch_size if tier else result.max_batch_size
    trial = result.trial(best)
    return Sizing(best, target.device.display_name if target.device else target.spec,
                  "probed" if target.kind == "cuda" else "traced (virtual device)",
                  trial.peak_allocated_bytes if trial else None, result)


@dataclass(frozen=True)
class GlobalBatchPlan:
    """A global batch as micro-batch x accumulation steps x devices, and the size that bounds it."""

    global_batch: int
    world_size: int
    micro_batch: int
    """Samples per micro-batch on each device (a data loader's batch_size)."""
    accumulation_steps: int
    sizing: Sizing

    def describe(self) -> str:
        return (f"global batch {self.global_batch} = micro-batch {self.micro_batch} x {self.accumulation_steps} "
                f"accumulation step(s) x {self.world_size} device(s); the largest micro-batch under "
                f"{self.sizing.result.target_util:.0%} of {self.sizing.device_name} is {self.sizing.micro_batch} "
                f"({self.sizing.source})")

    def write_report(self, folder) -> Any:
        """Write the estimate's (or probe's) report into ``folder``; the path of its report.md."""
        from pathlib import Path

        from batchfit.report import write_estimate_report, write_probe_report

        write = write_estimate_report if self.sizing.source == "traced" else write_probe_report
        return write(self.sizing.result, Path(folder))["md"]


def plan_global_batch(workload: Workload, *, model: nn.Module, global_batch: int, world_size: int = 1,
                      multiple_of: int = 1, target_util: float = 0.9, gpu: str | None = None,
                      gpu_memory: str | None = None, options: StepOptions | None = None, mode: str = "estimate",
                      limit: str = "reserved", say: Callable[[str], None] | None = None) -> GlobalBatchPlan:
    """Size the micro-batch (``size_micro_batch``), then split ``global_batch`` with it."""
    if global_batch < 1 or world_size < 1:
        raise OptionError(f"global_batch and the number of devices must be 1 or more, got {global_batch} "
                          f"and {world_size}")
    sizing = size_micro_batch(workload, model=model, max_batch=math.ceil(global_batch / world_size),
                              multiple_of=multiple_of, target_util=target_util, gpu=gpu, gpu_memory=gpu_memory,
                              options=options, mode=mode, limit=limit, say=say)
    if sizing.micro_batch < 1:
        raise OptionError(f"not even a micro-batch of {multiple_of} fits {target_util:.0%} of {sizing.device_name} "
                          f"({sizing.source}): lower the memory of a sample (bf16-mixed precision, activation "
                          "checkpointing), or name a larger GPU (gpu='h100-80gb')")
    micro, accumulation = divide_global_batch(global_batch, sizing.micro_batch, world_size=world_size,
                                             multiple_of=multiple_of)
    return GlobalBatchPlan(global_batch, world_size, micro, accumulation, sizing)
