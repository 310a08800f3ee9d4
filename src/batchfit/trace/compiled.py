"""torch.compile and the trace: what is compiled, and what the trace says about it.

``--compile model|blocks`` on one device is traced compiled (:func:`compile_for_trace`):
dynamo captures the graph, AOTAutograd partitions it with inductor's decompositions and
partition_fn (what inductor saves for backward), and each forward and backward graph runs as
inductor's generated wrapper with its kernels skipped (:func:`inductor_plan`: inductor's fusion,
schedule and buffer reuse; inductor's kernels cannot run on fake tensors). A graph inductor cannot
generate runs op by op instead, with a model of inductor's pointwise fusion (:func:`unmaterialized`),
and every output says so (:func:`inductor_fallbacks`). Mixed
precision on CUDA semantics runs the same way, under CUDA's autocast mirror
(``trace/cuda_autocast.py``: its kernels step aside differently under the Python dispatcher
that dynamo and AOTAutograd trace with). ``--memory-budget F`` is set around the partition
(:func:`trace_backend`), as ``train/step.py`` sets it around inductor for real steps. Such a
result carries :data:`COMPILED_TRACED` (the residual against inductor on this CPU). ``plan``
traces rank 0 compiled too (:func:`sharded_traces_compiled`) for FSDP2, HSDP, DDP (its graph
cut at its buckets by dynamo's DDPOptimizer: :func:`_split_as_ddp`), ZeRO 1 / 2 and TP under
``--compile model``; the others stay eager, carry :data:`COMPILED_AS_EAGER` and say why
(:func:`sharded_eager_reason`; docs/tracing/compile.md).

Compiled is either asked for (``--compile model|blocks``: ``StepOptions.compile``), or done
by the workload itself: ``torch.compile(module)`` returns an ``OptimizedModule``,
``module.compile()`` sets the module's ``_compiled_call_impl``, and
``module.forward = torch.compile(module.forward)`` leaves a function that dynamo marks with
``_torchdynamo_orig_callable`` (so does a compiled ``loss_fn``).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from batchfit.trace.approximation import Approximation
from batchfit.workload import FP8_PRECISIONS, StepOptions, Workload

VALIDATION = "benchmarks/results/validate_gpu_compile-2026-11-24.json"

COMPILED_AS_EAGER = Approximation(
    what="compiled model traced as eager",
    may_differ_by=("-7% to +14% of the compiled run's peak allocated (this trace vs torch.compile with inductor; "
                   "compiled vs eager: -6% to +8%; H100, bf16-mixed, 3 models)"),
    source=VALIDATION,
)
"""The eager trace against the compiled step measured on an H100 (``traced_eager_vs_compiled``
and ``compiled_vs_eager`` in :data:`VALIDATION`; ``tests/test_compile.py`` checks the figures)."""


COMPILED_TRACED = Approximation(
    what=("compiled step traced as the wrapper code inductor generates for each graph on this machine's CPU "
          "(AOTAutograd's partition, inductor's fusion, schedule and buffer reuse), its kernels skipped, on fake "
          "tensors"),
    may_differ_by=("-0.004% to +0.07% of inductor's peak on this CPU for the support matrix's 16 families (fp32, "
                   "batch 2, seq 64; bert +0.07%, gemma2 and granite -0.002%); blocks of pointwise ops (LayerNorm, "
                   "silu(a) x tanh(b), GELU; 3 blocks, fp32, batch 4): -96 B; plan's rank 0 against 2-process gloo "
                   "runs compiled with inductor (tiny Llama, fp32): fsdp -0.001% (blocks) to +0.02% (model), "
                   "-0.001% bf16-mixed (blocks); fsdp-noreshard, hsdp, ddp, zero1, zero2 (blocks) and ddp cut at "
                   "its buckets (model): within 60 B (-0.0006%; gpt-tinystories-22m: within 108 B); tp2 (model, "
                   "DTensor in the graph): +0.13% (gpt-tinystories-22m: +0.011%) (plan's figures measured op by "
                   "op, before 2026-11-28; tests/test_plan_compiled.py's 2% holds with inductor's code); for a GPU "
                   "it is inductor's CPU schedule, and Triton fuses and orders kernels by its own rules: against "
                   "inductor on an H100 (bf16-mixed, 3 models, dynamo's shapes as in the measured process): "
                   "-0.28% to 0%; shapes compiled static where the H100 run had dynamic ones: -7.4% to +1.3% "
                   "(those H100 figures were traced op by op, before 2026-11-28; traced again as inductor's code, "
                   "gpt-tinystories-22m b64 and gpt2-124m b8 give the same bytes, llama-1b was not traced again); "
                   "a graph inductor cannot generate code for runs op by op with batchfit's model of inductor's "
                   "fusion, named in every output (that model was -5.1% to +4.3% on the families)"),
    source=("tests/test_support_truth.py (per family); tests/test_compile.py::test_the_compiled_trace_matches_inductor_"
            "on_cpu; tests/test_compile.py::test_pointwise_heavy_blocks_are_traced_as_inductors_code_within_200_bytes; "
            "tests/test_plan_compiled.py; benchmarks/results/recipes-cddp-2026-11-25.json; "
            "benchmarks/results/compiled_vs_h100-2026-11-25.json"),
)
"""The compiled trace against the profiler's memory timeline of the same step compiled with inductor."""

