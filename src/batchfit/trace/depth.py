"""Trace a deep model at three small depths and extrapolate to its full depth, exactly.

A model whose main stack is ``L`` identical blocks (every transformer) holds, at each phase's
peak, a fixed part (embeddings, head, logits, the loss) plus ``L`` times what one block adds
(its parameters, gradients, optimizer state, saved activations). So the peak of each part of
each phase (before the blocks, in the first, in the last, after them: ``memory.PARTS``), and
each category of its breakdown, is affine in ``L``; the phase's peak is the largest part's
(a single line per phase is not enough: which part peaks changes with depth). Tracing a 32-layer model is 32 layers'
worth of fake-tensor dispatch; tracing it at depths 2, 3 and 4 is 9, and gives the same
bytes at depth 32 when the three depths lie on one line, which is checked, byte for byte,
for every phase and category. When they do not (a model whose blocks differ in what they
keep), the caller traces the full model instead.

Two depths always fit a line, the third shows that it is one. The depths start at 2, not 1,
because the allocation streams of the same three traces also give the full model's stream
(``trace/stream.py``), which needs every loop over the blocks to have an interior copy.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, TypeVar

from batchfit.workload import Workload

if TYPE_CHECKING:  # extrapolating cached points needs no torch: only cutting a model does
    from torch import nn

Point = TypeVar("Point")  # a trace.point.MemoryPoint

DEPTHS: tuple[int, int, int] = (2, 3, 4)
MIN_BLOCKS = 10
"""Below this many blocks the full trace is about as cheap as the three shallow ones (9 blocks)."""


class Depth:
    """What building a truncated model learnt about the full one."""

    def __init__(self) -> None:
        self.blocks: int | None = None
        """Blocks in the full model's main stack; None when it has no stack of identical blocks."""
        self.cuts: dict[int, tuple[int, int]] = {}
        """By depth: the tracker's events (start, end) that freed the blocks cut away, which a
        model built at that depth would never have allocated (``stream.without_cut``)."""


def identical_blocks(model: nn.Module) -> nn.ModuleList | None:
    """The main stack when its blocks are one class with parameters of the same shapes."""
    from batchfit.train.model import block_list

    blocks = block_list(model)
    if blocks is None:
        return None
    shapes = {tuple((name, tuple(p.shape), p.dtype) for name, p in block.named_parameters()) for block in blocks}
    return blocks if len(shapes) == 1 else None


def at_depth(workload: Workload, depth: int, seen: Depth) -> Workload:
    """The same workload with only the first ``depth`` blocks of its main stack.

    The model is built whole and cut (building on fake tensors costs no memory), so any
    model with a ModuleList of identical blocks works, HF and user models alike.
    """

    def build_model() -> nn.Module:
        from batchfit.trace.memory import active_tracker

        model = workload.build_model()
        blocks = identical_blocks(model)
        seen.blocks = len(blocks) if blocks is not None else None
        if blocks is not None and len(blocks) >= MIN_BLOCKS:
            tracker = active_tracker()
            start = len(tracker.events) if tracker else 0
            del blocks[depth:]
            blocks._batchfit_cut = True  # the stack the tracker cuts phases by (train.model.main_blocks)
            if tracker is not None:
                seen.cuts[depth] = (start, len(tracker.events))
        return model

    return replace(workload, build_model=build_model)


HOST_FIGURES = ("host_peak_bytes", "host_reserved_bytes", "offloaded_bytes")
"""The host account of a traced point (``--offload``), extrapolated as the device's is."""


def line_at(values: list[int], depth: int) -> int | None:
    """The value at ``depth`` of the line through the values at ``DEPTHS``; None if they are
    not on one."""
    v1, v2, v3 = values
    if v3 - v2 != v2 - v1:
        return None
    return v1 + (depth - DEPTHS[0]) * (v2 - v1)


