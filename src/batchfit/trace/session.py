"""Trace training steps of a Workload on fake tensors, one batch size at a time.

The model and optimizer are built once, on fake tensors (no memory, no compute). The
first step creates the optimizer state; every measured step after it starts from the same
state (parameters, optimizer state, no gradients), so its peak is what the second and every
later step of a real run would reach at that batch size.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import traceback
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.modules import transformer as _transformer

from batchfit.errors import BatchfitError, ModelSpecError, OptionError, TraceError
from batchfit.trace import bnb_fake, repeats
from batchfit.trace.compiled import compile_for_trace, retarget_for_trace, trace_context
from batchfit.trace.cuda_attention import CudaAttention
from batchfit.trace.cuda_autocast import CudaAutocast
from batchfit.trace.cuda_float8 import cpu_scaled_mm_scratch, mirror_float8_autocast
from batchfit.trace.cuda_norm import CudaRmsNorm
from batchfit.trace.deferred import resolved
from batchfit.trace.hf_packing import PackedSequences
from batchfit.trace.memory import CUDA_BLOCK_BYTES, MemoryTracker, held_tensor
from batchfit.trace.routing import RoutedExperts, moe_experts
from batchfit.trace.snapshot import TracePoint
from batchfit.train.model import main_blocks
from batchfit.train.quantize import BNB_OPTIMIZERS, TORCHAO_OPTIMIZERS, load_bitsandbytes, preload
from batchfit.train.step import TrainingStep
from batchfit.workload import FP8_PRECISIONS, StepOptions, Workload

_CANNOT_FAKE = (
    fake_tensor.DataDependentOutputException,
    fake_tensor.DynamicOutputShapeException,
    fake_tensor.UnsupportedOperatorException,
)


_CAUSAL_MASKS: dict[int, weakref.ref] = {}
"""Fake masks made by PyTorch's causal-mask builder, by their storage: its values are known."""
_PYTORCH_CAUSAL_MASK = _transformer._generate_square_subsequent_mask
_PYTORCH_DETECT_CAUSAL = _transformer._detect_is_causal_mask


def _causal_mask(sz, device=None, dtype=None):
    """``nn.Transformer.generate_square_subsequent_mask``, remembering a fake result as causal."""
    mask = _PYTORCH_CAUSAL_MASK(sz, device=device, dtype=dtype)
    if isinstance(mask, fake_tensor.FakeTensor):
        _remember_causal(mask)
    return mask


def _remember_causal(mask: torch.Tensor) -> None:
    for key in [k for k, ref in list(_CAUSAL_MASKS.items()) if ref() is None]:
        _CAUSAL_MASKS.pop(key, None)  # another thread may have dropped it first
    _CAUSAL_MASKS[mask.untyped_storage()._cdata] = weakref.ref(mask)


def _known_causal(mask: torch.Tensor) -> bool:
    """A top-left square view (``mask[:n, :n]``) of a mask the causal builder made, or that mask:
    its values are those of a causal mask of its size."""
    try:
        ref = _CAUSAL_MASKS.get(mask.untyped_storage()._cdata)
        whole = ref() if ref else None
        return (whole is not None and whole.untyped_storage()._cdata == mask.untyped_storage()._cdata
                and mask.dim() == 2 and mask.shape[0] == mask.shape[1] and mask.storage_offset() == 0
                and mask.stride() == whole.stride())
    except (RuntimeError, NotImplementedError):  # sparse or nested: no storage, no strides
        return False


def _detect_causal(mask, is_causal=None, size=None):
    """PyTorch's ``_detect_is_causal_mask`` (nn.TransformerEncoder and Decoder compare the mask
    with a causal one when ``is_causal`` is not given), answered without values for a fake mask
    known to be causal; any other fake mask raises as before (the error says what to change)."""
    if is_causal is None and isinstance(mask, fake_tensor.FakeTensor) and _known_causal(mask):
        return mask.shape[-2] == (size if size is not None else mask.size(-2))
    return _PYTORCH_DETECT_CAUSAL(mask, is_causal, size)