MEMORY_BUDGET_TRACED = Approximation(
    what=("--memory-budget: each graph runs the wrapper code inductor generates for it on this machine's CPU "
          "(inductor's fusion, schedule and buffer reuse), its kernels skipped, on fake tensors"),
    may_differ_by=("-0.12% to +0.00% of inductor's peak on this CPU (2-layer Llama, budgets 1 to 0: +0.0003% at "
                   "each but 0.1, -0.12% there; gpt-tinystories-22m at 0.5 and 0.1: +0.007%, +0.008%); the peak is "
                   "traced at each budget, not assumed to fall with it (pytorch/pytorch#197838); for a GPU it is "
                   "inductor's CPU schedule: Triton fuses and orders kernels by its own rules, not measured here"),
    source="benchmarks/results/memory_budget-2026-11-25.json (python benchmarks/memory_budget.py); "
           "benchmarks/results/recipes-budget-2026-11-26.json",
)
"""The compiled trace under ``activation_memory_budget`` against inductor on this CPU, budget by budget."""

CHECKPOINTED_TRACED = Approximation(
    what=("activation checkpointing inside compiled graphs: under --checkpointing every graph of the step (else each "
          "graph that recomputes a checkpointed region) runs the wrapper code inductor generates for it on this "
          "machine's CPU (inductor's partition, fusion, schedule and buffer reuse), its kernels skipped, on fake "
          "tensors"),
    may_differ_by=("-0.48% to +0.00% of inductor's peak on this CPU (HF Llama, 2 layers, batch 4: --compile model and "
                   "blocks x --checkpointing full, selective, every:2 x fp32, bf16-mixed x SDPA and eager attention, "
                   "12 cells; op by op, with batchfit's fusion model: -25.3% to +1.1%); for a GPU it is inductor's CPU "
                   "schedule: Triton fuses and orders kernels by its own rules, not measured here"),
    source="tests/test_compile_checkpointing.py; benchmarks/results/compiled_checkpointing-2026-11-28.json",
)
"""The compiled trace of checkpointed blocks against inductor on this CPU (op by op, with batchfit's
fusion model, such steps were -25% to +0% on a 2-layer Llama: the recomputation is where inductor's
scheduler puts it, fused into the backward's kernels)."""

_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "var_mean", "var", "prod", "any", "all"}
_VIEWS = {"view", "reshape", "_unsafe_view", "permute", "expand", "unsqueeze", "squeeze", "t", "transpose",
          "slice", "select", "alias", "as_strided", "unbind", "split", "split_with_sizes"}
_LOOPS = {"full", "zeros", "ones", "scalar_tensor", "iota", "arange", "full_like", "zeros_like", "ones_like",
          "slice_scatter", "select_scatter", "scatter", "gather", "index"}
"""Ops inductor lowers to loops it can fuse, beyond those tagged pointwise: constant fills, and
scatters into them (its ``scatter_upon_const_tensor`` pass: cross-entropy's backward)."""


def _name(target: Any) -> str:
    return getattr(getattr(target, "overloadpacket", None), "__name__", str(target))


def _fusible(node: fx.Node) -> bool:
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and (torch.Tag.pointwise in target.tags or _name(target) in _LOOPS))


def _consumers(node: fx.Node) -> list[fx.Node]:
    """The nodes that read ``node``, looking through views."""
    found = []
    for user in node.users:
        is_view = user.op == "call_function" and _name(user.target) in _VIEWS
        found += (_consumers(user) or [user]) if is_view else [user]
    return found


