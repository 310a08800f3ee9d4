"""bitsandbytes on fake tensors: what the library lacks to be traced, and what its CUDA kernels
allocate that its fake kernels do not say.

bitsandbytes (>= 0.45) defines its kernels as ``torch.library`` custom ops (``bitsandbytes/_ops.py``)
and registers a fake kernel for each one batchfit's QLoRA step calls (``quantize_4bit``,
``dequantize_4bit``, ``gemm_4bit``, ``quantize_blockwise``, ``dequantize_blockwise``,
``int8_vectorwise_quant``, ``optimizer_update_8bit_blockwise``, ...), so those run on fake
tensors as they are. Four things do not:

1. ``Params4bit`` / ``Int8Params`` are ``nn.Parameter`` subclasses made with
   ``Tensor._make_subclass``, which refuses a fake tensor (its TensorImpl already belongs to a
   ``FakeTensor``). While tracing, a quantized parameter made from a fake tensor is a
   ``FakeTensor`` of a subclass named like bitsandbytes' class (PEFT checks the class name),
   carrying the same attributes and bitsandbytes' own ``_quantize``, and a ``to`` that quantizes
   as bitsandbytes' does: a QLoRA model built by hand in the user's file (``Linear4bit`` with a
   ``Params4bit`` weight) is quantized where batchfit moves it, as ``model.to("cuda")`` would.
2. The quantile maps (``functional.create_dynamic_map``: the 8-bit dynamic code of double
   quantization and of the 8-bit optimizers) are built from Python lists with ``.tolist()``,
   which a fake tensor cannot answer: they are built once from real tensors (256 values each).
3. ``gemm_4bit``'s fake kernel returns only the output. On CUDA, for more than 1536 rows
   (``_gemm_4bit_custom_max_m``, every training batch of a few sequences) the kernel is
   ``_dequant_linear_fallback`` (``backends/cuda/ops.py``): the nested absmax dequantized
   (fp32, one per 64-block) plus its offset, the whole weight dequantized ``[N, K]`` in the
   input's dtype, then ``F.linear``; the CPU runs the same (``_gemm_4bit_default_impl``,
   ``backends/default/ops.py``). :class:`BnbKernels` runs those ops on the fake tensors, so
   the temporaries are counted; below 1536 rows on CUDA only the output (the fused kernel).
   Likewise the CPU's optimizer kernels, for the truth runs on this CPU.
4. Paged optimizer state (``Optimizer8bit.get_state_buffer``: ``is_paged`` and at least 1e5
   elements) lives in CUDA unified memory (``functional.get_paged``, ``cudaMallocManaged``),
   outside the caching allocator; on the CPU bitsandbytes falls back to ordinary tensors. While
   tracing for CUDA it is made uncounted and its bytes are reported apart (``paged_bytes``).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from batchfit.trace.memory import MemoryTracker

CUDA_CUSTOM_MAX_ROWS = 1536
"""``_gemm_4bit_custom_max_m`` (bitsandbytes/backends/cuda/ops.py): above it, dequantize + linear."""
PAGED_MIN_NUMEL = 100_000
"""``Optimizer8bit.get_state_buffer``: smaller states are ordinary device tensors."""
_PARAM_ATTRS = {
    "Params4bit": ("blocksize", "compress_statistics", "quant_type", "quant_state", "quant_storage",
                   "bnb_quantized", "module"),
    "Int8Params": ("CB", "SCB", "has_fp16_weights"),
}


@functools.cache
def _fake_param_class(name: str) -> type:
    """A FakeTensor subclass standing for bitsandbytes' ``name`` (its methods, its class name)."""
    import bitsandbytes as bnb

    real = getattr(bnb.nn, name)
    def __deepcopy__(self, memo):  # PEFT's DoRA copies the base layer (Params4bit.__deepcopy__)
        # the quantization state is shared, not copied: deep-copying fake tensors copies their fake mode
        attrs = {k: copy.copy(getattr(self, k)) for k in _PARAM_ATTRS[name]}
        return _fake_param(name, self.detach().clone(), self.requires_grad, attrs)

    def to(self, *args, **kwargs):
        # bitsandbytes' own ``to`` (its ``super()`` needs the real class): a weight not yet
        # quantized is quantized where it goes (Params4bit: any device but meta; Int8Params: from
        # the CPU), as a user's ``model.to("cuda")`` quantizes a QLoRA model built by hand.
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None and device.type != "meta" and not _is_quantized(self):
            return self._quantize(device)
        moved = torch.Tensor.to(self, device=device, dtype=dtype, non_blocking=non_blocking)
        if moved is self:
            return self
        return _fake_param(name, moved, self.requires_grad, {k: getattr(self, k) for k in _PARAM_ATTRS[name]})

    methods = {"_quantize": real._quantize, "__qualname__": name, "__module__": real.__module__,
               "__deepcopy__": __deepcopy__, "to": to}
    for attr in ("absmax", "code", "quant_map", "offset", "state2", "nested_absmax", "nested_blocksize",
                 "nested_quant_map", "nested_dtype", "nested_offset"):
        if isinstance(getattr(real, attr, None), property):
            methods[attr] = getattr(real, attr)
    return type(name, (FakeTensor,), methods)


