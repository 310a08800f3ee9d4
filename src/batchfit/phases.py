"""The phases of a training step, in order, and what a tensor made in each one is called.

One place for the names: the step announces them, the tracer labels memory by them, the
curve fits one line per phase and the reports print them. Pure Python, no torch.
"""

from __future__ import annotations

PHASES: tuple[str, ...] = ("inputs", "generate", "reference", "forward", "backward", "optimizer")
"""What the step enters, in order ('generate' only for workloads with a generation phase,
'reference' only for those that score the generated batch with no gradients: RL's reference
log-probs)."""

UPDATE_PHASES: tuple[str, ...] = ("forward", "backward", "optimizer")
"""The phases of the update itself: an RL step's 'train update' is the largest of these."""

IDLE = "idle"
"""Announced when the step is done."""

SETUP = "setup"
"""Before the first step: building the model and optimizer."""

CATEGORY_OF_PHASE: dict[str, str] = {
    "inputs": "inputs", "generate": "generation", "reference": "generation", "forward": "activations",
    "backward": "temporaries", "optimizer": "temporaries", IDLE: "temporaries", SETUP: "other",
}
"""The breakdown category of a tensor no one owns (not a parameter, gradient or state)."""

RL_PHASES: dict[str, str] = {"generate": "generation", "reference": "reference log-probs", "update": "train update"}
"""An RL step's phases as its outputs name them: generation, the no-gradient scoring pass, the update."""


def rl_phase_peaks(peak_by_phase: dict[str, int]) -> dict[str, int] | None:
    """Each RL phase's peak (:data:`RL_PHASES`; the update: the largest of :data:`UPDATE_PHASES`), from a
    traced step's peaks by phase; None for a step with no generation phase."""
    if "generate" not in peak_by_phase:
        return None
    peaks = {name: peak_by_phase[name] for name in ("generate", "reference") if name in peak_by_phase}
    peaks["update"] = max(peak_by_phase.get(name, 0) for name in UPDATE_PHASES)
    return peaks


def deciding_rl_phase(peaks: dict[str, int]) -> str:
    """The phase whose peak is the step's (the first of the largest, in the step's order)."""
    return max(peaks, key=lambda name: peaks[name])
