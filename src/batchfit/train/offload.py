"""Activation offloading (``--offload activations``): what autograd saves in the forward moves to
pinned host memory, and comes back in the backward.

A mirror of torchtune's ``OffloadActivations`` (torchtune/training/_activation_offloading.py)
and TRL's copy of it (trl/models/activation_offloading.py), the saved-tensor hooks those
recipes train with; what they keep on the device, kept here too:

- tensors under ``min_offload_size`` bytes (1024, both libraries' default: numel x element size);
- parameters and buffers, and (TRL's addition) any tensor whose storage is a parameter's, such
  as the transposed weight a matmul saves: torchtune would copy those out and back each layer;
- tensors not on the step's device (TRL: they already live on the host);
- the output head's saved tensors (both libraries' ``get_act_offloading_ctx_manager`` runs the
  module named ``output`` or ``lm_head`` under a no-op hook: its activations are needed at once).

The streams' double-buffering changes the peak, so it is kept whatever the device: the last
``max_fwd_stash_size`` (5) offloaded activations stay alive on the device in the forward until
their copy is known done (torchtune's ``fwd_stash``); a tensor still stashed when the backward
asks for it is handed back as it is, without a copy; and a tensor brought back stays alive until
the backward moves on to another autograd node (``bwd_tensor_stash``), or the backward ends. On a
CUDA device the copies run on a side stream with torchtune's events, waits and ``record_stream``
(that path has not run in this repository's tests: no GPU here); elsewhere (a CPU step, the
traced step) they run in order, and only the lifetimes are the same. Not mirrored: TRL's
dedup of two saved tensors that share a storage (torchtune copies each; so does this).

The hooks know nothing about who watches: :attr:`OffloadActivations.host_context` is entered
around every host allocation, and the tracer replaces it with the tracker's host account
(``trace/session.py``), as it replaces the step's autocast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

MIN_OFFLOAD_BYTES = 1024
"""torchtune's and TRL's ``min_offload_size`` default."""
MAX_FWD_STASH = 5
"""torchtune's and TRL's ``max_fwd_stash_size`` default."""
OUTPUT_HEADS = ("output", "lm_head")
"""Where torchtune and TRL look for the output head that stays on the device."""


def _storage_key(tensor: torch.Tensor) -> int:
    tensor = getattr(tensor, "_local_tensor", tensor)  # a DTensor holds its memory in its shard
    return tensor.untyped_storage()._cdata


class OffloadActivations:
    """Saved-tensor hooks that move the forward's saved activations to host memory.

    Enter :meth:`hooks` around a forward; the backward brings each tensor back as it needs it.
    """

    def __init__(self, model: nn.Module, device: torch.device, *, min_offload_bytes: int = MIN_OFFLOAD_BYTES,
                 max_fwd_stash: int = MAX_FWD_STASH) -> None:
        self.device = device
        self.min_offload_bytes = min_offload_bytes
        self.max_fwd_stash = max_fwd_stash
        self.host_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        """Entered around each host allocation (the tracer counts what is made inside on the host)."""
        self.pin_memory = device.type == "cuda"  # pinned memory needs an accelerator's host allocator
        self._streams = ((torch.cuda.default_stream(device), torch.cuda.Stream(device)) if device.type == "cuda"
                         else None)
        """(compute, copies) on CUDA, torchtune's s0 and s1; None elsewhere (copies run in order)."""
        self._events: dict[int, torch.Event] = {}
        """id -> the event after which a stashed tensor may go (CUDA only)."""
        self._param_storages = {_storage_key(t) for t in (*model.parameters(), *model.buffers())}
        self._saved: dict[int, tuple[torch.Tensor, bool]] = {}
        """id -> (host copy, True) or (the tensor itself, False), until the backward asks for it."""
        self._fwd_stash: dict[int, torch.Tensor] = {}
        self._bwd_stash: dict[int, torch.Tensor] = {}
        self._bwd_node = None
        self._next_id = 0
        self._noop_depth = 0
        self.offloaded_bytes = 0
        """Bytes copied to the host in the forwards so far (numel x element size, unrounded)."""
        head = next((m for name in OUTPUT_HEADS if isinstance(m := getattr(model, name, None), nn.Module)), None)
        self._noop_hooks = self._keep_on_device(head) if head is not None else []

    def _keep_on_device(self, module: nn.Module) -> list:
        """The module's saved tensors stay where they are (torchtune's NoOpManager around the head)."""
        def enter(*_):
            self._noop_depth += 1

        def leave(*_):
            self._noop_depth -= 1

        return [module.register_forward_pre_hook(enter),
                module.register_forward_hook(leave, always_call=True)]

    def hooks(self) -> contextlib.AbstractContextManager:
        """The saved-tensor hooks, for one forward (a backward that raised last time leaves no
        stash behind: the step starts clean)."""
        self._backward_done()
        return saved_tensors_hooks(self._pack, self._unpack)

    def _copying(self) -> contextlib.AbstractContextManager:
        """The copy stream on CUDA (torchtune's ``torch.cuda.stream(self.s1)``), else nothing."""
        return torch.cuda.stream(self._streams[1]) if self._streams else contextlib.nullcontext()

    def _drop(self, stash: dict[int, torch.Tensor], ident: int, waiter: int) -> None:
        """Let a stashed tensor go once the stream ``waiter`` (0 compute, 1 copies) has waited
        for its event (torchtune's ``wait_event`` before ``del``)."""
        event = self._events.pop(ident, None)
        if event is not None and self._streams:
            self._streams[waiter].wait_event(event)
        stash.pop(ident, None)

    def _offloads(self, tensor: torch.Tensor) -> bool:
        return (self._noop_depth == 0 and tensor.device == self.device
                and tensor.numel() * tensor.element_size() >= self.min_offload_bytes
                and not isinstance(tensor, nn.Parameter)
                and _storage_key(tensor) not in self._param_storages)

    def _pack(self, tensor: torch.Tensor) -> int:
        self._next_id += 1
        ident = self._next_id
        if not self._offloads(tensor):
            self._saved[ident] = (tensor, False)
            return ident
        # The stash keeps the last few offloaded tensors alive until their copy is done.
        for old in [k for k in self._fwd_stash if k <= ident - self.max_fwd_stash]:
            self._drop(self._fwd_stash, old, 0)
        if self._streams:
            self._streams[1].wait_stream(self._streams[0])
        with self._copying():
            with self.host_context():
                host = torch.empty_like(tensor, device="cpu", pin_memory=self.pin_memory)
            host.copy_(tensor, non_blocking=self.pin_memory)
        if self._streams:
            self._events[ident] = self._streams[1].record_event()
        self.offloaded_bytes += tensor.numel() * tensor.element_size()
        self._saved[ident] = (host, True)
        self._fwd_stash[ident] = tensor
        return ident

    def _unpack(self, ident: int) -> torch.Tensor:
        saved, moved = self._saved.pop(ident)
        if not moved:
            return saved
        node = torch._C._current_autograd_node()  # None outside a backward
        stashed = self._fwd_stash.get(ident)
        if stashed is not None:  # still on the device: torchtune hands it back without a copy
            back = stashed
        else:
            # A new device tensor made from nothing (not empty_like(host)), so a tracker that
            # counts outputs of host tensors on the host counts this one on the device.
            with self._copying():
                back = torch.empty_strided(saved.size(), saved.stride(), dtype=saved.dtype, device=self.device)
                back.copy_(saved, non_blocking=self.pin_memory)
            if self._streams:  # the compute waits for the copy
                self._streams[0].wait_stream(self._streams[1])
        del saved  # the host copy goes (torchtune: del self.tracker[id])
        if node is None:
            return back
        if self._bwd_node is None:  # the first node of this backward: clean up when it ends
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        previous = []
        if node is not self._bwd_node:  # a new node: the last node's tensors go when this one is done
            self._bwd_node = node
            previous = list(self._bwd_stash)
        if stashed is None:
            self._bwd_stash[ident] = back
        node.register_hook(self._node_done(ident, stashed is None, previous))
        return back

    def _node_done(self, ident: int, brought_back: bool, previous: list[int]) -> Callable:
        """torchtune's hook after the node that asked for ``ident``: a tensor whose view the node
        returns leaves the stash (its storage lives on in the output); the forward stash and the
        previous node's tensors are dropped."""
        def hook(grad_inputs, grad_outputs):
            back = self._bwd_stash.get(ident)
            if brought_back and back is not None:
                if any(isinstance(g, torch.Tensor) and g.untyped_storage()._cdata == back.untyped_storage()._cdata
                       for g in grad_inputs):
                    if self._streams:  # torchtune's record_stream: freed when the compute is done with it
                        back.record_stream(self._streams[0])
                    del self._bwd_stash[ident]
                elif self._streams:
                    self._events[ident] = self._streams[0].record_event()
            for old in list(self._fwd_stash):
                self._drop(self._fwd_stash, old, 0)
            for old in previous:
                self._drop(self._bwd_stash, old, 1)
        return hook

    def _backward_done(self) -> None:
        for old in list(self._bwd_stash):
            self._drop(self._bwd_stash, old, 1)
        for old in list(self._fwd_stash):
            self._drop(self._fwd_stash, old, 0)
        self._events.clear()
        self._bwd_node = None

    def remove(self) -> None:
        for hook in self._noop_hooks:
            hook.remove()