def _fuses_into(user: fx.Node) -> bool:
    """Whether a pointwise producer read by ``user`` is fused into ``user``'s kernel: pointwise
    ops, reductions, and ``cat`` (inductor's cat lowering has its pointwise inputs write straight
    into their slices of the output, ``ConcatKernel``, or fuses them into a pointwise cat)."""
    return _fusible(user) or (user.op == "call_function" and _name(user.target) in _REDUCTIONS | {"cat"})


def unmaterialized(graph: fx.Graph) -> set[str]:
    """Nodes whose output inductor never writes to memory: a pointwise op read only by pointwise
    ops, reductions and cats is fused into them. Graph outputs (saved activations, gradients) and
    the inputs of matmuls and other extern kernels are written."""
    return {node.name for node in graph.nodes
            if _fusible(node) and (users := _consumers(node)) and all(_fuses_into(u) for u in users)}


def _kernels_of(node: fx.Node, fused: set[str]) -> list[fx.Node]:
    """The nodes whose kernels compute ``node``: itself when it is written, else (it is fused)
    the written nodes it is fused into, through views and other fused nodes."""
    if node.name not in fused:
        return [node]
    return [kernel for user in _consumers(node) for kernel in _kernels_of(user, fused)]


class _FusedRun(fx.Interpreter):
    """Runs a graph op by op; the outputs of fused-away nodes are not counted by the tracker."""

    def __init__(self, module: fx.GraphModule, fused: set[str], tracker: Any) -> None:
        super().__init__(module)
        self.fused, self.tracker = fused, tracker
        # What a fused node reads stays alive until the kernel it is fused into has run (and
        # allocated its output): inductor frees a buffer after the kernel that reads it. Run op by
        # op, the graph would free it at the fused node, before that kernel's output exists (a
        # SwiGLU backward's saved input was freed before the cat of its two gradients).
        order = {node: i for i, node in enumerate(module.graph.nodes)}
        last_uses: dict[fx.Node, list[fx.Node]] = {}
        for user, values in self.user_to_last_uses.items():
            cats = [k for k in _kernels_of(user, fused) if _name(k.target) == "cat"] if user.name in fused else []
            last_uses.setdefault(max(cats, key=order.__getitem__, default=user), []).extend(values)
        self.user_to_last_uses = last_uses
        # An alias of a fused-away node shares its storage, which the tracker never counted: run
        # counted, it would count that storage as new (tanh's backward reads its saved output
        # through aten.alias: a whole phantom activation a block). Other views of fused nodes stay
        # counted: on a 4-layer Llama they stand for buffers inductor does write (-2.75% without).
        self.uncounted = set(fused)
        for node in module.graph.nodes:
            base = node.args[0] if node.op == "call_function" and node.args else None
            if isinstance(base, fx.Node) and base.name in self.uncounted and _name(node.target) == "alias":
                self.uncounted.add(node.name)

    def run_node(self, node: fx.Node) -> Any:
        if node.name not in self.uncounted:
            return super().run_node(node)
        self.tracker.uncounted = True
        try:
            return super().run_node(node)
        finally:
            self.tracker.uncounted = False


_RECOMPUTING: list[str] = []
"""The graphs that recomputed a checkpointed region (``forward`` / ``backward``), since the last
:func:`compile_for_trace` or :func:`retarget_for_trace`: each ran inductor's generated code."""


def recomputing_graphs() -> int:
    """How many compiled graphs recomputed a checkpointed region (:data:`CHECKPOINTED_TRACED`)."""
    return len(_RECOMPUTING)


def checkpointed_approximations(detail: str, *, checkpointing: str = "none") -> list[Approximation]:
    """:data:`CHECKPOINTED_TRACED` (with ``detail``) where ``checkpointing`` (``--checkpointing``) wraps
    compiled blocks, or where a compiled graph recomputed a checkpointed region since the last compile
    for the trace (the workload's own checkpointing); else nothing."""
    if checkpointing != "none":
        detail += f" --checkpointing {checkpointing}"
    elif _RECOMPUTING:
        detail += " (the workload's own checkpointing)"
    else:
        return []
    return [dataclasses.replace(CHECKPOINTED_TRACED, detail=f"{detail}{inductor_fallbacks()}")]


_FALLBACKS: list[str] = []
"""Why inductor could not generate the code of a graph the trace then ran op by op, since the last
:func:`compile_for_trace` (said by :func:`inductor_fallbacks`)."""


