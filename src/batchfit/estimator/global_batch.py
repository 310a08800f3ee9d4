"""``estimate --global-batch N``: the micro-batch and accumulation steps for N samples per step on
one device, by plan's rule (``search.choose_micro``): the largest micro-batch that divides N
(a multiple of the batch multiple) whose traced peak is under the target utilisation.

Each candidate is traced with the accumulation it would run with (N / micro-batch): under
accumulation the gradients of the first micro-batch stay alive through the second's forward,
so a micro-batch that fits alone may not fit accumulating. The search starts from the largest
candidate the step's curve without accumulation puts under the target (accumulation only adds
memory) and goes down, one traced size at a time.

Where the step writes micro-batches 3..N as repeats of the second (``MemoryTracker.
repeat_micro_batch``: most recipes), tracing N accumulation steps costs two micro-batches. Where
it runs every one (quantized layers, offload, compiled or MoE-routed steps, float8: untried
there), N micro-batches at every candidate would cost minutes, so the candidates are traced
with two, the first micro-batch's gradients alive through the second: the split says so
(``traced_accumulation_steps``) and the later micro-batches' peak is taken as the second's.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from batchfit.errors import OptionError
from batchfit.search import check_size, choose_micro, micro_candidates
from batchfit.trace.point import MemoryPoint, TracedCurve, host_fits
from batchfit.workload import StepOptions


@dataclass(kw_only=True)
class GlobalBatchSplit:
    """How a global batch is reached on one device."""

    global_batch: int
    """Samples per optimizer step asked for (--global-batch)."""
    micro_batch: int | None
    """The chosen micro-batch; None when no candidate fits the device."""
    accumulation_steps: int | None
    """global_batch / micro_batch."""
    peak_bytes: int | None = None
    """Traced peak allocated at the micro-batch, with its accumulation."""
    peak_reserved_bytes: int | None = None
    """Reserved peak there (allocator model), under --limit reserved."""
    above_target: bool = False
    """No candidate is under the target utilisation: the smallest, which fits the device."""
    traced_accumulation_steps: int | None = None
    """The accumulation the micro-batch was traced with: ``accumulation_steps``, or 2 where the
    step runs every micro-batch (micro-batches 3..N taken as the second)."""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def line(self, target_util: float) -> str:
        """One line for the terminal and report.md."""
        if self.micro_batch is None:
            return (f"global batch {self.global_batch}: no micro-batch that divides it fits this GPU, "
                    "even with accumulation")
        held = (f"reserved {self.peak_reserved_bytes / 2**30:.2f} GiB" if self.peak_reserved_bytes is not None
                else f"allocated {self.peak_bytes / 2**30:.2f} GiB")
        where = f"above the {target_util:.0%} target" if self.above_target else f"under {target_util:.0%}"
        traced = ("traced with that accumulation" if self.traced_accumulation_steps == self.accumulation_steps
                  else f"traced with {self.traced_accumulation_steps} accumulation steps, the later micro-batches "
                       "taken as the second")
        return (f"global batch {self.global_batch} = micro-batch {self.micro_batch} x {self.accumulation_steps} "
                f"accumulation steps ({held}, {where}; {traced})")


def check_global_batch(global_batch: int | None, multiple_of: int, options: StepOptions) -> None:
    """One-line errors before anything is traced."""
    if global_batch is None:
        return
    if global_batch < 1:
        raise OptionError(f"`global_batch` must be 1 or more, e.g. 64; got {global_batch}")
    check_size("`global_batch`", global_batch)
    if options.accumulation_steps != 1:
        raise OptionError("`global_batch` chooses the accumulation steps itself (micro-batch x accumulation = "
                          "global batch): drop `accumulation_steps`")
    if global_batch % multiple_of:
        near = max(multiple_of, round(global_batch / multiple_of) * multiple_of)
        raise OptionError(f"`global_batch` {global_batch} cannot be made of micro-batches that are multiples of "
                          f"{multiple_of} (the batch multiple): use a multiple of {multiple_of}, e.g. "
                          f"`global_batch` {near}")


def split_global_batch(main: TracedCurve, at_accumulation: Callable[[int], TracedCurve], *, global_batch: int,
                       max_local: int, multiple_of: int, target_bytes: int, capacity_bytes: int, limit: str,
                       host_limit_bytes: int | None) -> GlobalBatchSplit:
    """The split of ``global_batch`` whose micro-batch is at most ``max_local`` (the largest batch
    that fits without accumulation). ``main`` is the curve traced without accumulation;
    ``at_accumulation(k)`` opens one traced with ``k`` steps (closed by the caller)."""
    candidates = micro_candidates(global_batch, max_local, multiple_of)
    if not candidates:
        return GlobalBatchSplit(global_batch=global_batch, micro_batch=None, accumulation_steps=None)
    curves: dict[int, TracedCurve] = {1: main}
    repeats = main.repeats_micro_batches  # the same rule at any accumulation (trace/session.py)

    def traced_steps(micro: int) -> int:
        steps = global_batch // micro
        return steps if repeats else min(steps, 2)

    def point(micro: int) -> MemoryPoint:
        steps = traced_steps(micro)
        if steps not in curves:
            curves[steps] = at_accumulation(steps)
        curve = curves[steps]
        return curve.reserved(micro) if limit == "reserved" else curve.point(micro)

    def fits(micro: int, limit_bytes: int) -> bool:
        p = point(micro)
        held = p.peak_bytes if limit == "allocated" else (p.peak_reserved_bytes if p.reserved_oom is None else None)
        return held is not None and held <= limit_bytes and host_fits(p, host_limit_bytes)

    chosen = choose_micro(candidates, main.curve().peak_bytes, target_bytes, lambda m: fits(m, target_bytes))
    if not fits(chosen, capacity_bytes):
        return GlobalBatchSplit(global_batch=global_batch, micro_batch=None, accumulation_steps=None)
    at = point(chosen)
    return GlobalBatchSplit(global_batch=global_batch, micro_batch=chosen, accumulation_steps=global_batch // chosen,
                            peak_bytes=at.peak_bytes, peak_reserved_bytes=at.peak_reserved_bytes,
                            above_target=not fits(chosen, target_bytes),
                            traced_accumulation_steps=traced_steps(chosen))


@contextlib.contextmanager
def accumulation_curves(open_curve: Callable[[StepOptions], TracedCurve], options: StepOptions):
    """``at_accumulation`` for :func:`split_global_batch`, closing every curve it opened."""
    with contextlib.ExitStack() as stack:
        yield lambda steps: stack.enter_context(open_curve(dataclasses.replace(options, accumulation_steps=steps)))
