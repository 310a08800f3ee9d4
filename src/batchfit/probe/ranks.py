"""Several GPUs under torchrun: every rank probes, and the ranks agree.

One rank's out-of-memory is everyone's: after each probe the ranks all-reduce the worst
status (ok < oom < error) and the largest peaks, so every rank sees the same Trial and the
policy makes the same next choice on every rank. Every rank reaches every collective (a
failed probe is a Trial, not an exception), so a failure cannot deadlock the others.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from batchfit.search import Trial

_STATUS = ("ok", "oom", "error")


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_ranks(cuda: bool) -> None:
    """Join the process group torchrun set up (gloo on CPU and virtual devices, nccl on CUDA)."""
    if world_size() > 1 and dist.is_available() and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def _reduce(values: list[int], op) -> list[int]:
    backend_cuda = dist.get_backend() == "nccl"
    tensor = torch.tensor(values, dtype=torch.int64, device="cuda" if backend_cuda else "cpu")
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