def inductor_fallbacks() -> str:
    """'' when every graph ran inductor's generated code, else what ran op by op and why."""
    if not _FALLBACKS:
        return ""
    return (f"; inductor could not generate {len(_FALLBACKS)} graph(s) here ({_FALLBACKS[0]}): they ran op by op "
            "with batchfit's fusion model, which was -8% to 0% under a budget, -3% with float8, -25% to 0% "
            "with checkpointed blocks and -5.1% to +4.3% on plain graphs of the support matrix's families "
            "(docs/tracing/compile.md)")


class _Codegen(Exception):
    """Raised out of inductor once its wrapper code is generated: the kernels are never compiled."""


class _NoKernels:
    """Stands for inductor's ``AsyncCompile`` in the generated module: every kernel is a no-op (fake
    tensors have no values to compute; what a kernel writes is allocated by the wrapper around it)."""

    def __getattr__(self, name: str) -> Callable:
        if name == "wait":
            return lambda *args, **kwargs: None
        return lambda *args, **kwargs: (lambda *a, **k: None)


class _ExternKernels:
    """Inductor's ``extern_kernels`` for its generated code in the trace: ``_scaled_mm`` is the one
    the trace has at call time (``trace/cuda_float8.py: cpu_scaled_mm_scratch`` replaces it with one
    that allocates what this CPU's kernel allocates inside; inductor bound PyTorch's own)."""

    def __init__(self, kernels: Any) -> None:
        self._kernels = kernels

    def __getattr__(self, name: str) -> Any:
        return torch._scaled_mm if name == "_scaled_mm" else getattr(self._kernels, name)


def _reinterpret(tensor: torch.Tensor, size: Any, stride: Any, offset: int) -> torch.Tensor:
    # torch._C._dynamo.guards._reinterpret_tensor: a view at an offset from the tensor's own
    return torch.as_strided(tensor, size, stride, tensor.storage_offset() + offset)


def inductor_source(module: fx.GraphModule, example_inputs: list, *, is_backward: bool) -> str:
    """The Python wrapper inductor generates for ``module`` (AOTAutograd's forward or backward graph,
    on ``example_inputs``' fake tensors): lowering, fusion, the scheduler's order (its
    ``reorder_for_peak_memory``) and the wrapper's buffer reuse, all inductor's own
    (``compile_fx_inner`` up to ``GraphLowering.codegen``); the C++ or Triton kernels are not built."""
    import copy
    from unittest import mock

    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.graph import GraphLowering

    generated: list[str] = []

    def codegen_only(graph: GraphLowering) -> Any:
        generated.append(graph.codegen()[0].value)
        raise _Codegen

    with mock.patch.object(GraphLowering, "compile_to_module", codegen_only), \
            inductor_config.patch(fx_graph_cache=False):  # a cache hit would skip the codegen
        try:
            compile_fx_inner(copy.deepcopy(module), example_inputs, is_backward=is_backward)
        except Exception:
            if not generated:
                raise
    return generated[0]


def inductor_plan(module: fx.GraphModule, example_inputs: list, tracker: Any, *, is_backward: bool) -> Callable:
    """Inductor's generated wrapper for ``module`` (:func:`inductor_source`), run on fake tensors:
    its buffers are allocated (and counted) where inductor's code allocates them, reused and freed
    where it reuses and frees them (``# reuse``, ``del``), and the inputs are dropped where it drops
    them; the kernels do nothing (fake tensors have no values; what a kernel writes is a buffer the
    wrapper allocated, or an extern kernel's output, which runs on the fake tensors). The outputs
    have the shapes and strides inductor gives them. Raises where inductor cannot lower the graph."""
    uncounted, tracker.uncounted = tracker.uncounted, True
    try:  # lowering runs ops on fake tensors too: none of them is the step's memory
        source = inductor_source(module, example_inputs, is_backward=is_backward)
    finally:
        tracker.uncounted = uncounted
    builds = "async_compile = AsyncCompile()"
    if builds not in source:
        raise RuntimeError("inductor's wrapper does not build its kernels with AsyncCompile (the trace "
                           "cannot skip them)")
    scope: dict[str, Any] = {"__name__": "batchfit_inductor_wrapper", "_NoKernels": _NoKernels}
    exec(compile(source.replace(builds, "async_compile = _NoKernels()"), "<inductor wrapper>", "exec"), scope)
    # The wrapper's allocators and checks are C++ fast paths that bypass the dispatcher (they would
    # allocate real memory and read data pointers): the fake tensor mode and the tracker must see them.
    cpu = lambda size, stride, dtype: torch.empty_strided(size, stride, dtype=dtype, device="cpu")  # noqa: E731
    scope.update(assert_size_stride=lambda *a, **k: None, assert_alignment=lambda *a, **k: None,
                 empty_strided_cpu=cpu, empty_strided_cpu_pinned=cpu, reinterpret_tensor=_reinterpret,
                 extern_kernels=_ExternKernels(scope["extern_kernels"]))
    call = scope["call"]

    def run(args: list) -> Any:  # boxed, as inductor's: its code clears the list and frees inputs as it goes
        return call(args)

    run._boxed_call = True
    return run


