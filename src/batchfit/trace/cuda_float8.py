"""What torchao's float8 linears do differently on a CUDA device, mirrored for the trace.

The trace runs torchao's real ``Float8Linear`` and its tensor subclasses (``Float8TrainingTensor``,
``WeightWithDynamicFloat8CastTensor``) on fake CPU tensors; ``torch._scaled_mm`` runs its meta
kernel there (``torch/_meta_registrations.py``: ``meta_scaled_mm``), the same one for a CUDA
tensor, so every float8 buffer, scale and output has the size and dtype CUDA gives it. One thing
differs by device: ``Float8Linear.forward`` (torchao ``float8/float8_linear.py``) asks
``torch.is_autocast_enabled()``, which is CUDA's flag, and then casts its input to
``torch.get_autocast_gpu_dtype()``:

    if torch.is_autocast_enabled():
        autocast_dtype = torch.get_autocast_gpu_dtype()
        input = input.to(autocast_dtype)

Under the trace's autocast (CPU autocast with CUDA's op table, ``trace/cuda_autocast.py``) that
flag is off, so an fp32 input (an RMSNorm's fp32 output, under CUDA autocast) would be kept for
backward in fp32 where a GPU keeps its bf16 copy. :func:`mirror_float8_autocast` makes each float8
linear see CUDA's flag as a GPU run would: on, with the autocast dtype, whenever autocast is on
(the forward, and activation checkpointing's recomputation, which restores autocast as it was), by
making the cast that flag makes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from torch import nn
from torch._subclasses import fake_tensor

from batchfit.trace.approximation import Approximation
from batchfit.train.float8 import float8_linears
from batchfit.workload import FP8_PRECISIONS, StepOptions


def _on_cuda(forward):
    def forward_as_on_cuda(input, *args, **kwargs):
        # What Float8Linear.forward does when CUDA's flag is on: its input to the autocast dtype. Done
        # here rather than by setting CUDA's flag around the call, which dynamo cannot trace inside a
        # checkpointed region (a global-state change in a higher-order op's body).
        if torch.is_autocast_enabled("cpu") and not torch.is_autocast_enabled("cuda"):
            input = input.to(torch.get_autocast_dtype("cpu"))
        return forward(input, *args, **kwargs)

    forward_as_on_cuda.batchfit_float8_mirror = True
    return forward_as_on_cuda


def mirror_float8_autocast(model: nn.Module) -> int:
    """Give each torchao ``Float8Linear`` of ``model`` CUDA's autocast flag while autocast is on;
    returns how many (0 for a model without float8 linears)."""
    linears = float8_linears(model)
    for _, module in linears:
        if not getattr(module.forward, "batchfit_float8_mirror", False):
            module.forward = _on_cuda(module.forward)
    return len(linears)


_PYTORCH_SCALED_MM = torch._scaled_mm
_cpu_scratch_depth = [0]


def _scaled_mm_as_on_cpu(mat_a, mat_b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,
                         use_fast_accum=False, out=None):
    """``torch._scaled_mm`` with what this CPU's kernel allocates inside itself, for fake tensors.

    PyTorch's CPU ``_scaled_mm`` (``aten/src/ATen/native/cpu/Blas.cpp``: ``_scaled_mm_cpu`` ->
    ``_scaled_mm_out_cpu_emulated``, without AMX) emulates the float8 matmul: it allocates the
    output, makes both operands contiguous, upcasts each to fp32 and multiplies it by its scale,
    multiplies in fp32 and casts the product to the output dtype. A dispatch mode sees none of that
    (one op in, one tensor out), and a GPU has none of it (cuBLASLt works in its workspace), so only
    the CPU-semantics trace, the one held to a real CPU step, runs it op by op. ``out``: the out=
    variant inductor's generated code calls (``extern_kernels._scaled_mm``), which writes into a
    buffer the code allocated and allocates the rest alike (``_scaled_mm_out_cpu``)."""
    if not isinstance(mat_a, fake_tensor.FakeTensor):
        return _PYTORCH_SCALED_MM(mat_a, mat_b, scale_a, scale_b, bias=bias, scale_result=scale_result,
                                  out_dtype=out_dtype, use_fast_accum=use_fast_accum,
                                  **({} if out is None else {"out": out}))
    if out is None:
        out = torch.empty((mat_a.shape[0], mat_b.shape[1]), dtype=out_dtype or mat_a.dtype, device=mat_a.device)
    a, b = mat_a.contiguous(), mat_b.contiguous()
    fp32_a = a.to(torch.float32) * scale_a  # the upcast is freed once multiplied, as in at::mul(x.to(kFloat), s)
    fp32_b = b.to(torch.float32) * scale_b
    del a, b
    product = fp32_a @ fp32_b
    del fp32_a, fp32_b
    if bias is not None:
        product.add_(bias)
    product = product.to(out.dtype)
    out.copy_(product)
    return out


@contextlib.contextmanager
def cpu_scaled_mm_scratch() -> Iterator[None]:
    """While entered, a fake ``torch._scaled_mm`` (as torchao calls it) allocates what the CPU
    kernel allocates (:func:`_scaled_mm_as_on_cpu`); real tensors take PyTorch's own kernel."""
    _cpu_scratch_depth[0] += 1
    torch._scaled_mm = _scaled_mm_as_on_cpu
    try:
        yield
    finally:
        _cpu_scratch_depth[0] -= 1
        if not _cpu_scratch_depth[0]:
            torch._scaled_mm = _PYTORCH_SCALED_MM


