"""torch.compile and the trace: what is compiled, and what the trace says about it.

Today the traced step runs a compiled model as eager: a dispatch mode is active while
tracing, and dynamo skips frames under one, so the step runs the modules' Python code op by
op. Inductor's run differs (AOTAutograd's min-cut partitioner saves other activations;
fused pointwise kernels never write some buffers), by an amount measured on a GPU. Until
the traced step is the compiled one, every result of a compiled run carries
:data:`COMPILED_AS_EAGER` (docs/tracing.md, "torch.compile").

Compiled is either asked for (``--compile model|blocks``: ``StepOptions.compile``), or done
by the workload itself: ``torch.compile(module)`` returns an ``OptimizedModule``,
``module.compile()`` sets the module's ``_compiled_call_impl``, and
``module.forward = torch.compile(module.forward)`` leaves a function that dynamo marks with
``_torchdynamo_orig_callable`` (so does a compiled ``loss_fn``).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from batchfit.trace.approximation import Approximation
from batchfit.workload import StepOptions, Workload

VALIDATION = "benchmarks/results/validate_gpu_compile-2026-11-24.json"

COMPILED_AS_EAGER = Approximation(
    what="compiled model traced as eager",
    may_differ_by=("-7% to +14% of the compiled run's peak allocated (this trace vs torch.compile with inductor; "
                   "compiled vs eager: -6% to +8%; H100, bf16-mixed, 3 models)"),
    source=VALIDATION,
)
"""The eager trace against the compiled step measured on an H100 (``traced_eager_vs_compiled``
and ``compiled_vs_eager`` in :data:`VALIDATION`; ``tests/test_compile.py`` checks the figures)."""


def _is_compiled_fn(fn: Any) -> bool:
    return callable(fn) and hasattr(fn, "_torchdynamo_orig_callable")


def compiled_parts(model: nn.Module, loss_fn: Any = None) -> list[str]:
    """The names of what the workload compiled itself: modules ('model' for the root, else
    their path) and 'loss_fn'. Empty for an eager workload."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing was compiled
    optimized = eval_frame.OptimizedModule if eval_frame is not None else ()
    found = []
    for name, module in model.named_modules():
        if (isinstance(module, optimized)
                or getattr(module, "_compiled_call_impl", None) is not None
                or _is_compiled_fn(module.__dict__.get("forward"))):
            found.append(name or "model")
    if _is_compiled_fn(loss_fn):
        found.append("loss_fn")
    return found


def _summary(parts: list[str]) -> str:
    shown = ", ".join(parts[:3]) + (f" and {len(parts) - 3} more" if len(parts) > 3 else "")
    return f"the workload calls torch.compile itself, on {shown}"


def compile_approximations(options: StepOptions, model: nn.Module, loss_fn: Any = None) -> list[Approximation]:
    """What a traced step of ``model`` under ``options`` approximates about torch.compile."""
    parts = compiled_parts(model, loss_fn)
    if options.compile != "none":
        detail = f"--compile {options.compile}" + (f"; {_summary(parts)}" if parts else "")
    elif parts:
        detail = _summary(parts)
    else:
        return []
    return [Approximation(**{**COMPILED_AS_EAGER.to_json(), "detail": detail})]


def workload_approximations(workload: Workload, options: StepOptions) -> list[Approximation]:
    """:func:`compile_approximations` of the model ``workload`` builds, built on the meta device
    (no memory) for an engine that does not hold the traced model itself (``plan``)."""
    if options.compile != "none":
        return compile_approximations(options, nn.Module(), workload.loss_fn)
    with torch.device("meta"):
        model = workload.build_model()
    return compile_approximations(options, model, workload.loss_fn)
