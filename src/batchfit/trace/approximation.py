"""Where a traced figure is approximated, said on the result that carries it.

batchfit's rule is to recommend only what was measured or traced; where a recipe is not
traced yet (a compiled model traced as eager, say), the result carries an
:class:`Approximation` and every output (terminal, report.md, JSON) says it, with how far
off it may be and the measurement that says so. No torch here: reports render these.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from batchfit.options import Offload


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
        source="docs/tracing/value-reads.md", detail=f"in eval mode: {shown}")]


OFFLOAD_STREAMS = Approximation(
    what="--offload activations: the side stream's timing is not traced",
    may_differ_by="up to 5 activations more on the device in the forward, and one autograd node's in the "
                  "backward (the trace keeps torchtune's stash lifetimes, not when each copy lands: a copy "
                  "still in flight holds its tensor longer); the host figure rounds each block to a power of "
                  "two and keeps the allocator's cache per size, as PyTorch's pinned allocator does, but not "
                  "cudaHostAlloc's own page rounding (4 KiB per block)",
    source="docs/tracing/offload.md")
"""What the traced offload cannot see: CUDA streams' timing, the driver's pinned rounding."""

FSDP_CPU_OFFLOAD = Approximation(
    what="--offload params: FSDP2's copies of each shard to the GPU before its all-gather are not counted",
    may_differ_by="one FSDP group's parameter shards on the device while it gathers (its parameters / GPUs, "
                  "in their stored dtype), and the optimizer step's temporaries counted as host memory "
                  "with the foreach path (a CPU step takes the per-parameter loop: less); the CPU optimizer "
                  "step's time is not in the computed step time",
    source="docs/tracing/offload.md, FSDP2 CPU offload")
"""What the trace of FSDP2's CPUOffloadPolicy cannot see (a CPU's .to('cpu') copies nothing)."""


OFFLOAD_COMPILED = Approximation(
    what="--offload activations with --compile: the hooks around AOTAutograd's compiled forward",
    may_differ_by="+1.5% of peak (an 8-layer MLP traced 4,309,000 B against 4,243,464 B under inductor on a "
                  "CPU: four activations more; not explained yet)",
    source="docs/tracing/offload.md")


def offload_approximations(offload: Offload, compile: str = "none") -> list[Approximation]:
    """What a traced step with ``--offload`` (``StepOptions.offload_spec``) approximates."""
    return (([OFFLOAD_STREAMS] if offload.activations else [])
            + ([OFFLOAD_COMPILED] if offload.activations and compile != "none" else [])
            + ([FSDP_CPU_OFFLOAD] if offload.params else []))


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
        source="docs/tracing/quantization.md")]


FLASH_TRACED = Approximation(
    what="--attention flash traced with PyTorch's copy of the FlashAttention-2 kernel, not flash_attn's own",
    may_differ_by="not measured against flash_attn on a GPU (no flash_attn where batchfit is tested); the saved "
                  "tensors are the same kernel's (q, k, v, the output, an fp32 log-sum-exp per row, the RNG state); "
                  "its backward's own scratch (an fp32 dq accumulator, with grouped-query attention dK/dV at Q's "
                  "heads) is not counted, as for SDPA's fused kernels",
    source="docs/tracing/attention.md")


def attention_approximations(attention: str | None) -> list[Approximation]:
    """What a traced step with ``--attention`` (``StepOptions.attention``) approximates: flash only."""
    return [FLASH_TRACED] if attention == "flash" else []