def _is_quantized(param: torch.Tensor) -> bool:
    """Whether a (fake) bitsandbytes parameter holds its quantized data already."""
    if type(param).__name__ == "Params4bit":
        return bool(param.bnb_quantized)
    return param.dtype == torch.int8  # Int8Params.to's own test


def holds_quantized(model: nn.Module) -> bool:
    """Whether ``model`` holds bitsandbytes' quantized parameters (built by batchfit's --quantize
    or by the user's own code: ``Linear4bit`` with a ``Params4bit`` weight)."""
    return any(type(p).__name__ in _PARAM_ATTRS and type(p).__module__.startswith("bitsandbytes")
               and _is_quantized(p) for p in model.parameters())


def in_use(model: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``model`` holds bitsandbytes' layers or parameters, or ``optimizer`` is one of its
    optimizers: the step then runs bitsandbytes' kernels, which :class:`BnbKernels` mirrors."""
    def ours(obj: object) -> bool:
        return type(obj).__module__.startswith("bitsandbytes")

    return (ours(optimizer) or any(ours(m) for m in model.modules()) or any(ours(p) for p in model.parameters()))


def _fake_param(name: str, data: torch.Tensor, requires_grad: bool, attrs: dict[str, Any]) -> torch.Tensor:
    param = data.detach()
    param.__class__ = _fake_param_class(name)
    param.requires_grad_(requires_grad)
    param._is_param = True  # isinstance(param, nn.Parameter), as nn.Parameter marks fake tensors
    for key, value in attrs.items():
        setattr(param, key, value)
    return param


def _params4bit_new(original, cls, data=None, requires_grad=False, quant_state=None, blocksize=None,
                    compress_statistics=True, quant_type="fp4", quant_storage=torch.uint8, module=None,
                    bnb_quantized=False, **kwargs):
    if not isinstance(data, FakeTensor):
        return original(cls, data, requires_grad, quant_state, blocksize, compress_statistics, quant_type,
                        quant_storage, module, bnb_quantized, **kwargs)
    return _fake_param("Params4bit", data, requires_grad, {
        "blocksize": blocksize or 64, "compress_statistics": compress_statistics, "quant_type": quant_type,
        "quant_state": quant_state, "quant_storage": quant_storage, "bnb_quantized": bnb_quantized,
        "module": module})


def _int8params_new(original, cls, data=None, requires_grad=True, has_fp16_weights=False, CB=None, SCB=None,
                    **kwargs):
    if not isinstance(data, FakeTensor):
        return original(cls, data, requires_grad, has_fp16_weights, CB, SCB, **kwargs)
    return _fake_param("Int8Params", data, requires_grad, {"has_fp16_weights": has_fp16_weights,
                                                           "CB": CB, "SCB": SCB})


@functools.cache
def install() -> None:
    """Let bitsandbytes run on fake tensors (once per process; real tensors take bitsandbytes'
    own paths unchanged)."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F
    from bitsandbytes.optim.optimizer import Optimizer8bit

    for name, new in (("Params4bit", _params4bit_new), ("Int8Params", _int8params_new)):
        cls = getattr(bnb.nn, name)
        cls.__new__ = staticmethod(functools.partial(new, cls.__new__))
    def linear4bit_deepcopy(self, memo):
        # PEFT's DoRA deep-copies the base layer only to dequantize it for the weight norm, and
        # drops it (peft/tuners/lora/dora.py: DoraLinearLayer.update_layer, an FSDP workaround);
        # deep-copying fake tensors copies their fake mode, so a fake layer is read in place.
        if isinstance(self.weight, FakeTensor):
            return self
        return nn.Module.__deepcopy__(self, memo) if hasattr(nn.Module, "__deepcopy__") else _plain_deepcopy(self, memo)

    bnb.nn.Linear4bit.__deepcopy__ = linear4bit_deepcopy
    signed, unsigned = F.create_dynamic_map(signed=True), F.create_dynamic_map(signed=False)
    F.name2qmap.setdefault("dynamic", signed)  # quantize_blockwise's default code (double quant)
    fill_qmap = Optimizer8bit.fill_qmap

    def fill_qmap_from_real(self) -> None:
        if _in_fake_mode():
            self.name2qmap["dynamic"], self.name2qmap["udynamic"] = signed.clone(), unsigned.clone()
        else:
            fill_qmap(self)

    Optimizer8bit.fill_qmap = fill_qmap_from_real


def _plain_deepcopy(module, memo):
    """``copy.deepcopy``'s own path for an object without ``__deepcopy__``."""
    cls = type(module)
    clone = cls.__new__(cls)
    memo[id(module)] = clone
    clone.__dict__.update(copy.deepcopy(module.__dict__, memo))
    return clone


def _in_fake_mode() -> bool:
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


class BnbKernels(TorchDispatchMode):
    """bitsandbytes' kernels as the device runs them, where the fake kernel says less (3. above).

    For CUDA: ``gemm_4bit`` past 1536 rows dequantizes and calls ``F.linear``; the fused 8-bit and
    32-bit optimizer kernels allocate nothing (their fake kernels, as they are). For the CPU (the
    truth runs): ``gemm_4bit`` always dequantizes (``_gemm_4bit_default_impl``), and the optimizer
    updates run bitsandbytes' CPU kernels (``backends/cpu/ops.py``: ``_optimizer_update_8bit_blockwise_cpu``
    dequantizes both states to fp32, updates, quantizes them back), op by op on the fake tensors."""

    def __init__(self, cuda: bool) -> None:
        super().__init__()
        self.cuda = cuda
        ops = torch.ops.bitsandbytes
        self._gemm = ops.gemm_4bit.default
        self._cpu_optimizer = {ops.optimizer_update_8bit_blockwise.default: "_optimizer_update_8bit_blockwise_cpu",
                               ops.optimizer_update_32bit.default: "_optimizer_update_32bit_cpu"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is self._gemm:
            A = args[0]
            if not self.cuda or A.numel() // A.shape[-1] > CUDA_CUSTOM_MAX_ROWS:
                from bitsandbytes.backends.default.ops import _gemm_4bit_default_impl

                return _gemm_4bit_default_impl(*args, **kwargs)
        elif func in self._cpu_optimizer and not self.cuda:
            from bitsandbytes.backends.cpu import ops as cpu_ops

            return getattr(cpu_ops, self._cpu_optimizer[func])(*args, **kwargs)
        return func(*args, **kwargs)


def page_optimizer_state(optimizer: torch.optim.Optimizer, tracker: MemoryTracker) -> None:
    """Make a paged bitsandbytes optimizer's paged state uncounted (it is not in the caching
    allocator) and remember it: :func:`paged_bytes` sums it."""
    if not getattr(optimizer, "is_paged", False):
        return
    own = optimizer.get_state_buffer

    def get_state_buffer(p, dtype=torch.float32):
        if p.numel() < PAGED_MIN_NUMEL:
            return own(p, dtype=dtype)
        uncounted, tracker.uncounted = tracker.uncounted, True
        try:
            buffer = torch.zeros_like(p, dtype=dtype)  # get_paged's bytes: numel x itemsize, not rounded
        finally:
            tracker.uncounted = uncounted
        buffer.is_paged = True
        return buffer

    optimizer.get_state_buffer = get_state_buffer
    optimizer._cpu_paged_warned = True  # its "not supported on CPU" warning speaks of a CPU run, not this trace
    optimizer.prefetch_state = lambda p: None  # cudaMemPrefetchAsync: a hint that allocates nothing


def place_quantile_maps(optimizer: torch.optim.Optimizer, tracker: MemoryTracker) -> None:
    """Put a bitsandbytes 8-bit optimizer's quantile maps on the device now (while the model is
    built), not in its first step: there ``init_state`` moves them with the first parameter's
    state, which makes the first block's state differ from the others (2 KB, once) and the
    stream of a model traced by depth irregular. Counted as optimizer state, also where the
    optimizer was made while the tracker did not count (a model quantized by --quantize)."""
    from bitsandbytes.optim.optimizer import Optimizer8bit

    if isinstance(optimizer, Optimizer8bit) and getattr(optimizer.args, "optim_bits", 32) == 8:
        if "dynamic" not in optimizer.name2qmap:
            optimizer.fill_qmap()
        device = next((p.device for g in optimizer.param_groups for p in g["params"]), None)
        for key in ("dynamic", "udynamic"):
            qmap = optimizer.name2qmap[key] = optimizer.name2qmap[key].to(device)
            storage = qmap.untyped_storage()
            if isinstance(qmap, FakeTensor) and id(storage) not in tracker._live:
                tracker.record(id(storage), storage, op="load", shape=tuple(qmap.shape),
                               dtype=str(qmap.dtype).removeprefix("torch."), role="optimizer_state")


def paged_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of paged optimizer state alive now (CUDA unified memory: it spills to the host)."""
    return sum(t.untyped_storage().nbytes() for state in optimizer.state.values() for t in state.values()
               if isinstance(t, torch.Tensor) and getattr(t, "is_paged", False))


def _tensors(value: Any, seen: set[int]) -> list[torch.Tensor]:
    """The tensors in a quantization state (``QuantState`` and its nested ``state2``, an
    ``Int8Params``' ``CB`` / ``SCB``, a ``MatmulLtState``), found through their attributes."""
    if id(value) in seen or value is None or isinstance(value, (int, float, str, bool, torch.dtype)):
        return []
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v, seen)]
    return [t for v in getattr(value, "__dict__", {}).values() for t in _tensors(v, seen)]


def record_loaded(model: nn.Module, tracker: MemoryTracker) -> None:
    """Count what a quantized model holds once built, one allocation per storage, in the order a
    loader makes them: parameters, buffers and each layer's quantization state (absmax, codes:
    labelled parameters too, as bitsandbytes saves them with the weight). What a build the tracker
    counted made already (the user's own quantization) is only labelled."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    for module in model.modules():
        for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            found.append(tensor)
            for attr in ("quant_state", "CB", "SCB"):
                found += _tensors(getattr(tensor, attr, None), seen)
        found += _tensors(getattr(module, "state", None), seen) if hasattr(module, "state") else []
    for tensor in found:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in tracker._live:  # made while the user's own build_model quantized it: counted then
            tracker._live[key].role = "parameters"
        else:
            tracker.record(key, storage, op="load", shape=tuple(tensor.shape),
                           dtype=str(tensor.dtype).removeprefix("torch."), role="parameters")