def recomputes(module: fx.GraphModule) -> bool:
    """Whether ``module`` (AOTAutograd's forward or backward graph) holds a region that activation
    checkpointing recomputes: ``torch.utils.checkpoint`` inside a compiled graph (dynamo's
    ``tag_activation_checkpoint``) tags each node of the region with a ``recompute`` policy, and the
    partitioner keeps the tags on both graphs it cuts."""
    return any(node.meta.get("recompute") is not None for node in module.graph.nodes)


def trace_backend(tracker: Any, memory_budget: float | None = None) -> Callable:
    """A torch.compile backend for the trace: AOTAutograd with inductor's decompositions and
    partition_fn (inductor's joint-graph passes, then its min-cut: inductor's saved activations, under
    ``memory_budget`` when given: the knapsack of ``_optimize_runtime_with_given_memory`` picks what to
    save, on the same joint graph and flop estimates inductor's partition sees). Each graph runs as the
    wrapper code inductor generates for it (:func:`inductor_plan`: its fusion, schedule and buffer
    reuse, its kernels skipped); op by op (:class:`_FusedRun`, with batchfit's model of inductor's
    fusion) only where inductor cannot generate code for a graph, said in every output
    (:func:`inductor_fallbacks`). Op by op was the rule for graphs with no budget and no checkpointing
    before 2026-11-28: -5.1% to +4.3% of inductor on this CPU for families whose pointwise tails the
    fusion model did not know (Granite's scaled logits, Gemma 2's softcapping), -2.4% on blocks of
    pointwise ops; inductor's code is within 100 B on each."""
    from torch._dynamo.backends.common import aot_autograd

    from batchfit.train.step import with_memory_budget

    def compiler(module: fx.GraphModule, example_inputs: list, *, is_backward: bool) -> Callable:
        if recomputes(module):
            _RECOMPUTING.append("backward" if is_backward else "forward")
        # Inductor's own code: op by op, the fusion model missed what inductor writes and holds
        # (Granite's logits gradient before its scaling: -5.1%), what it never writes (Gemma 2's
        # softcapped scores: +4.3%), where its scheduler puts a recomputation (under a budget -8%
        # to 0%; checkpointed regions -25% to 0% on a 2-layer Llama) and how torchao's float8
        # casts fuse (-3.2%).
        try:
            return inductor_plan(module, example_inputs, tracker, is_backward=is_backward)
        except Exception as error:  # noqa: BLE001 - said in every output (inductor_fallbacks)
            _FALLBACKS.append(f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}")
        fused = unmaterialized(module.graph)

        def run(args: list) -> Any:  # boxed: the graph frees its inputs as it goes, as inductor's code does
            return _FusedRun(module, fused, tracker).boxed_run(args)

        run._boxed_call = True
        return run

    def decompositions() -> dict:
        from torch._inductor.compile_fx import select_decomp_table

        return select_decomp_table()

    # Inductor registers its extern kernels under the name of the function it finds when the
    # module is imported (select_algorithm.ExternKernelChoice: kernel.__name__; kernel/mm.py
    # takes torch._scaled_mm): import it now, before the CPU trace replaces torch._scaled_mm
    # (cuda_float8.cpu_scaled_mm_scratch), or the generated code and a later real compile
    # in this process would call extern_kernels._scaled_mm_as_on_cpu.
    import torch._inductor.kernel.mm  # noqa: F401

    def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        # Inductor's own partition_fn (compile_fx.py): its joint-graph passes first, then its
        # min-cut. They change the nodes the budget's knapsack weighs (budget 0.3 on a 2-layer
        # Llama: -11.6% without them, -1.9% with), what float8's graphs save (a 2-layer Llama,
        # tensorwise: +5.3% without them), and what a graph that checkpoints part of itself saves
        # (HF Llama, --compile model --checkpointing every:2: -8.1% without them, with inductor's
        # wrapper code run).
        from torch._guards import detect_fake_mode
        from torch._inductor.compile_fx import partition_fn
        from torch._inductor.virtualized import V

        # Its random-op passes read V.fake_mode, which compile_fx sets around it in a real compile
        # (dropout in a checkpointed GPT-2 block: TypeError 'NullHandler' ... context manager).
        with V.set_fake_mode(detect_fake_mode(joint_inputs)):
            return partition_fn(joint, joint_inputs, **kwargs)
    return with_memory_budget(
        aot_autograd(fw_compiler=functools.partial(compiler, is_backward=False),
                     bw_compiler=functools.partial(compiler, is_backward=True), decompositions=decompositions,
                     partition_fn=partition), memory_budget)