FLOAT8_COMPILED_TRACED = Approximation(
    what="float8 under --compile: torchao's graphs run as the wrapper code inductor generates on this CPU",
    may_differ_by=("-0.16% to +0.00% of inductor's peak on this CPU (2-layer Llama, batch 4, tensorwise and rowwise, "
                   "--compile model and blocks); for a GPU it is inductor's CPU schedule and fusion of the casts: "
                   "Triton's may differ, not measured here"),
    source="benchmarks/results/float8_compile-2026-11-25.json (python benchmarks/float8_compile.py); "
           "benchmarks/results/recipes-budget-2026-11-26.json (gpt-tinystories-22m: +0.007%); tests/test_float8.py",
)
"""The compiled float8 trace against the same step compiled with inductor on this CPU."""


def float8_approximations(options: StepOptions, *, traced_compiled: bool = False) -> list[Approximation]:
    """What a float8 trace cannot say for sure: it was never held to a GPU run (none was lent), and
    under torch.compile either inductor's CPU code stands for a GPU's (``traced_compiled``: one
    device, ``trace/compiled.py: inductor_plan``), or (plan's sharded steps, traced eager) inductor
    fuses torchao's casts, whose eager temporaries the trace keeps."""
    if options.precision not in FP8_PRECISIONS:
        return []
    found = [Approximation(
        what="float8 matmuls traced with torch._scaled_mm's meta kernel (shapes, dtypes and torchao's own "
             "buffers exact; not yet compared with an H100 run)",
        may_differ_by=("an amount not yet measured on a GPU (cuBLASLt's own workspace for _scaled_mm is not "
                       "counted); the same trace with CPU semantics is within 0.001% of a real CPU step"),
        source="tests/test_float8.py; docs/tracing/float8.md")]
    if options.compile != "none" and traced_compiled:
        from batchfit.trace.compiled import inductor_fallbacks

        found.append(dataclasses.replace(FLOAT8_COMPILED_TRACED,
                                         detail=f"--compile {options.compile}{inductor_fallbacks()}"))
    elif options.compile != "none":
        found.append(Approximation(
            what="torchao's float8 casts traced eager",
            may_differ_by=("+0 to +12 bytes per element of a linear's input or output gradient where they make the "
                           "peak: the cast temporaries (abs, fp32 upcast, scale, clamp) inductor fuses away"),
            source="docs/tracing/float8.md", detail=f"--compile {options.compile}"))
    return found
