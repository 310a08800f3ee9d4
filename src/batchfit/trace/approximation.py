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


def fast_path_approximations(model) -> list[Approximation]:
    """nn.TransformerEncoderLayer and nn.MultiheadAttention in eval mode take PyTorch's fused "fast
    path" on real tensors (no gradient needed: a frozen encoder), which refuses tensor subclasses:
    the trace runs the standard layers instead. Say so wherever such a module is in eval mode."""
    from torch import nn

    names = [name or type(module).__name__ for name, module in model.named_modules()
             if isinstance(module, (nn.TransformerEncoderLayer, nn.MultiheadAttention)) and not module.training]
    if not names:
        return []
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return [Approximation(
        what="eval-mode nn.TransformerEncoderLayer / nn.MultiheadAttention traced on the standard path, "
             "not PyTorch's fused fast path",
        may_differ_by="about -12% of peak (a frozen eval-mode encoder on a CPU: 1,019,400 B traced, "
                      "1,158,664 B measured); keep it in train mode to be traced exactly",
        source="docs/tracing.md, Code that reads tensor values", detail=f"in eval mode: {shown}")]


def quantize_approximations(quantize: str) -> list[Approximation]:
    """--quantize int8 on CUDA trains through ``MatMul8bitLt`` (the input quantized to int8 by rows,
    an int8 matmul, the outlier columns above 6.0 in fp16, whose count depends on the values);
    a CPU tensor, fake ones included, takes ``MatMul8bitFp`` (the weight dequantized to the
    input's dtype, then a plain matmul): the trace runs the CPU path and says so."""
    if quantize != "int8":
        return []
    return [Approximation(
        what="--quantize int8 traced on bitsandbytes' CPU path (MatMul8bitFp), not CUDA's MatMul8bitLt",
        may_differ_by="the int8 copy of each layer's input and its outlier columns (value-dependent), "
                      "not yet measured on a GPU; nf4/fp4 are traced as CUDA runs them",
        source="docs/tracing.md, QLoRA and 8-bit optimizers")]