def _split_as_ddp(backend: Callable, split: bool) -> Callable:
    """``backend`` behind dynamo's own DDPOptimizer, as a real DDP run compiles (``split``: dynamo's
    ``optimize_ddp`` is "ddp_optimizer", its default): a graph compiled inside DDP's forward is cut at
    DDP's bucket boundaries (``bucket_bytes_cap``, and a 1 MiB first bucket) and each piece partitioned
    and compiled alone (``torch/_dynamo/backends/distributed.py: DDPOptimizer.compile_fn``).

    Why here and not where dynamo does it: dynamo's ``ConvertFrame.__call__`` (convert_frame.py) takes
    the DDP branch before it enters ``_disable_current_modes()``, so DDP's frames are traced with the
    trace's FakeTensorMode and tracker still on the stack, and dynamo's own fake mode then fails on
    the step's fake tensors (InternalTorchDynamoError "`tensor` needs to be a `FakeTensor` wrapped by
    this instance of Dynamo"). The trace turns that branch off (:func:`trace_context`) and calls the
    same DDPOptimizer, with the same caps, from the backend, on the same dynamo graph."""

    def compile_fn(module: fx.GraphModule, example_inputs: list, **configs: Any) -> Callable:
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel._get_active_ddp_module() if split else None
        if ddp is None:
            return backend(module, example_inputs, **configs)
        from torch._dynamo.backends.distributed import DDPOptimizer

        return DDPOptimizer(bucket_bytes_cap=ddp.bucket_bytes_cap,
                            backend_compile_fn=backend).compile_fn(module, example_inputs, **configs)

    return compile_fn


def trace_context() -> Any:
    """Entered around each traced compiled step: dynamo's DDP branch off (:func:`_split_as_ddp` splits)."""
    import torch._dynamo.config as dynamo_config

    return dynamo_config.patch(optimize_ddp=False)


def ddp_mode() -> str:
    """Dynamo's ``optimize_ddp`` as a real compiled DDP run would read it: "ddp_optimizer" (default),
    "no_optimization", or one of the Python-reducer modes (compiled autograd; not traced)."""
    from torch._dynamo.utils import get_optimize_ddp_mode

    return get_optimize_ddp_mode()


def compile_for_trace(model: nn.Module, mode: str, tracker: Any, *, memory_budget: float | None = None) -> None:
    """Compile ``model`` (``mode``: model or blocks, as ``TrainingStep`` does on a real device)
    with :func:`trace_backend`, and let compiled code run under ``tracker``."""
    import torch._dynamo.config as dynamo_config

    from batchfit.train.step import block_list

    # Each block, each batch size and each model the trace builds (depths, fresh processes)
    # is a cache entry of the same frame (Module._call_impl): past dynamo's limit it would run
    # the rest eager, which the trace must not do while it says compiled.
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 1024)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 4096)
    from torch._dynamo.utils import counters

    for name in ("graph_break", "stats"):  # graph_breaks() counts this model's
        counters[name].clear()
    _FALLBACKS.clear()
    _RECOMPUTING.clear()
    tracker.run_compiled = True
    backend = _split_as_ddp(trace_backend(tracker, memory_budget), ddp_mode() == "ddp_optimizer")
    # DDP (and zero1's DDP) wraps the model compiled before it, as TrainingStep does on a device:
    # its inner module is what a real run compiles with --compile model.
    inner = getattr(model, "module", model) if isinstance(model, nn.parallel.DistributedDataParallel) else model
    for module in (block_list(inner) or []) if mode == "blocks" else [inner]:
        module.compile(backend=backend)


