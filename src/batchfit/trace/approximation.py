"""Where a traced figure is approximated, said on the result that carries it.

batchfit's rule is to recommend only what was measured or traced; where a recipe is not
traced yet (a compiled model traced as eager, say), the result carries an
:class:`Approximation` and every output (terminal, report.md, JSON) says it, with how far
off it may be and the measurement that says so. No torch here: reports render these.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Approximation:
    """One way a result differs from what it claims to trace."""

    what: str
    """What was approximated, e.g. 'compiled model traced as eager'."""
    may_differ_by: str
    """How far the figure may be off, with where that range was measured."""
    source: str
    """The measurement behind ``may_differ_by`` (a file under benchmarks/results/, or a doc)."""
    detail: str = ""
    """Why it applies to this run, e.g. which modules the workload compiled itself."""

    def line(self) -> str:
        """One line for the terminal and the report."""
        why = f" ({self.detail})" if self.detail else ""
        return f"{self.what}{why}: may differ by {self.may_differ_by} (source: {self.source})"

    def to_json(self) -> dict:
        return asdict(self)
