"""The memory curve: peak bytes as a function of batch size, from a few traced points.

Each phase of the step (inputs, forward, backward, optimizer) reaches its own peak, and
each phase's peak grows linearly with the batch size at a fixed sequence length: the
optimizer step's is flat (parameters, gradients, state and its scratch), the backward's
grows with the saved activations. The step's peak is the largest of them, so the curve
is the upper envelope of one line per phase: flat at small batches while the optimizer
step dominates, then linear. Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from batchfit.phases import PHASES


@dataclass(frozen=True)
class Line:
    """``fixed_bytes + bytes_per_sample * batch_size``: one phase's peak."""

    phase: str
    fixed_bytes: float
    bytes_per_sample: float

    def at(self, batch_size: float) -> float:
        return self.fixed_bytes + self.bytes_per_sample * batch_size


def fit_line(phase: str, points: list[tuple[int, int]]) -> Line:
    """Least squares through (batch_size, bytes); one point gives a flat line."""
    n = len(points)
    mean_x = sum(b for b, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var_x = sum((b - mean_x) ** 2 for b, _ in points)
    if var_x == 0:
        return Line(phase, mean_y, 0.0)
    slope = sum((b - mean_x) * (y - mean_y) for b, y in points) / var_x
    slope = max(slope, 0.0)  # memory never shrinks with more samples
    return Line(phase, mean_y - slope * mean_x, slope)


def secant(phase: str, points: list[tuple[int, int]]) -> Line:
    """The line through the two largest batch sizes of ``points`` (one point: flat).

    Near the largest batches, not through all of them: at tiny batches the moment a phase
    peaks can differ (fixed costs dominate), which bends a least-squares line fitted from
    batch 1 and 2 by 10% and more at batch 600. The tracer's curve, the probe's measured
    line and its tiers all extrapolate with this one rule.
    """
    return fit_line(phase, sorted(points)[-2:])


@dataclass(frozen=True)
class MemoryCurve:
    """The upper envelope of one line per phase."""

    lines: tuple[Line, ...]

    def peak_bytes(self, batch_size: float) -> float:
        return max(line.at(batch_size) for line in self.lines)

    def dominant(self, batch_size: float) -> Line:
        return max(self.lines, key=lambda line: line.at(batch_size))

    def max_batch_size(self, capacity_bytes: float, multiple_of: int = 1) -> int:
        """Largest multiple of ``multiple_of`` whose predicted peak fits; 0 if none does."""
        best = float("inf")
        for line in self.lines:
            if line.bytes_per_sample > 0:
                best = min(best, (capacity_bytes - line.fixed_bytes) / line.bytes_per_sample)
            elif line.fixed_bytes > capacity_bytes:
                return 0
        if best == float("inf"):
            return 1 << 30  # nothing grows with the batch: any batch fits
        return max(int(best // multiple_of) * multiple_of, 0)

    def pieces(self, up_to_batch: int, multiple_of: int = 1) -> list[dict]:
        """The envelope as segments [from_batch, to_batch] with the phase that dominates each, over the batch sizes
        the step can run (multiples of ``multiple_of``: an RL step's group; seed 003's piece '1-4' was no size)."""
        out: list[dict] = []
        for batch in range(multiple_of, max(up_to_batch, multiple_of) + 1, multiple_of):
            line = self.dominant(batch)
            if out and out[-1]["phase"] == line.phase:
                out[-1]["to_batch"] = batch
            else:
                out.append({"phase": line.phase, "from_batch": batch, "to_batch": batch,
                            "fixed_bytes": round(line.fixed_bytes),
                            "bytes_per_sample": round(line.bytes_per_sample)})
        return out

    def to_json(self, up_to_batch: int, multiple_of: int = 1) -> dict:
        steepest = max(self.lines, key=lambda line: line.bytes_per_sample)
        return {
            "model": "peak(b) = max over phases of fixed_bytes + bytes_per_sample * b",
            "fixed_bytes": round(steepest.fixed_bytes),
            "bytes_per_sample": round(steepest.bytes_per_sample),
            "lines": [asdict(line) for line in self.lines],
            "pieces": self.pieces(up_to_batch, multiple_of),
        }


def fit_curve(points: dict[int, dict[str, int]]) -> MemoryCurve:
    """One line per phase through its two largest traced batch sizes (:func:`secant`)."""
    return envelope({b: {phase: peak for phase, peak in peaks.items() if phase in PHASES}
                     for b, peaks in points.items()})


def envelope(points: dict[int, dict[str, int]]) -> MemoryCurve:
    """The upper envelope of one line per name (a phase; under a pipeline, also a pipeline rank)
    through the two largest batch sizes where that name was traced (:func:`secant`), phases in
    the step's order first.

    The step's peak is the largest of these peaks, each about linear in the batch, so the envelope
    predicts where a line through the step's own peaks cannot: at small batches a flat phase (the
    optimizer step's) is the peak, and the line through two such sizes is flat too (a pipeline's
    predicted 106 samples from sizes 2 and 4 where 32 fit)."""
    names = sorted({name for peaks in points.values() for name in peaks},
                   key=lambda name: (PHASES.index(name) if name in PHASES else len(PHASES), name))
    return MemoryCurve(tuple(secant(name, [(b, peaks[name]) for b, peaks in sorted(points.items()) if name in peaks])
                             for name in names))