def retarget_for_trace(step: Any, tracker: Any) -> list[str]:
    """Swap the backend of what the workload compiled itself (inductor, which cannot run on fake
    tensors) for :func:`trace_backend`, in ``step`` (a ``TrainingStep``); the parts swapped."""
    model = step.model
    parts = compiled_parts(model, step.loss_fn)
    if not parts:
        return []
    import torch._dynamo.config as dynamo_config
    from torch._dynamo.eval_frame import OptimizedModule
    from torch._dynamo.utils import counters

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 1024)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 4096)
    for name in ("graph_break", "stats"):
        counters[name].clear()
    _FALLBACKS.clear()
    _RECOMPUTING.clear()
    tracker.run_compiled = True
    # a budget the workload set itself (functorch's config) holds here too
    backend = trace_backend(tracker)
    # Modules whose call was compiled: Module.compile() left _compiled_call_impl; an
    # OptimizedModule (torch.compile(module)) is replaced by the module it wraps.
    compiled = {id(m) for m in model.modules() if getattr(m, "_compiled_call_impl", None) is not None}
    if isinstance(model, OptimizedModule):
        step.model = model = model._orig_mod
        compiled.add(id(model))
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if isinstance(child, OptimizedModule):
                parent._modules[name] = child._orig_mod
                compiled.add(id(child._orig_mod))
    for module in model.modules():
        if id(module) in compiled:
            module.compile(backend=backend)
        forward = module.__dict__.get("forward")
        if _is_compiled_fn(forward):  # module.forward = torch.compile(module.forward)
            module.forward = torch.compile(forward._torchdynamo_orig_callable, backend=backend)
    if _is_compiled_fn(step.loss_fn):
        step.loss_fn = torch.compile(step.loss_fn._torchdynamo_orig_callable, backend=backend)
    return parts


def graph_breaks() -> str:
    """Graphs compiled and graph breaks since the last :func:`compile_for_trace` (dynamo's counters), with the
    most frequent break's reason: what to change in the model for one graph."""
    from torch._dynamo.utils import counters

    breaks = counters["graph_break"]
    text = f"{counters['stats']['unique_graphs']} graphs compiled, {sum(breaks.values())} graph breaks"
    if breaks:
        text += f" (most often: {_reason(max(breaks, key=breaks.get))})"
    return text


