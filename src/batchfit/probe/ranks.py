"""Several GPUs under torchrun: every rank probes, and the ranks agree.

One rank's out-of-memory is everyone's: after each probe the ranks all-reduce the worst
status (ok < oom < error) and the largest peaks, so every rank sees the same Trial and the
policy makes the same next choice on every rank. Every rank reaches every collective (a
failed probe is a Trial, not an exception), so a failure cannot deadlock the others.

On CUDA each rank owns the GPU torchrun gave it, ``cuda:LOCAL_RANK``: it is made the current
device and named to the NCCL group (``device_id``), so no rank's collectives, caches or
probes land on cuda:0 by default.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from batchfit.devices import detect_cuda_device
from batchfit.errors import OptionError
from batchfit.search import Trial
from batchfit.targets import Target

_STATUS = ("ok", "oom", "error")


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_rank() -> int:
    """This process's GPU on its node, as torchrun numbers them."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_target(target: Target) -> Target:
    """``target`` as this rank runs it: under torchrun, ``cuda`` means ``cuda:LOCAL_RANK``.

    The target is parsed before the ranks are known (the same grammar for every command);
    this is the one place the rank's index is applied.
    """
    if target.kind != "cuda" or world_size() <= 1:
        return target
    index = local_rank()
    if target.spec not in ("cuda", f"cuda:{index}"):
        raise OptionError(f"`device` {target.spec} under torchrun: each rank uses its own GPU, "
                          f"cuda:LOCAL_RANK (here cuda:{index}): pass `device` cuda")
    visible = torch.cuda.device_count()
    if index >= visible:
        raise OptionError(f"LOCAL_RANK is {index} but this process sees {visible} CUDA device(s): "
                          "launch at most that many ranks per node (torchrun --nproc-per-node) "
                          "and do not narrow CUDA_VISIBLE_DEVICES per rank")
    return Target("cuda", detect_cuda_device(index), f"cuda:{index}", index)


def init_ranks(cuda: bool) -> None:
    """Join the process group torchrun set up (gloo on CPU and virtual devices, nccl on CUDA).

    On CUDA the rank's GPU becomes the current device first: NCCL binds each communicator
    to the current device, and without it every rank would put its communicator (and the
    all-reduce buffers of :func:`agree`) on cuda:0.
    """
    if world_size() <= 1 or not dist.is_available():
        return
    if cuda:
        torch.cuda.set_device(local_rank())
    if not dist.is_initialized():
        if cuda:
            # device_id binds the group to this GPU now (eager NCCL init) instead of guessing
            # it at the first collective.
            dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank()))
        else:
            dist.init_process_group("gloo")


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def _reduce(values: list[int], op) -> list[int]:
    # NCCL reduces only tensors on the rank's own GPU; gloo, CPU tensors.
    device = torch.device("cuda", local_rank()) if dist.get_backend() == "nccl" else torch.device("cpu")
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def agree(trial: Trial) -> Trial:
    """The trial every rank will see: the worst status, the largest peaks."""
    if not active():
        return trial
    code, allocated, reserved = _reduce(
        [_STATUS.index(trial.status), trial.peak_allocated_bytes or 0, trial.peak_reserved_bytes or 0],
        dist.ReduceOp.MAX)
    status = _STATUS[code]
    error = trial.error if trial.status == status else f"{status} on another rank"
    return Trial(trial.batch_size, status, peak_allocated_bytes=allocated or None,
                 peak_reserved_bytes=reserved or None, step_time_s=trial.step_time_s, loss=trial.loss,
                 error=None if status == "ok" else error, predicted_bytes=trial.predicted_bytes)


def agree_min(value: int) -> int:
    """The smallest of the ranks' values (predictions), so all ranks probe the same size."""
    return _reduce([value], dist.ReduceOp.MIN)[0] if active() else value
