"""One probe: a fresh model and optimizer, a few real steps at one batch size, a Trial.

Devices: ``cuda`` / ``cuda:N`` (real: peak statistics reset per probe), ``virtual:<gpu>``
or ``virtual:<size>`` (the traced step with the GPU's usable capacity; it raises
``torch.OutOfMemoryError`` past it, so the search cannot tell it from a real GPU) and
``cpu`` (real steps, for development: no memory figures).

A failed probe is cleaned up *outside* its ``except`` block: the exception's traceback holds
the frames of the failed step, and through them its model, optimizer and activations, so
memory can only be freed once the exception is gone (Lightning's batch finder frees inside
``except`` and keeps them alive).
"""

from __future__ import annotations

import gc
import math
import multiprocessing
import time
from dataclasses import dataclass

import torch

from batchfit.devices import Device, detect_cuda_device, get_device, parse_size, custom_device
from batchfit.errors import OptionError, UsageError
from batchfit.estimate import allocated_point
from batchfit.probe.oom import NonFiniteLoss, classify, describe
from batchfit.search import Trial
from batchfit.step import TrainingStep
from batchfit.trace.session import TraceSession
from batchfit.workload import StepOptions, Workload

DEVICE_HELP = "cuda, cuda:N, cpu, virtual:<gpu> (e.g. virtual:h100-80gb) or virtual:<size> (e.g. virtual:24GiB)"


@dataclass(frozen=True)
class Target:
    """Where probes run."""

    kind: str
    """cuda, virtual or cpu."""
    device: Device | None
    """The GPU (catalog entry, custom capacity or the real one); None on cpu."""
    spec: str
    """As the user typed it, so an isolated probe can rebuild it."""
    index: int = 0

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", self.index) if self.kind == "cuda" else torch.device("cpu")


def parse_target(text: str) -> Target:
    """'cuda', 'cuda:1', 'cpu', 'virtual:rtx4090-24gb', 'virtual:48GiB'."""
    kind, _, rest = text.strip().partition(":")
    if kind == "virtual":
        if not rest:
            raise OptionError("--device virtual needs a GPU: e.g. virtual:h100-80gb or virtual:24GiB")
        device = custom_device(parse_size(rest)) if rest[0].isdigit() else get_device(rest)
        return Target("virtual", device, text)
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda, but no CUDA device is visible here: use virtual:<gpu> to "
                             "probe a traced GPU (e.g. virtual:h100-80gb)")
        index = int(rest) if rest.isdigit() else 0
        return Target("cuda", detect_cuda_device(index), text, index)
    if kind == "cpu" and not rest:
        return Target("cpu", None, text)
    raise OptionError(f"unknown --device '{text}': use {DEVICE_HELP}")


def _run_steps(workload: Workload, options: StepOptions, target: Target, batch_size: int,
               steps: int, stop_on_nan: bool) -> Trial:
    if target.kind == "virtual":
        device = target.device
        with TraceSession(workload, options, capacity_bytes=device.usable_bytes - device.workspace_bytes) as session:
            point = allocated_point(session.trace(batch_size), device.workspace_bytes)
        return Trial(batch_size, "ok", peak_allocated_bytes=point.peak_bytes)
    cuda = target.kind == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(target.index)
    step = TrainingStep(workload, options, target.torch_device)
    times, loss_value = [], None
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize(target.index)
        started = time.perf_counter()
        loss = step.run(batch_size)
        loss_value = float(loss)  # waits for the step on a GPU
        if cuda:
            torch.cuda.synchronize(target.index)
        times.append(time.perf_counter() - started)
        if stop_on_nan and not math.isfinite(loss_value):
            raise NonFiniteLoss(f"the loss is {loss_value} at batch size {batch_size}")
    return Trial(
        batch_size, "ok",
        peak_allocated_bytes=torch.cuda.max_memory_allocated(target.index) if cuda else None,
        peak_reserved_bytes=torch.cuda.max_memory_reserved(target.index) if cuda else None,
        step_time_s=times[-1],  # the last step: the first carries one-off costs (cuBLAS, kernels)
        loss=loss_value,
    )


def release(target: Target) -> None:
    """Give the memory of a finished probe back: collect cycles, empty the CUDA cache."""
    gc.collect()
    if target.kind == "cuda":
        torch.cuda.empty_cache()


def probe_once(workload: Workload, options: StepOptions, target: Target, batch_size: int, *,
               steps: int = 2, stop_on_nan: bool = False) -> Trial:
    """Run ``steps`` training steps at ``batch_size``; never raises for OOM or a failed step."""
    try:
        trial = _run_steps(workload, options, target, batch_size, steps, stop_on_nan)
    except Exception as error:  # noqa: BLE001 - every failure becomes a Trial, classified
        trial = Trial(batch_size, classify(error), error=describe(error))
    # Out of the except block: the exception and its traceback are gone, so the failed
    # step's tensors can be freed now.
    release(target)
    return trial


def _isolated_child(connection, spec: str, seq_len: int | None, options: dict, target_spec: str,
                    batch_size: int, steps: int, stop_on_nan: bool) -> None:
    from batchfit.specs import load_workload

    workload = load_workload(spec, seq_len=seq_len)
    trial = probe_once(workload, StepOptions(**options), parse_target(target_spec), batch_size,
                       steps=steps, stop_on_nan=stop_on_nan)
    connection.send(trial.to_json())


def probe_isolated(spec: str, seq_len: int | None, options: StepOptions, target: Target, batch_size: int, *,
                   steps: int = 2, stop_on_nan: bool = False) -> Trial:
    """The same probe in a fresh spawned process: a crashed or fragmented allocator cannot
    poison the next probe. The workload is rebuilt there from its MODEL spec."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_isolated_child, args=(send, spec, seq_len, options.to_json(), target.spec,
                                                          batch_size, steps, stop_on_nan))
    child.start()
    send.close()
    try:
        data = receive.recv()
    except EOFError:
        data = None
    child.join()
    if data is None:
        return Trial(batch_size, "error", error=f"the probe process died (exit code {child.exitcode})")
    return Trial(**data)