def _reason(message: str) -> str:
    """A graph break's headline and dynamo's explanation of it, one line ("Failed to trace builtin
    operator: Dynamo does not know how to trace builtin operator `print` ...")."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    explanation = next((line.removeprefix("Explanation:").strip() for line in lines[1:]
                        if line.startswith("Explanation:")), "")
    return f"{lines[0]}: {explanation}" if lines and explanation else (lines[0] if lines else "unknown")


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
            name = name.replace("_orig_mod.", "").removesuffix("_orig_mod").rstrip(".")  # as the user named it
            if (name or "model") not in found:
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
        budget = f" --memory-budget {options.memory_budget:g}" if options.memory_budget is not None else ""
        detail = f"--compile {options.compile}{budget}" + (f"; {_summary(parts)}" if parts else "")
    elif parts:
        detail = _summary(parts)
    else:
        return []
    return [Approximation(**{**COMPILED_AS_EAGER.to_json(), "detail": detail})]


TP_BLOCKS_FAIL = ("a real --compile blocks run of a tensor-parallel plan fails in its first backward (2 gloo ranks, "
                  "torch 2.13): the vocabulary-parallel embedding's output (RowwiseParallel, Shard(1): "
                  "reduce-scattered into an AsyncCollectiveTensor) enters the first compiled block, and the gradient "
                  "that block's compiled backward returns for it reaches DTensor's Redistribute.backward "
                  "(torch/distributed/tensor/_redistribute.py) as a plain Tensor (AttributeError: '_local_tensor'); "
                  "--compile model runs and is traced compiled")
"""Why ``--compile blocks`` under TP stays eager: the step it would trace does not run."""
FSDP_TP_FAIL = ("a real fsdp+tp run fails under either --compile (2 gloo ranks, torch 2.13): --compile blocks as "
                "tp's does, and --compile model in inductor's compile, where AOTAutograd's trace of the "
                "vocabulary-parallel embedding (DTensor's MaskPartial: torch/distributed/tensor/_ops/_mask_buffer.py "
                "materialize_mask) mixes two fake modes (AssertionError: Mixing fake modes NYI)")
"""Why fsdp+tp stays eager under ``--compile``: neither step it would trace runs."""


def sharded_eager_reason(strategy: Any, options: StepOptions) -> str | None:
    """Why ``plan`` traces rank 0 of ``strategy`` (``plan/sharded.py``'s Strategy) as eager under
    ``--compile``, or None when it traces it compiled. Traced compiled, each checked against inductor
    on a real gloo run (``tests/test_plan_compiled.py``, ``benchmarks/compiled_plan.py``): FSDP2 (fsdp,
    fsdp-noreshard, hsdp: its all-gathers and reduce-scatters run in its hooks, outside dynamo's graphs),
    DDP and zero1 (DDP's graph cut at its buckets by dynamo's DDPOptimizer: :func:`_split_as_ddp`),
    zero2, and TP (tp, fsdp+tp) under ``--compile model``."""
    if getattr(strategy, "pp", 1) > 1:
        return ("a pipeline rank (distributed/pipeline.py, torch.distributed.pipelining's schedule) under compile "
                "is untried: no gloo truth of a compiled pipeline yet (torchtitan compiles each stage's blocks)")
    if getattr(strategy, "ep", 1) > 1 or getattr(strategy, "cp", 1) > 1:
        return "expert and context parallelism under compile are untried (no gloo truth)"
    if options.offload_spec.params:
        return "FSDP2's CPUOffloadPolicy under compile is untried (no gloo truth)"
    if options.precision in FP8_PRECISIONS:
        return "torchao's float8 subclasses under dynamo on fake tensors are untried"
    if getattr(strategy, "tp", 1) > 1 and getattr(strategy, "shard", None) != "none":
        return FSDP_TP_FAIL
    if getattr(strategy, "tp", 1) > 1 and options.compile == "blocks":
        return TP_BLOCKS_FAIL
    if getattr(strategy, "shard", None) in ("ddp", "zero1") and ddp_mode() not in ("ddp_optimizer", "no_optimization"):
        return (f"torch._dynamo.config.optimize_ddp = {ddp_mode()!r} runs DDP's Python reducer under compiled "
                "autograd, not traced (ddp_optimizer, the default, is)")
    return None


def sharded_traces_compiled(strategy: Any, options: StepOptions) -> bool:
    """Whether ``plan`` traces rank 0 of ``strategy`` compiled: ``--compile`` is on and
    :func:`sharded_eager_reason` finds no reason not to."""
    return options.compile != "none" and sharded_eager_reason(strategy, options) is None


def plan_compile_approximations(workload: Workload, options: StepOptions, compiled: list[str],
                                eager: dict[str, str]) -> list[Approximation]:
    """``plan``'s torch.compile approximations: the strategies named in ``compiled`` are traced
    compiled (``COMPILED_TRACED``, with the gloo figures), those in ``eager`` (name: why, from
    :func:`sharded_eager_reason`) as eager, one approximation per reason."""
    if options.compile == "none":  # a workload that compiles itself: traced eager, and said
        return workload_approximations(workload, options)
    said = [dataclasses.replace(COMPILED_TRACED, detail=f"--compile {options.compile}: {', '.join(compiled)} "
                                                        "traced compiled")] if compiled else []
    if options.memory_budget is not None and compiled:  # the compiled ones ran inductor's code (trace_backend)
        said.append(dataclasses.replace(MEMORY_BUDGET_TRACED, detail=(
            f"--memory-budget {options.memory_budget:g}: {', '.join(compiled)}{inductor_fallbacks()}")))
    if compiled:
        said += checkpointed_approximations(", ".join(compiled), checkpointing=options.checkpointing)
    by_reason: dict[str, list[str]] = {}
    for name, why in eager.items():
        by_reason.setdefault(why, []).append(name)
    for why, names in by_reason.items():
        said += [dataclasses.replace(a, detail=f"{a.detail}: {', '.join(names)} traced eager: {why}")
                 for a in workload_approximations(workload, options)]
    return said


def workload_approximations(workload: Workload, options: StepOptions) -> list[Approximation]:
    """:func:`compile_approximations` of the model ``workload`` builds, built on the meta device
    (no memory) for an engine that does not hold the traced model itself (``plan``)."""
    if options.compile != "none":
        return compile_approximations(options, nn.Module(), workload.loss_fn)
    with torch.device("meta"):
        model = workload.build_model()
    return compile_approximations(options, model, workload.loss_fn)