# PyTorch's own answers for real tensors; only fake masks from the causal builder differ.
_transformer._generate_square_subsequent_mask = _causal_mask
_transformer._detect_is_causal_mask = _detect_causal


@contextlib.contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    """A failing op logs its whole traceback from fake_tensor.py before raising; the error is
    reported once, as one line, so the log is silenced while tracing (and restored after)."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


_LIBRARIES = (Path(torch.__file__).parent, Path(__file__).parents[1], Path(contextlib.__file__).parent)


def _user_line(error: BaseException) -> str | None:
    """file:line of the innermost frame in the user's code (not torch, batchfit or Python's
    own library, nor an installed package), where a shape error or a typo really is."""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        path = Path(frame.filename)
        if frame.filename.startswith("<") or "site-packages" in path.parts:
            continue
        if not any(path.is_relative_to(library) for library in _LIBRARIES):
            return f"{frame.filename}:{frame.lineno}"
    return None


def _message(error: BaseException) -> str:
    """The error's type and first line, and a line that says what to do instead when there is one
    (autocast's refusal of binary_cross_entropy names its replacement on a later line)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    text = f"{type(error).__name__}: {lines[0] if lines else ''}"
    advice = next((line for line in lines[1:] if "use " in line.lower() or "instead" in line.lower()), None)
    return f"{text} ({advice})" if advice else text


def _value_read_message(name: str, what: str, error: BaseException) -> str:
    """One line for an op that needs tensor values (fake tensors have none): where the user's
    code asked for them, and what to write there instead."""
    where = _user_line(error)
    at = f" at {where}" if where else ""
    op = getattr(error, "func", None)
    frames = traceback.extract_tb(error.__traceback__)
    if any("_nested_tensor_from_mask(" in (frame.line or "") for frame in frames):
        fix = ("nn.TransformerEncoder's fast path (eval mode, no gradients, src_key_padding_mask) packs "
               "the batch into a nested tensor by the mask's values and runs fused kernels: keep that "
               "encoder in train mode (with dropout=0.0 its output is the same), the path batchfit traces")
    elif any(frame.name == "_detect_is_causal_mask" for frame in frames):
        fix = ("nn.TransformerEncoder/Decoder compares the attention mask's values with a causal mask "
               "because is_causal was not given: pass is_causal=True (tgt_is_causal=True for "
               "nn.Transformer) with that mask if it is causal, else is_causal=False, or build it "
               "with nn.Transformer.generate_square_subsequent_mask")
    elif isinstance(error, fake_tensor.UnsupportedOperatorException):
        fix = f"{op} has no fake-tensor implementation: use another op there"
    elif what == "building the model" and isinstance(error, fake_tensor.DataDependentOutputException):
        fix = ("the model's __init__ reads a tensor's value (.item(), float(t), `if t`), and a model "
               "built on fake tensors has none: compute it from Python numbers or the config instead")
    elif what == "building the model":
        fix = (f"the model's __init__ calls {op} (torch.nonzero, t[mask], masked_select), whose "
               "size depends on values: build the indices from Python numbers (torch.arange, a list)")
    elif isinstance(error, fake_tensor.DataDependentOutputException):
        fix = ("the training step reads a tensor's value (.item(), int(t), `if t`): compute it from "
               "shapes or Python numbers instead, e.g. pad or trim the batch in make_batch, not in the step")
    else:
        fix = (f"the training step calls {op}, whose output size depends on values (t[mask], "
               "torch.nonzero, masked_select): keep the shape fixed, e.g. replace logits[mask] by "
               "F.cross_entropy(logits, targets, ignore_index=-100) with the masked targets set to -100")
    return (f"{name} cannot be traced (fake tensors have no values){at}: {fix} "
            "(or measure on a GPU with `batchfit probe --device cuda`)")


_PYTORCH_APPLY = nn.Module._apply
_building = threading.local()
"""``depth``: builds on fake tensors this thread is in; ``call``: (converted tensors, modules
done) of the outermost ``Module._apply`` running in it."""
_builders = [0]
_builders_lock = threading.Lock()


def _apply_building_fakes(self: nn.Module, fn, recurse: bool = True) -> nn.Module:
    """``nn.Module._apply`` (behind ``.to()``, ``.bfloat16()``, ``to_empty()``), while a model is
    built on fake tensors, in the thread building it (any other thread gets PyTorch's own).

    PyTorch swaps a fake parameter for its converted copy in place (``torch.utils.swap_tensors``),
    which fails: the fake mode keeps a weak reference to every fake parameter. So a model whose
    ``__init__`` calls ``self.to(torch.bfloat16)`` could not be traced. Here a module holding fake
    tensors gets new ones instead, as PyTorch does for a change of tensor type: a tensor two
    modules share (tied weights) stays shared, and a module reached twice in one call (listed
    in two ModuleLists, as frozen-pair's decoder layers are) is converted once."""
    if not getattr(_building, "depth", 0):
        return _PYTORCH_APPLY(self, fn, recurse)
    outermost = getattr(_building, "call", None) is None
    if outermost:
        _building.call = ({}, set())
    converted, done = _building.call
    try:
        if id(self) in done:
            return self
        done.add(id(self))
        if recurse:
            for child in self.children():
                child._apply(fn)
        own = [t for t in (*self._parameters.values(), *self._buffers.values()) if t is not None]
        if not any(isinstance(t, fake_tensor.FakeTensor) for t in own):
            return _PYTORCH_APPLY(self, fn, False)  # meta or DTensor parameters: PyTorch's way works
        with torch.no_grad():
            for slots, is_param in ((self._parameters, True), (self._buffers, False)):
                for name, tensor in slots.items():
                    if tensor is None:
                        continue
                    if id(tensor) not in converted:
                        new = fn(tensor)
                        if (new.is_floating_point() or new.dtype == torch.bool) and _known_causal(tensor):
                            _remember_causal(new)  # -inf and 0 stay -inf and 0 (True and False)
                        own = type(tensor).to is not torch.Tensor.to and isinstance(new, nn.Parameter)
                        if is_param and not own:  # a class with its own to() (bitsandbytes') keeps it
                            new = nn.Parameter(new, tensor.requires_grad)
                            if tensor.grad is not None:
                                new.grad = fn(tensor.grad)
                        converted[id(tensor)] = (tensor, new)  # the old one kept: its id stays unique
                    slots[name] = converted[id(tensor)][1]
        return self
    finally:
        if outermost:
            _building.call = None


@contextlib.contextmanager
def _building_on_fakes() -> Iterator[None]:
    """Let the model being built in this thread convert its fake tensors (``.to(dtype)``)."""
    with _builders_lock:
        _builders[0] += 1
        nn.Module._apply = _apply_building_fakes
    _building.depth = getattr(_building, "depth", 0) + 1
    try:
        yield
    finally:
        _building.depth -= 1
        with _builders_lock:
            _builders[0] -= 1
            if not _builders[0]:
                nn.Module._apply = _PYTORCH_APPLY


def install_cuda_mirrors(step: TrainingStep) -> None:
    """Make a step on fake CPU tensors allocate what it would on a CUDA device.

    Installed around the step, not inside it: the optimizer takes the path PyTorch picks for
    CUDA tensors, and mixed precision casts by CUDA's autocast table.
    """
    # PyTorch picks foreach=True for CUDA tensors when the user left it unset; on CPU (and
    # fake) tensors it picks the per-parameter loop, which needs less scratch memory.
    for group in step.optimizer.param_groups:
        if group.get("foreach", "absent") is None and not group.get("fused"):
            group["foreach"] = True
    if step.options.autocast_dtype is not None:
        mirror = CudaAutocast(getattr(torch, step.options.autocast_dtype))
        step.step_context, step.forward_autocast = (lambda: mirror), mirror.forward
    mirror_float8_autocast(step.model)  # torchao's float8 linears read CUDA's autocast flag
    for module in step.model.modules():  # a step that runs a kernel of its own differently on a GPU (zoo/grpo.py)
        if hasattr(module, "mirror_cuda"):
            module.mirror_cuda()


def _require_fake_parameters(step: TrainingStep, name: str) -> None:
    """A model built before the trace began holds real tensors that the tracker never saw
    being made: it would be traced as 0 bytes of parameters. Say so instead."""
    real = [n for n, t in (*step.model.named_parameters(), *step.model.named_buffers())
            if not isinstance(held_tensor(t), fake_tensor.FakeTensor)]  # a DTensor: its shard
    if real:
        raise ModelSpecError(
            f"{name}: build_model returned a model that was built before batchfit called it "
            f"({len(real)} tensors such as '{real[0]}' already existed), so its memory cannot be "
            "traced: construct the model inside build_model, e.g. build_model=lambda: MyModel(config)"
        )


class TraceSession:
    """A Workload built on fake tensors, traced at one batch size after another."""

    def __init__(self, workload: Workload, options: StepOptions, *,
                 capacity_bytes: int | None = None, cuda_semantics: bool = True,
                 wrap: Callable[[nn.Module], nn.Module] | None = None,
                 tracker: MemoryTracker | None = None, warmup_steps: int = 1) -> None:
        """``cuda_semantics=False`` traces what a CPU step does instead (for checking the
        tracer against a real CPU step): CPU autocast, CPU optimizer defaults, no rounding.

        ``wrap`` turns the model into what a multi-GPU run trains (``TrainingStep``'s wrap;
        ``batchfit.plan`` wraps it on a fake process group), with a ``tracker`` (made for this
        session: its rounding is the caller's) that sees what the wrap does; ``warmup_steps``
        are run before the first measured step (DDP rebuilds its gradient buckets in the
        second step's forward)."""
        self.workload = resolved(workload)  # a workload known from the trace cache: its own functions
        self.options = options
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.cuda_semantics = cuda_semantics
        self.tracker = tracker or MemoryTracker(capacity_bytes=capacity_bytes,
                                                round_bytes=CUDA_BLOCK_BYTES if cuda_semantics else 1)
        self.warmup_steps = warmup_steps
        self._warm = False
        self.routed: RoutedExperts | None = None
        """Answers the expert loop's value reads by ``options.routing`` (MoE models only)."""
        self.packing = PackedSequences()
        """Answers transformers' packed-sequence check (``packing.assumed``: where the values decide)."""
        if (options.optimizer or "") in TORCHAO_OPTIMIZERS:
            raise OptionError(f"`optimizer` {options.optimizer} cannot be traced yet: torchao's low-bit optimizers "
                              "compile their step (torch.compile fullgraph=True), which does not run on fake tensors; "
                              "trace adamw-8bit (bitsandbytes, same state bytes as adamw-torchao-8bit) or measure "
                              "it with `batchfit probe --device cuda`")
        # bitsandbytes on fake tensors (trace/bnb_fake.py): for batchfit's --quantize and 8-bit
        # optimizers, and for a workload that imported bitsandbytes itself (a QLoRA model and an
        # 8-bit optimizer built by hand in the user's file: what it makes is traced as made).
        self.uses_bnb = options.quantize != "none" or (options.optimizer or "") in BNB_OPTIMIZERS
        """bitsandbytes' kernels and optimizer state mirrored in the step (set after the build for a
        model or optimizer of the user's that holds bitsandbytes' classes)."""
        self._bnb_ready = self.uses_bnb or sys.modules.get("bitsandbytes") is not None  # None: blocked
        if self._bnb_ready:
            load_bitsandbytes(f"`quantize` {options.quantize}" if options.quantize != "none"
                              else f"`optimizer` {options.optimizer}" if options.optimizer
                              else f"{workload.name} (it imports bitsandbytes)")
            bnb_fake.install()
        preload(options)
        with self.tracing("building the model"), _building_on_fakes():
            # A quantized model is loaded as from_pretrained loads it, each weight quantized as it
            # arrives: its build is counted as what it leaves alive, not the full-precision copy
            # this trace builds first (32 GB for an 8B model, which no QLoRA run holds).
            self.tracker.uncounted = options.quantize != "none"
            try:
                self.step = TrainingStep(workload, options, torch.device("cpu"), wrap=wrap)
            finally:
                self.tracker.uncounted = False
            self.uses_bnb = self.uses_bnb or (self._bnb_ready and bnb_fake.in_use(self.step.model, self.step.optimizer))
            if self.uses_bnb and bnb_fake.holds_quantized(self.step.model):
                # the quantization state labelled parameters, as bitsandbytes saves it with the weight
                bnb_fake.record_loaded(self.step.model, self.tracker)
            if self.uses_bnb:
                bnb_fake.place_quantile_maps(self.step.optimizer, self.tracker)
        _require_fake_parameters(self.step, workload.name)
        if moe_experts(self.step.model):
            self.routed = RoutedExperts(self.step.model, options.routing_spec)
        if self.step.offload is not None:  # what the offload hooks copy out is counted on the host
            self.step.offload.host_context = self.tracker.on_host
        if cuda_semantics:
            install_cuda_mirrors(self.step)
            if self.uses_bnb:
                bnb_fake.page_optimizer_state(self.step.optimizer, self.tracker)
        self.tracker.host_optimizer_scalars = not any(
            g.get("fused") or g.get("capturable") for g in self.step.optimizer.param_groups
        )
        self.compiled = (options.compile != "none"
                         and (getattr(tracker, "trace_compiled", False) or (wrap is None and tracker is None)))
        """Traced compiled (``trace/compiled.py``), else eager: so are sharded steps (``plan``) but
        those whose tracker is marked ``trace_compiled`` (``plan/sharded.py``, from
        ``trace/compiled.py: sharded_traces_compiled``: a DDP wrap among them). Float8 steps run
        inductor's generated code for torchao's graphs (``compiled.inductor_plan``)."""
        self.compiled_parts: list[str] = []
        """What the workload compiled itself, recompiled with the trace's backend."""
        if self.compiled:  # batchfit's module hooks stay out: dynamo would break the graph at each
            compile_for_trace(self.step.model, options.compile, self.tracker, memory_budget=options.memory_budget)
        elif wrap is None and tracker is None:
            self.compiled_parts = retarget_for_trace(self.step, self.tracker)
            self.compiled = bool(self.compiled_parts)
        if not self.compiled:
            self.tracker.watch_modules(self.step.model, main_blocks(self.step.model))
        # Micro-batches 3..N of an accumulating step are written as repeats of the second
        # (MemoryTracker.repeat_micro_batch, docs/tracing/accumulation.md), except
        # where a later micro-batch may differ from the second: a wrapped model (DDP's no_sync
        # and bucket rebuild, zero2's per-micro-batch reduce), offloading (its host bytes add up
        # per micro-batch), compiled or MoE-routed steps, float8 and quantized layers (untried).
        self.tracker.repeats_micro_batches = (
            wrap is None and tracker is None and options.offload == "none" and not self.compiled
            and self.routed is None and options.precision not in FP8_PRECISIONS and options.quantize == "none")
        params = list(self.step.model.parameters())
        # a 4-bit weight counts its values, not its packed bytes (bitsandbytes' quant_state.shape)
        self.params = sum(p.quant_state.shape.numel() if getattr(p, "quant_state", None) is not None else p.numel()
                          for p in params)
        self.trainable_params = sum(p.numel() for p in params if p.requires_grad)
        self.build_events = len(self.tracker.events)
        """The tracker's events up to here are the model's build."""
        self.build_seq = max(self.tracker.live_seqs(), default=0)
        self.fresh_stream: list[tuple[str, int, int]] | None = None
        """The allocation stream of the last ``trace(..., fresh=True)``."""
        self._fresh_repeats: list[tuple[int, int, int]] = []

    @contextlib.contextmanager
    def tracing(self, what: str) -> Iterator[None]:
        """Fake tensors, the tracker and CUDA's attention; errors name ``what`` was being done."""
        try:
            attention = CudaAttention() if self.cuda_semantics else contextlib.nullcontext()
            norm = CudaRmsNorm() if self.cuda_semantics else contextlib.nullcontext()
            cpu_mm = contextlib.nullcontext() if self.cuda_semantics else cpu_scaled_mm_scratch()
            gemm = bnb_fake.BnbKernels(self.cuda_semantics) if self.uses_bnb else contextlib.nullcontext()
            routed = self.routed or contextlib.nullcontext()  # above the fake mode: it sees the reads first
            compiled = trace_context() if getattr(self, "compiled", False) else contextlib.nullcontext()
            with (self.fake_mode, self.tracker, attention, norm, cpu_mm, gemm, routed, compiled, self.packing(),
                  _quiet_fake_tensor_log()):
                yield
        except (torch.OutOfMemoryError, BatchfitError):
            raise
        except _CANNOT_FAKE as error:
            raise TraceError(_value_read_message(self.workload.name, what, error)) from error
        except Exception as error:  # the user's code failed: say where and what
            if any("_nested_tensor_from_mask(" in (f.line or "") for f in traceback.extract_tb(error.__traceback__)):
                raise TraceError(_value_read_message(self.workload.name, what, error)) from error
            where = _user_line(error)
            if "Creating a new Tensor subclass" in str(error) and not getattr(self, "_bnb_ready", True):
                # bitsandbytes' parameters on fake tensors need trace/bnb_fake.py, readied only
                # for a workload that had imported bitsandbytes when the trace began
                raise TraceError(
                    f"{self.workload.name} imports bitsandbytes only inside its build{f' ({where})' if where else ''}, "
                    "after batchfit readied its fake tensors: import bitsandbytes at the top of that file"
                ) from error
            raise TraceError(
                f"the training step of {self.workload.name} failed on fake tensors while "
                f"{what}{f' at {where}' if where else ''}: {_message(error)}"
            ) from error

    def trace(self, batch_size: int, *, fresh: bool = False) -> TracePoint:
        """The peak memory of one optimizer step at ``batch_size``, as a CUDA device would hold it.

        With ``fresh`` the step runs as in a fresh process, after a first step that creates
        the optimizer state, and :attr:`fresh_stream` is that process's allocation stream
        (the build's events and the two steps'): what the caching allocator model replays.
        It is None when something from earlier steps is still alive, which a fresh process
        would not have.
        """
        with self.tracing(f"running a step at batch size {batch_size}"):
            if fresh:
                self.step.optimizer.state.clear()  # as after the build: no state, no gradients
                for p in self.step.model.parameters():
                    p.grad = None
                clean = all(seq <= self.build_seq for seq in self.tracker.live_seqs())
            start = len(self.tracker.events)
            if fresh or not self._warm:
                for _ in range(self.warmup_steps):
                    self.step.run(batch_size, hooks=self.tracker)  # creates the optimizer state
                self._warm = True
            self.tracker.start_window()
            self.step.run(batch_size, hooks=self.tracker)
            if fresh:
                self.fresh_stream = (self.tracker.events[:self.build_events] + self.tracker.events[start:]
                                     if clean else None)
                shift = start - self.build_events
                self._fresh_repeats = [(a - shift, b - shift, n) for a, b, n in self.tracker.repeats if a >= start]
            return TracePoint(batch_size, self.tracker.snapshot(), bnb_fake.paged_bytes(self.step.optimizer))

    @property
    def fresh_folded(self) -> list[tuple[str, int, int]] | None:
        """:attr:`fresh_stream` with its written micro-batches folded into marks
        (``trace/repeats.py``): what depth extension compares; the stream itself where that
        cannot be done exactly."""
        if self.fresh_stream is None or not self._fresh_repeats:
            return self.fresh_stream
        try:
            return repeats.fold(self.fresh_stream, self._fresh_repeats)
        except repeats.NotFolded:
            return self.fresh_stream

    def run_steps(self, batch_size: int, steps: int) -> list[int]:
        """Run ``steps`` more steps; the bytes alive after each (for the leak check)."""
        live = []
        with self.tracing(f"running {steps} steps at batch size {batch_size}"):
            for _ in range(steps):
                self.step.run(batch_size, hooks=self.tracker)
                live.append(self.tracker.live_bytes)
        return live

    def close(self) -> None:
        self.tracker.close()

    def __enter__(self) -> TraceSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