def _phase_lines(points: list[Point], phase: str, depth: int) -> tuple[int, dict[str, int]] | None:
    """(peak, breakdown) of ``phase`` at ``depth``: the largest of its parts (``memory.PARTS``).

    A phase that runs over the blocks can peak in any of its parts, and which one changes with
    depth: the backward of a shallow model peaks at its start (the logits' gradient), of a
    deep one in its last block (all the gradients made). Before the blocks, in the first, in
    the last and after them are each on a line through depths 2, 3, 4. The blocks between
    hold what the block before held plus a constant step, so the largest of them is the
    second or the one before the last; each is the first (the last) plus a difference that
    does not change with depth, checked at depths 3 and 4, category by category."""
    mine = [{k.split(":")[1]: k for k in p.peak_by_part if k.startswith(f"{phase}:")} for p in points]
    if not any(mine):  # a tracer that does not cut phases (a stand-in): the phase on one line
        peak = line_at([p.peak_by_phase[phase] for p in points], depth)
        breakdown = {c: line_at([p.breakdown_by_phase[phase].get(c, 0) for p in points], depth)
                     for c in points[0].breakdown_by_phase[phase]}
        return None if peak is None or None in breakdown.values() else (peak, breakdown)
    if any("repeated" in keys for keys in mine):
        return None  # generation: each run of the stack holds more cache, no line through depths says where it peaks
    lines = set(mine[0]) - {"second", "penultimate"}
    for p, keys in zip(points, mine):
        if set(keys) - {"second", "penultimate"} != lines or max(p.peak_by_part[k] for k in keys.values()) \
                != p.peak_by_phase[phase]:
            return None
    candidates = []
    for part in lines:
        key = f"{phase}:{part}"
        peak = line_at([p.peak_by_part[key] for p in points], depth)
        categories = points[0].breakdown_by_part[key]
        breakdown = {c: line_at([p.breakdown_by_part[key].get(c, 0) for p in points], depth) for c in categories}
        if peak is None or None in breakdown.values():
            return None
        candidates.append((peak, breakdown))
        for inner, outer in (("second", "first"), ("penultimate", "last")):
            if part != outer or not any(inner in keys for keys in mine):
                continue
            if not all(inner in keys for keys in mine[1:]):  # at depths 3 and 4
                return None
            steps = [(p.peak_by_part[f"{phase}:{inner}"] - p.peak_by_part[key],
                      {c: p.breakdown_by_part[f"{phase}:{inner}"].get(c, 0) - p.breakdown_by_part[key].get(c, 0)
                       for c in categories}) for p in points[1:]]
            if steps[0] != steps[1]:
                return None
            candidates.append((peak + steps[0][0], {c: breakdown[c] + steps[0][1][c] for c in categories}))
    return max(candidates, key=lambda candidate: candidate[0])


def stack_repeats(points: list[Point]) -> bool:
    """Whether a phase ran the stack more than once (``memory.PARTS``' "repeated": generation with
    a growing cache): then no batch size extrapolates, whatever its size."""
    return any(key.endswith(":repeated") for p in points for key in p.peak_by_part)


def extrapolate(points: list[Point], depth: int) -> Point | None:
    """The point at ``depth`` from points traced at ``DEPTHS``, or None when memory is
    not exactly affine in depth (then trace the full model).

    Each phase's peak, and the breakdown at it, is the largest of its parts' lines
    (:func:`_phase_lines`); the step's peak is the largest phase at ``depth``, which need not
    be the largest at depth 3 (a deep model's optimizer step outgrows the backward's logits).
    """
    phases = list(points[0].peak_by_phase)  # in the traced order: a set's order changes from run to run
    if any(set(p.peak_by_phase) != set(phases) or set(p.breakdown_by_phase) != set(phases) for p in points):
        return None
    by_phase, breakdown_by_phase = {}, {}
    for phase in phases:
        found = _phase_lines(points, phase, depth)
        if found is None:
            return None
        by_phase[phase], breakdown_by_phase[phase] = found
    phase = max(by_phase, key=by_phase.get)
    # --offload's host account: each block adds the same host blocks (of the same sizes), so the
    # host bytes, the pinned allocator's cache and the bytes copied lie on lines too, or not at all
    host = {name: line_at([getattr(p, name, 0) for p in points], depth)
            for name in HOST_FIGURES if hasattr(points[0], name)}
    paged = line_at([getattr(p, "paged_bytes", 0) for p in points], depth)  # bitsandbytes' paged optimizer state
    if None in host.values() or paged is None:
        return None
    # the largest tensors of the deepest trace: one block's tensors have the same sizes at any depth
    return replace(points[-1], peak_bytes=by_phase[phase], phase=phase, breakdown=breakdown_by_phase[phase],
                   peak_by_phase=by_phase, breakdown_by_phase=breakdown_by_phase, peak_by_part={},
                   breakdown_by_part={}, **host,
                   **({"paged_bytes": paged} if hasattr(points[-1], "paged_bytes") else {}))
