"""Count the bytes a training step would hold on a CUDA device, from fake tensors.

Every storage an aten op creates is counted the way PyTorch's CUDA caching allocator
counts it in ``memory_allocated()``: its size rounded up to 512 bytes (``kMinBlockSize``
in CUDACachingAllocator.cpp), and released when the last tensor using it dies. Views and
in-place ops share a storage and cost nothing. The tracker keeps one record per storage,
so the live set at the peak can be rebuilt and labelled afterwards.

Labels, in order: parameters (and buffers), gradients and optimizer state by ownership at
the end of the step; otherwise by the phase that made the tensor: inputs, activations
(forward), temporaries (backward and optimizer step), other (model construction).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch._prims.rng_prims import graphsafe_run_with_rng_state, run_and_save_rng_state, run_with_rng_state
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    is_traceable_wrapper_subclass_type,
)
from torch.utils._pytree import tree_leaves

from batchfit.phases import CATEGORY_OF_PHASE
from batchfit.trace.snapshot import Snapshot

CUDA_BLOCK_BYTES = 512
_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default
_LOGSUMEXP = torch.ops.aten.logsumexp.default
_RNG_WRAPPERS = (run_and_save_rng_state, run_with_rng_state, graphsafe_run_with_rng_state)
"""The higher-order operators AOTAutograd's partitioner wraps a random op in when it recomputes it
in backward (``functionalize_rng_ops`` in torch/_functorch/partitioners.py): activation checkpointing
inside a compiled graph, where every SDPA kernel counts as random (it takes a dropout). Each runs the
one op it wraps with the generator's state saved, or set to the saved one, around it."""
CATEGORIES: tuple[str, ...] = (
    "parameters", "gradients", "optimizer_state", "activations", "temporaries", "inputs", "generation",
    "other",
)


