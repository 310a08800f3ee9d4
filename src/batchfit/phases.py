"""The phases of a training step, in order, and what a tensor made in each one is called.

One place for the names: the step announces them, the tracer labels memory by them, the
curve fits one line per phase and the reports print them. Pure Python, no torch.
"""

from __future__ import annotations

PHASES: tuple[str, ...] = ("inputs", "generate", "forward", "backward", "optimizer")
"""What the step enters, in order ('generate' only for workloads with a generation phase)."""

IDLE = "idle"
"""Announced when the step is done."""

SETUP = "setup"
"""Before the first step: building the model and optimizer."""

CATEGORY_OF_PHASE: dict[str, str] = {
    "inputs": "inputs", "generate": "generation", "forward": "activations", "backward": "temporaries",
    "optimizer": "temporaries", IDLE: "temporaries", SETUP: "other",
}
"""The breakdown category of a tensor no one owns (not a parameter, gradient or state)."""
