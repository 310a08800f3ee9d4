"""One probe: a fresh model and optimizer, a few real steps at one batch size, a Trial.

Devices: ``cuda`` / ``cuda:N`` (real: peak statistics reset per probe), ``virtual:<gpu>``
or ``virtual:<size>`` (the traced step with the GPU's usable capacity; it raises
``torch.OutOfMemoryError`` where the caching allocator could not reserve a segment after
freeing its cache (``limit='reserved'``, as a GPU runs out) or where allocated bytes pass
the capacity (``limit='allocated'``), so the search cannot tell it from a real GPU) and
``cpu`` sized for a GPU (``--device cpu --gpu t4-16gb``: the virtual device's memory check,
then real CPU steps for the time and loss). A bare ``cpu`` (real steps, no memory figures)
has nothing to run out of: the search is then bounded by its cap alone.

A failed probe is cleaned up *outside* its ``except`` block: the exception's traceback holds
the frames of the failed step, and through them its model, optimizer and activations, so
memory can only be freed once the exception is gone (Lightning's batch finder frees inside
``except`` and keeps them alive).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable

from torch import nn

from batchfit.devices import Device
from batchfit.search import Trial
from batchfit.targets import Target
from batchfit.trace.point import allocated_point, run_out_at_reserved
from batchfit.trace.session import TraceSession
from batchfit.train.oom import classify, describe
from batchfit.train.step import TrainingStep
from batchfit.train.timing import run_timed_steps
from batchfit.workload import StepOptions, Workload

DEFAULT_ISOLATED_TIMEOUT_S = 1800.0


def _traced(workload: Workload, options: StepOptions, device: Device, batch_size: int, limit: str) -> Trial:
    """The virtual device: the step traced with ``device``'s usable capacity (raises
    ``torch.OutOfMemoryError`` where it runs out)."""
    if limit == "reserved":  # out of memory where the caching allocator cannot reserve a segment
        with TraceSession(workload, options) as session:
            allocator = run_out_at_reserved(session, device)
            point = allocated_point(session.trace(batch_size), device.workspace_bytes)
        return Trial(batch_size, "ok", peak_allocated_bytes=point.peak_bytes,
                     peak_reserved_bytes=allocator.stats.peak_reserved_bytes)
    with TraceSession(workload, options, capacity_bytes=device.usable_bytes - device.workspace_bytes) as session:
        point = allocated_point(session.trace(batch_size), device.workspace_bytes)
    return Trial(batch_size, "ok", peak_allocated_bytes=point.peak_bytes)


def _run_steps(workload: Workload, options: StepOptions, target: Target, batch_size: int,
               steps: int, stop_on_nan: bool, limit: str, wrap: Callable[[nn.Module], nn.Module] | None) -> Trial:
    if target.kind == "virtual":
        return _traced(workload, options, target.device, batch_size, limit)
    # cpu sized for a GPU: that GPU's memory decides first, then the CPU runs the step for real.
    sized = target.kind == "cpu" and target.device is not None
    traced = _traced(workload, options, target.device, batch_size, limit) if sized else None
    step = TrainingStep(workload, options, target.torch_device, wrap=wrap)
    # The first step carries one-off costs (cuBLAS handles, kernel loading): time the last.
    timed = run_timed_steps(step, batch_size, steps=1, warmup=steps - 1, stop_on_nan=stop_on_nan)
    memory = traced or timed
    return Trial(batch_size, "ok", peak_allocated_bytes=memory.peak_allocated_bytes,
                 peak_reserved_bytes=memory.peak_reserved_bytes, step_time_s=timed.times_s[-1], loss=timed.loss)


def probe_once(workload: Workload, options: StepOptions, target: Target, batch_size: int, *,
               steps: int = 2, stop_on_nan: bool = False, limit: str = "reserved",
               wrap: Callable[[nn.Module], nn.Module] | None = None) -> Trial:
    """Run ``steps`` training steps at ``batch_size``; never raises for OOM or a failed step.

    ``wrap`` (``batchfit.distributed.wrap.step_wrapper``) makes the model what a multi-GPU run trains."""
    try:
        trial = _run_steps(workload, options, target, batch_size, steps, stop_on_nan, limit, wrap)
    except Exception as error:  # noqa: BLE001 - every failure becomes a Trial, classified
        trial = Trial(batch_size, classify(error), error=describe(error))
    # Out of the except block: the exception and its traceback are gone, so the failed
    # step's tensors can be freed now.
    target.release()
    return trial


def _isolated_child(connection, spec: str, seq_len: int | None, options: dict, target: Target,
                    batch_size: int, steps: int, stop_on_nan: bool, limit: str) -> None:
    try:
        from batchfit.specs import load_workload

        workload = load_workload(spec, seq_len=seq_len)
        trial = probe_once(workload, StepOptions(**options), target, batch_size,
                           steps=steps, stop_on_nan=stop_on_nan, limit=limit)
    except BaseException as error:  # noqa: BLE001 - loading failed: send the reason, not silence
        trial = Trial(batch_size, "error", error=f"in the probe process: {describe(error)}")
    connection.send(trial.to_json())


def probe_isolated(spec: str, seq_len: int | None, options: StepOptions, target: Target, batch_size: int, *,
                   steps: int = 2, stop_on_nan: bool = False, limit: str = "reserved",
                   timeout_s: float = DEFAULT_ISOLATED_TIMEOUT_S) -> Trial:
    """The same probe in a fresh spawned process: a crashed or fragmented allocator cannot
    poison the next probe. The workload is rebuilt there from its MODEL spec. A child that
    dies (a segfault, the kernel's OOM killer) or says nothing for ``timeout_s`` is a failed
    probe with that reason, never a hang."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    # The Target itself, not its spec: 'cpu' sized for a GPU has the GPU only in the object.
    child = context.Process(target=_isolated_child, args=(send, spec, seq_len, options.to_json(), target,
                                                          batch_size, steps, stop_on_nan, limit))
    child.start()
    send.close()
    data, answered = None, False
    try:
        answered = receive.poll(timeout_s)
        data = receive.recv() if answered else None
    except EOFError:  # the child died before it could answer
        pass
    finally:
        child.join(timeout=30 if data is not None else 0.5)
        if child.is_alive():
            child.kill()
            child.join()
    if data is not None:
        return Trial(**data)
    if not answered:
        reason = f"the probe process did not answer within {timeout_s:g} s"
    elif child.exitcode == -9:
        reason = "the probe process was killed (signal 9: the system may have run out of host memory)"
    else:
        reason = f"the probe process died (exit code {child.exitcode})"
    return Trial(batch_size, "error", error=reason)