def rounded(nbytes: int, block: int = CUDA_BLOCK_BYTES) -> int:
    """Bytes an allocator that rounds to ``block`` hands out for a request of ``nbytes``."""
    return -(-nbytes // block) * block if nbytes > 0 else 0


@dataclass
class Allocation:
    seq: int
    nbytes: int
    phase: str
    op: str
    shape: tuple[int, ...]
    dtype: str
    module: str | None
    role: str | None = None
    freed_seq: int | None = None

    @property
    def category(self) -> str:
        return self.role or CATEGORY_OF_PHASE.get(self.phase, "other")


PARTS: tuple[str, ...] = ("head", "first", "second", "middle", "penultimate", "last", "tail", "repeated")
"""The parts of a phase that runs over the main stack of blocks: before the first block it
runs, the first block, the second, the others between, the one before the last, the last,
after the last (the time between two blocks goes with the block before; with three blocks
the second is also the penultimate). A phase that runs no block is all head; one that runs the
stack more than once (generation, its cache growing) is "repeated", which is not extrapolated.
Forward runs block 0 first; backward runs the last block first (from the gradient of its output to
the gradient of its input). See ``trace.depth`` for how a deep model's peak follows from them."""


def held_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor that holds ``tensor``'s memory: a DTensor's local shard, and inside it (or
    alone) the tensor torchao's ``WeightWithDynamicFloat8CastTensor`` wraps (FSDP2 float8 all-gather)."""
    for attribute in ("_local_tensor", "_tensor"):
        tensor = getattr(tensor, attribute, tensor)
    return tensor


def op_tensors(tree: object) -> Iterator[torch.Tensor]:
    """The tensors in an aten op's arguments or result (tuples, lists, dicts of them): what
    ``tree_leaves`` finds there, without its generic node lookup on every one of the millions of
    ops a generation loop runs (a fifth of the tracker's time)."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (tuple, list)):
        for item in tree:
            yield from op_tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from op_tensors(item)


def pinned_rounded(nbytes: int) -> int:
    """Bytes PyTorch's pinned host allocator takes for ``nbytes``: the next power of two
    (``CachingHostAllocator.h``, ``PowerOf2Ceil``, with the default unlimited
    ``pinned_max_round_threshold``)."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def active_tracker() -> MemoryTracker | None:
    """The tracker counting the ops that run now, if any (model code calls this while built)."""
    return next((m for m in _get_current_dispatch_mode_stack() if isinstance(m, MemoryTracker)), None)


class MemoryTracker(TorchDispatchMode):
    """A dispatch mode that keeps the live and peak bytes of everything ops allocate.

    With ``capacity_bytes`` it behaves like a GPU of that size: an allocation that takes the
    live bytes past it raises ``torch.OutOfMemoryError`` (the virtual device).
    """

    supports_higher_order_operators = True
    """Higher-order operators come to ``__torch_dispatch__`` (torch's default refuses every one):
    those of :data:`_RNG_WRAPPERS` are counted as the op they wrap; any other is still refused."""

    def __init__(self, *, capacity_bytes: int | None = None, round_bytes: int = CUDA_BLOCK_BYTES,
                 host_optimizer_scalars: bool = True) -> None:
        super().__init__()
        self.round_bytes = round_bytes
        self.capacity_bytes = capacity_bytes
        # CUDA optimizers keep 'step' counters on the host unless fused or capturable.
        self.host_optimizer_scalars = host_optimizer_scalars
        self.current_phase = "setup"
        self.live_bytes = 0
        self.peak_bytes = 0
        self._seq = 0
        self._peak_seq = 0
        self._peak_phase = "setup"
        self._peak_by_phase: dict[str, int] = {}
        self._peak_seq_by_phase: dict[str, int] = {}
        self._blocks: set[int] = set()
        self._block_output: weakref.ref | None = None
        self._segment = 0
        """Where the current phase is in its run over the blocks: 0 before the first block,
        2k - 1 inside the k-th block it runs, 2k after it (until the next one starts)."""
        self.segment_marks: list[tuple[int, int]] | None = None
        """(index in ``events``, segment) each time the segment moves, while a call is recorded."""
        self.written = None
        """The calls ``trace/written.py`` writes instead of running again (its ``WrittenCalls``)."""
        self._peak_by_segment: dict[tuple[str, int], tuple[int, int]] = {}
        """(phase, segment) -> (peak bytes, seq at the peak), in the current window."""
        self._live: dict[int, Allocation] = {}
        self._host: set[int] = set()
        self._window: list[Allocation] = []
        self._module_names: dict[int, str] = {}
        # ('malloc', seq, requested bytes) / ('free', seq, 0): for the caching allocator model
        self.events: list[tuple[str, int, int]] = []
        self.streams: dict[int, int] = {}
        """seq -> the side stream (1, 2, ... in order of first use) each malloc made on one was
        made on: FSDP2 allocates its all-gather buffers on its copy-in stream and the gradients
        it reduce-scatters on its reduce-scatter stream (``torch.cpu.stream`` on the fake process
        group, as ``torch.cuda.stream`` on a GPU); the caching allocator keeps each stream's
        blocks apart (``trace/allocator.py``). Mallocs on the default stream are not listed."""
        self._default_stream = torch.cpu.current_stream()
        self._stream_numbers: dict[int, int] = {}
        self.window_event = 0
        """Index in ``events`` where the current window (the measured step) starts."""
        self.on_event: Callable[[str, int, int], None] | None = None
        """Called with each event as it happens (the allocator model of the virtual device)."""
        self._module_stack: list[str] = []
        self._hooks: list = []
        self.repeats_micro_batches = False
        """Run two micro-batches of an accumulating step and write the rest's events down as
        repeats of the second's (``repeat_micro_batch``); the session sets it where that is exact."""
        self._micro_starts: list[tuple[int, int]] = []
        self.repeats: list[tuple[int, int, int]] = []
        """(index in ``events`` where the second micro-batch began, where its written copies
        begin, how many were written) for each ``repeat_micro_batch`` that wrote: what
        ``trace/repeats.py`` folds back into a mark (depth extension on two micro-batches)."""
        """(index in ``events``, seq) where each micro-batch of the current step began."""
        self._event_ident: dict[int, int] = {}
        """seq -> the ident its free is written with: the survivors of the second micro-batch
        stand for those of the last, written repeat (their copies' idents)."""
        self.micro_batches_run = 0
        """Micro-batches the steps traced so far ran (the repeated ones not counted)."""
        self.run_compiled = False
        """Let torch.compile'd code run under this mode (``trace/compiled.py``); dynamo skips
        compiled frames while a mode that does not ignore compile internals is active."""
        self.uncounted = False
        """While set, new storages are not counted: buffers a fused kernel never writes."""
        self.host_round: Callable[[int], int] = pinned_rounded if round_bytes > 1 else (lambda n: n)
        """How the host allocator rounds (pinned memory on CUDA; exact on a CPU, for the truth)."""
        self._on_host = False
        self._pinned: dict[int, Allocation] = {}
        """Host storages the step made for offloading (``on_host``), and what ops make from them."""
        self.host_live_bytes = 0
        self.host_peak_bytes = 0
        """The most host bytes alive at once since start_window()."""
        self.total_peak_bytes = 0
        """The most device + host bytes alive at once since start_window() (a CPU holds both)."""
        self.host_made_bytes = 0
        """Bytes made on the host inside ``on_host`` since start_window() (unrounded): what the
        step's activation offload copied out."""
        self._host_live_by_size: dict[int, int] = {}
        self._host_cached_by_size: dict[int, int] = {}
        """Blocks of each size the pinned allocator holds: it caches freed blocks by size, never
        returning them, so it holds the most blocks of each size ever alive at once (since
        start_window(): the measured step stands for a fresh process at its batch size)."""

    @contextlib.contextmanager
    def on_host(self) -> Iterator[None]:
        """Storages made inside live in (pinned) host memory: counted in the host account."""
        self._on_host, before = True, self._on_host
        try:
            yield
        finally:
            self._on_host = before

    def move_to_host(self, tensor: torch.Tensor) -> None:
        """Count the storage of ``tensor`` (alive, on the device account) on the host from now:
        what a wrap placed in host memory (FSDP2's CPU offload of sharded parameters)."""
        tensor = getattr(tensor, "_local_tensor", tensor)
        storage = tensor.untyped_storage()
        record = self._live.pop(id(storage), None)
        if record is None:
            return
        self.live_bytes -= record.nbytes
        self.events.append(("free", self._event_ident.pop(record.seq, record.seq), 0))
        self._record_host(id(storage), storage, op=record.op, shape=record.shape, dtype=record.dtype)

    @property
    def host_cached_bytes(self) -> int:
        """Host bytes the pinned allocator holds: the most blocks of each size alive at once."""
        return sum(size * count for size, count in self._host_cached_by_size.items())

    def ignore_compile_internals(self) -> bool:  # torch asks the mode on the stack, an instance
        return self.run_compiled

    def write_call(self, key: object, rows: int, device: torch.device, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``workload.shape_only_call``'s call, run or written into this trace (``trace/written.py``)."""
        from batchfit.trace.written import written_call

        return written_call(self, key, rows, device, run)

    def live_seqs(self) -> list[int]:
        """The sequence numbers of the allocations alive now."""
        return [record.seq for record in self._live.values()]

    # --- the step's hooks (batchfit.train.step.StepHooks) ------------------------------------
    def phase(self, name: str) -> None:
        self.current_phase = name
        self._segment = 0
        self._block_output = None
        self._note_phase_peak()

    def _note_phase_peak(self) -> None:
        phase = self.current_phase
        if self.live_bytes > self._peak_by_phase.get(phase, -1):
            self._peak_by_phase[phase] = self.live_bytes
            self._peak_seq_by_phase[phase] = self._seq
        key = (phase, self._segment)
        if self.live_bytes > self._peak_by_segment.get(key, (-1, 0))[0]:
            self._peak_by_segment[key] = (self.live_bytes, self._seq)

    def _block_starts(self, *_) -> None:
        self.set_segment(self._segment + 1 + (self._segment % 2 == 1))  # one that starts inside one: it ended

    def _block_ends(self, *_) -> None:
        if self._segment % 2 == 1:
            self.set_segment(self._segment + 1)

    def set_segment(self, segment: int) -> None:
        """Move the current phase's run over the blocks to ``segment`` (``_segment``), noted in
        ``segment_marks`` while it is a list (``trace/written.py`` records a call's)."""
        self._segment = segment
        if self.segment_marks is not None:
            self.segment_marks.append((len(self.events), segment))
        self._note_phase_peak()

    def micro_batches(self, accumulation: int) -> int:
        """How many of a step's ``accumulation`` micro-batches to run (the rest are repeated)."""
        self._micro_starts = []
        return min(accumulation, 2) if self.repeats_micro_batches else accumulation

    def micro_batch_begins(self, index: int) -> None:
        self.micro_batches_run += 1
        if index < 2:
            self._micro_starts.append((len(self.events), self._seq))

    def repeat_micro_batch(self, times: int) -> bool:
        """Write ``times`` more copies of the second micro-batch's events, as if it ran again.

        After the first micro-batch every one starts from the same live memory (parameters,
        optimizer state, the gradients the first backward allocated and later ones add to in
        place), so each later one allocates and frees what the second did: its own tensors, and
        what the one before it left alive (its detached loss) where the second freed the first's.
        That is checked here: what the second freed from before it must be what the first left
        alive, matched in order one for one with what the second leaves alive (same op, shape,
        dtype, phase, bytes). Otherwise returns False and the step runs the rest itself.
        Peaks and breakdowns need nothing: each repeat holds what the second held."""
        if len(self._micro_starts) != 2:
            return False
        (first_event, first_seq), (second_event, second_seq) = self._micro_starts
        period = self.events[second_event:]
        made = {ident for kind, ident, _ in period if kind == "malloc"}
        freed_before = [ident for kind, ident, _ in period if kind == "free" and ident not in made]
        # idents in events are seqs, except for frees already renamed: none inside one step
        records = {r.seq: r for r in self._window}
        left = sorted(r.seq for r in self._live.values() if r.seq > second_seq)
        if any(not first_seq < seq <= second_seq or seq not in records for seq in freed_before):
            return False
        key = lambda r: (r.op, r.shape, r.dtype, r.phase, r.nbytes)  # noqa: E731
        if len(freed_before) != len(left) or any(key(records[a]) != key(self._live_record(b))
                                                 for a, b in zip(sorted(freed_before), left)):
            return False
        stands_for = dict(zip(sorted(freed_before), left))  # what the first left -> what the second left
        current = {seq: seq for seq in left}  # the second's survivors -> the ident of the latest copy
        at = len(self.events)
        for _ in range(times):
            ident: dict[int, int] = {}
            for kind, seq, nbytes in period:
                if kind == "malloc":
                    self._seq += 1
                    ident[seq] = self._seq
                    event = ("malloc", self._seq, nbytes)
                    if seq in self.streams:
                        self.streams[self._seq] = self.streams[seq]
                elif seq in ident:
                    event = ("free", ident.pop(seq), 0)
                else:
                    event = ("free", current[stands_for[seq]], 0)
                if self.on_event is not None:  # first, as in record(): it may raise out of memory
                    self.on_event(*event)
                self.events.append(event)
            current = {seq: ident[seq] for seq in left}
        self._event_ident.update(current)
        if times:
            self.repeats.append((second_event, at, times))
        return True

    def _live_record(self, seq: int) -> Allocation:
        return next(r for r in self._live.values() if r.seq == seq)

    def before_zero_grad(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.label(model, optimizer)

    def label(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Mark the storages of parameters, gradients and optimizer state by ownership, and name
        each by the parameter it belongs to ('model.embed_tokens.weight'): the module that
        happened to be running when an optimizer made its state says nothing about it."""
        params = dict(model.named_parameters())
        name_of = {id(p): name for name, p in params.items()}
        owned = [("parameters", name, t) for name, t in (*params.items(), *model.named_buffers())]
        owned += [("gradients", name, p.grad) for name, p in params.items() if p.grad is not None]
        if optimizer is not None:
            owned += [("optimizer_state", name_of.get(id(p)), t) for p, state in optimizer.state.items()
                      for t in state.values() if isinstance(t, torch.Tensor)]
        for role, name, tensor in owned:
            # A DTensor (a sharded parameter, its gradient and state) holds its memory in its local shard.
            tensor = held_tensor(tensor)
            record = self._live.get(id(tensor.untyped_storage()))
            if record is not None:
                record.role = role
                record.module = name or record.module

    # --- module names, for "which module made the biggest tensors" ----------------------
    def watch_modules(self, model: nn.Module, blocks: nn.ModuleList | None = None) -> None:
        """Name the modules of ``model``; their forward is followed only while the tracker is
        entered (global module hooks live exactly as long as the ``with`` block). ``blocks``
        (the main stack) cut each phase into :data:`PARTS`."""
        self._module_names = {id(m): name or type(m).__name__ for name, m in model.named_modules()}
        self._blocks = {id(m) for m in blocks or ()}

    def __enter__(self) -> MemoryTracker:
        self._module_stack = []  # a forward that raised last time leaves nothing behind
        if self._module_names and not self._hooks:
            hooks = nn.modules.module
            self._hooks = [hooks.register_module_forward_pre_hook(self._enter_module),
                           hooks.register_module_forward_hook(self._leave_module, always_call=True)]
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        self.close()
        return super().__exit__(*exc)

    def _enter_module(self, module, args):
        self._module_stack.append(self._module_names.get(id(module), type(module).__name__))
        if id(module) in self._blocks and self.current_phase != "backward":  # not a recomputation
            self._block_starts()
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            # the gradient of its input: this block's backward is done (when that input is the
            # block before's output, that block's backward starting says so)
            if first is not None and first.requires_grad and not (self._block_output and self._block_output() is first):
                first.register_hook(self._block_ends)

    def _leave_module(self, module, args, output):
        if self._module_stack:
            self._module_stack.pop()
        if id(module) in self._blocks and self.current_phase != "backward":
            self._block_ends()
            first = next((t for t in tree_leaves(output) if isinstance(t, torch.Tensor)), None)
            self._block_output = weakref.ref(first) if first is not None else None  # not kept alive
            if first is not None and first.requires_grad:  # its gradient: this block's backward starts
                first.register_hook(self._block_starts)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    # --- counting ------------------------------------------------------------------------
    def start_window(self) -> None:
        """Start measuring a new step: the peak restarts from what is live now."""
        self.peak_bytes = self.live_bytes
        self.host_peak_bytes = self.host_live_bytes
        self.host_made_bytes = 0
        # The step at this batch size as a fresh process holds: its own sizes' blocks (the
        # warm-up step before the window has the same sizes), not an earlier batch size's.
        self._host_cached_by_size = {size: n for size, n in self._host_live_by_size.items() if n}
        self.total_peak_bytes = self.live_bytes + self.host_live_bytes
        self._peak_seq = self._seq
        self._peak_phase = self.current_phase
        self._peak_by_phase = {}
        self._peak_seq_by_phase = {}
        self._peak_by_segment = {}
        self._window = list(self._live.values())
        self.window_event = len(self.events)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return self._run_rng_wrapper(func, args, kwargs or {})
        if func is _LOCAL_SCALAR and self.current_phase == "optimizer":
            # An optimizer that reads a scalar back to the host (Adafactor: its step counter and
            # the norms it clips by, via .item()) only uses it in arithmetic on the values, never
            # to decide what to allocate; fake tensors have no value, so answer 1.0, which keeps
            # its arithmetic finite (e.g. step ** -0.8). Anywhere else .item() stays an error:
            # there it may decide shapes.
            return 1.0 if args[0].is_floating_point() else 1
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            # A wrapper subclass (torchao's Float8TrainingTensor, DTensor) runs the op on the
            # tensors it holds, and those ops come back here: what it allocates inside (a float8
            # matmul's contiguous copies and output) is counted as it happens, not just its result.
            return NotImplemented
        if func is _LOGSUMEXP:
            self._logsumexp_scratch(args[0], args[1] if len(args) > 1 else kwargs.get("dim", ()))
        out = func(*args, **(kwargs or {}))
        inputs = None  # looked for only when an op makes a storage: a view (half the ops) makes none
        for tensor in op_tensors(out):
            if self._known(id(tensor.untyped_storage())):
                continue
            if inputs is None:
                inputs = list(op_tensors((args, kwargs)))
            self._maybe_track(tensor, func, inputs)
        return out

    def _logsumexp_scratch(self, tensor: torch.Tensor, dim) -> None:
        """What ``torch.logsumexp`` makes inside its kernel, on any device (ATen's ``logsumexp_out_impl``):
        the input's max along ``dim`` kept, the result sized, then the input less the max, exponentiated
        in place (a tensor the input's size), summed into the result. A dispatch-level trace sees only the
        result, so the three are counted here, made and freed just before it (the op's output is the
        result itself, counted as usual)."""
        if not tensor.is_floating_point() or tensor.numel() == 0:
            return
        maxes = torch.amax(tensor, dim, keepdim=True)
        result = torch.empty_like(maxes)  # sum_out sizes the result while the exponentials exist
        shifted = torch.empty_like(tensor)
        for made in (maxes, result, shifted):
            self._maybe_track(made, _LOGSUMEXP, [tensor])
        del made, shifted, result, maxes

    def _run_rng_wrapper(self, func, args: tuple, kwargs: dict) -> object:
        """Run one of :data:`_RNG_WRAPPERS` below this mode (the fake mode runs the op it wraps and
        skips the generator) and count what the wrapped op made, as if it had run alone. The saved
        generator state (``torch.get_rng_state()``, 5,056 B on a CPU) is counted where the step runs
        on a CPU; on a GPU it is no device memory: ``torch.cuda.get_rng_state()`` is a host tensor,
        and inductor's graph-safe form (``graphsafe_rng_functionalization``, on by default for CUDA)
        passes the generator itself."""
        if func not in _RNG_WRAPPERS:
            raise NotImplementedError(f"the memory trace has no rule for the higher-order operator {func.name()}")
        out = func(*args, **kwargs)
        op = args[1] if func is run_with_rng_state else args[0]
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        made = out
        if func is run_and_save_rng_state:
            state, made = out
            if self.round_bytes > 1:  # CUDA semantics: a host tensor
                self._host.add(id(state.untyped_storage()))
                weakref.finalize(state.untyped_storage(), self._host.discard,
                                 id(state.untyped_storage())).atexit = False
            else:
                self._maybe_track(state, op, [])
        for tensor in tree_leaves(made):
            if isinstance(tensor, torch.Tensor):
                self._maybe_track(tensor, op, inputs)
        return out

    def _is_host(self, tensor: torch.Tensor, inputs: list[torch.Tensor]) -> bool:
        """Would this tensor live on the host in a CUDA run? Outputs of host tensors do, and
        so do the optimizer's scalar step counters (made from nothing or from a constant)."""
        storages = [id(t.untyped_storage()) for t in inputs]
        if any(key in self._live for key in storages):
            return False
        if any(key in self._host for key in storages):
            return True
        return (self.host_optimizer_scalars and self.current_phase == "optimizer"
                and tensor.numel() <= 1)

    def _known(self, key: int) -> bool:
        """Whether the storage ``key`` is counted already (or not to be: ``uncounted``)."""
        return key in self._live or key in self._host or key in self._pinned or self.uncounted

    def _maybe_track(self, tensor: torch.Tensor, func, inputs: list[torch.Tensor]) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if self._known(key):
            return
        if self._on_host or self._made_from_host(inputs):
            self._record_host(key, storage, op=str(func.overloadpacket.__name__), shape=tuple(tensor.shape),
                              dtype=str(tensor.dtype).removeprefix("torch."))
            return
        if self._is_host(tensor, inputs):
            self._host.add(key)
            weakref.finalize(storage, self._host.discard, key).atexit = False
            return
        self.record(key, storage, op=str(func.overloadpacket.__name__), shape=tuple(tensor.shape),
                    dtype=str(tensor.dtype).removeprefix("torch."))

    def _made_from_host(self, inputs: list[torch.Tensor]) -> bool:
        """An optimizer step on offloaded host tensors only (FSDP2's on its CPU shards) runs on the
        host. In forward and backward what is made from them is the device's: FSDP2 copies a
        shard to the GPU before it casts and gathers it (a copy a CPU trace cannot see)."""
        if not self._pinned or self.current_phase != "optimizer":
            return False
        storages = [id(t.untyped_storage()) for t in inputs]
        return any(k in self._pinned for k in storages) and not any(k in self._live for k in storages)

    def _record_host(self, key: int, storage: torch.UntypedStorage, *, op: str, shape: tuple[int, ...],
                     dtype: str) -> None:
        nbytes = self.host_round(storage.nbytes())
        if nbytes == 0:
            return
        self._seq += 1
        record = Allocation(seq=self._seq, nbytes=nbytes, phase=self.current_phase, op=op, shape=shape, dtype=dtype,
                            module=self._module_stack[-1] if self._module_stack else None, role="host")
        self._pinned[key] = record
        if self._on_host:  # the step's own copies out (activation offload), not what a wrap moved
            self.host_made_bytes += storage.nbytes()
        weakref.finalize(storage, self._free_host, key).atexit = False
        self.host_live_bytes += nbytes
        live = self._host_live_by_size[nbytes] = self._host_live_by_size.get(nbytes, 0) + 1
        self._host_cached_by_size[nbytes] = max(live, self._host_cached_by_size.get(nbytes, 0))
        self.host_peak_bytes = max(self.host_peak_bytes, self.host_live_bytes)
        self.total_peak_bytes = max(self.total_peak_bytes, self.live_bytes + self.host_live_bytes)

    def _free_host(self, key: int) -> None:
        record = self._pinned.pop(key, None)
        if record is not None:
            self._seq += 1
            record.freed_seq = self._seq
            self.host_live_bytes -= record.nbytes
            self._host_live_by_size[record.nbytes] -= 1

    def record(self, key: int, storage: torch.UntypedStorage, *, op: str, shape: tuple[int, ...], dtype: str,
               role: str | None = None) -> Allocation | None:
        """Count ``storage`` (keyed ``key``) as allocated now, at its current size; freed when it dies.
        Also for storages given memory by ``resize_`` (FSDP2's gathered parameters)."""
        stream = torch.cpu.current_stream()
        record = self.count(key, storage.nbytes(), op=op, shape=shape, dtype=dtype, role=role,
                            module=self._module_stack[-1] if self._module_stack else None,
                            stream=None if stream is self._default_stream else id(stream))
        if record is not None:
            weakref.finalize(storage, self._free, key).atexit = False
        return record

    def count(self, key: int, requested_bytes: int, *, op: str, shape: tuple[int, ...], dtype: str,
              module: str | None, role: str | None = None, stream: int | None = None) -> Allocation | None:
        """Count an allocation of ``requested_bytes`` keyed ``key`` (freed by ``_free(key)``): what
        :meth:`record` does for a storage, and ``trace/written.py`` for an allocation it writes
        instead of running the op. ``stream``: the side stream's id, None for the default stream."""
        nbytes = rounded(requested_bytes, self.round_bytes)
        if nbytes == 0:
            return None
        self._seq += 1
        if self.on_event is not None:  # first: it may raise out of memory, and then nothing was allocated
            self.on_event("malloc", self._seq, requested_bytes)
        record = Allocation(seq=self._seq, nbytes=nbytes, phase=self.current_phase, op=op, shape=shape, dtype=dtype,
                            module=module, role=role)
        self._live[key] = record
        self._window.append(record)
        self.events.append(("malloc", self._seq, requested_bytes))
        if stream is not None:
            self.streams[self._seq] = self._stream_numbers.setdefault(stream, len(self._stream_numbers) + 1)
        self.live_bytes += nbytes
        self.total_peak_bytes = max(self.total_peak_bytes, self.live_bytes + self.host_live_bytes)
        self._note_phase_peak()
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self._peak_seq = self._seq
            self._peak_phase = self.current_phase
        if self.capacity_bytes is not None and self.live_bytes > self.capacity_bytes:
            gib = 2**30
            raise torch.OutOfMemoryError(
                f"virtual device out of memory: tried to allocate {nbytes / gib:.2f} GiB with "
                f"{(self.live_bytes - nbytes) / gib:.2f} GiB of {self.capacity_bytes / gib:.2f} GiB in use"
            )
        return record

    def _free(self, key: int) -> None:
        record = self._live.pop(key, None)
        if record is not None:
            ident = self._event_ident.pop(record.seq, record.seq)
            self.events.append(("free", ident, 0))
            if self.on_event is not None:
                self.on_event("free", ident, 0)
            self._seq += 1
            record.freed_seq = self._seq
            self.live_bytes -= record.nbytes

    @property
    def clock(self) -> int:
        """A counter that every allocation and free moves on."""
        return self._seq

    def alive_since(self, clock: int) -> list[Allocation]:
        """Allocations made after ``clock`` that are still alive."""
        return [record for record in self._live.values() if record.seq > clock]

    # --- the answer ----------------------------------------------------------------------
    def _live_at(self, seq: int) -> list[Allocation]:
        """What was alive right after event ``seq`` of the current window."""
        return [r for r in self._window if r.seq <= seq and (r.freed_seq is None or r.freed_seq > seq)]

    @staticmethod
    def _breakdown(live: list[Allocation]) -> dict[str, int]:
        breakdown = dict.fromkeys(CATEGORIES, 0)
        for record in live:
            breakdown[record.category] += record.nbytes
        return breakdown

    def snapshot(self, top_n: int = 10) -> Snapshot:
        """The peak since start_window(), with its breakdown and largest tensors."""
        live = self._live_at(self._peak_seq)
        top = sorted(live, key=lambda r: r.nbytes, reverse=True)[:top_n]
        return Snapshot(
            peak_bytes=self.peak_bytes,
            phase=self._peak_phase,
            breakdown=self._breakdown(live),
            top=[{"bytes": r.nbytes, "shape": list(r.shape), "dtype": r.dtype,
                  "category": r.category, "op": r.op, "module": r.module, "phase": r.phase}
                 for r in top],
            peak_by_phase=dict(self._peak_by_phase),
            host_peak_bytes=self.host_peak_bytes,
            host_reserved_bytes=self.host_cached_bytes,
            total_peak_bytes=self.total_peak_bytes,
            offloaded_bytes=self.host_made_bytes,
            breakdown_by_phase={phase: self._breakdown(self._live_at(seq))
                                for phase, seq in self._peak_seq_by_phase.items()},
            **self._parts(),
        )

    def _parts(self) -> dict[str, dict]:
        """Snapshot's ``peak_by_part`` and ``breakdown_by_part`` from the segments' peaks."""
        parts: dict[str, tuple[int, int]] = {}
        last_segment: dict[str, int] = {}
        for phase, segment in self._peak_by_segment:
            last_segment[phase] = max(segment, last_segment.get(phase, 0))
        for (phase, segment), (nbytes, seq) in self._peak_by_segment.items():
            blocks = (last_segment[phase] + 1) // 2
            block = (segment + 1) // 2  # the block this segment is in, or follows
            if blocks not in (0, len(self._blocks)):  # the stack runs more than once (generation)
                names = ["repeated"]
            elif segment == 0:
                names = ["head"]
            elif segment % 2 == 0 and block == blocks:
                names = ["tail"]
            elif block in (1, blocks):
                names = ["first" if block == 1 else "last"]
            else:
                names = ["second"] * (block == 2) + ["penultimate"] * (block == blocks - 1) or ["middle"]
            for name in names:
                key = f"{phase}:{name}"
                if nbytes > parts.get(key, (-1, 0))[0]:
                    parts[key] = (nbytes, seq)
        return {"peak_by_part": {k: v for k, (v, _) in parts.items()},
                "breakdown_by_part": {k: self._breakdown(self._live_at(seq)) for k, (_, seq) in parts.items()}}
