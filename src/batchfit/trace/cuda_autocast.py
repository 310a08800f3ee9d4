"""Make CPU autocast behave like CUDA autocast while tracing.

The tracer runs on fake CPU tensors, because this CPU build of PyTorch cannot fake CUDA
tensors past their creation. CPU autocast and CUDA autocast cast different ops: on CUDA,
``softmax``, ``log_softmax``, ``layer_norm``, ``rms_norm``, ``norm`` and ``sum`` give fp32
(so the logits of a language model become an fp32 tensor inside the loss), on CPU they stay
in bf16; CUDA refuses ``binary_cross_entropy`` outright. Since that changes the bytes of the
largest tensors of a step, :class:`CudaAutocast` runs CUDA's table for the duration of a trace.

Which ops: the dispatcher's ``AutocastCUDA`` registrations of the installed PyTorch (they
exist in the CPU build too). Which policy each has: the macros of ``ATen/autocast_mode.h``
(the same ones that build the CUDA table) plus the few registrations that
``aten/src/ATen/autocast_mode.cpp`` makes by hand (``cudnn_convolution*``; ``norm``'s
fp32_append_dtype via ``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE``; ``binary_cross_entropy``,
banned). :func:`not_mirrored` lists what is registered but has no policy here, with the reason.
Each policy does what ``WrapFunction_`` in ``autocast_mode.h`` does for CUDA, including the
cast cache of fp32 leaf tensors that require grad (the model weights).

How: the kernels are registered once per process on a dispatch key that no tensor carries,
``AutocastIPU`` (Graphcore's; it sorts above ``AutocastCPU``, so it runs first). Entering
:class:`CudaAutocast` adds that key to the thread's dispatch keys; leaving removes it. CPU
autocast's own kernels are never replaced, so outside a trace it behaves exactly as before,
and entering the mirror costs two thread-local flag flips. The mirror's kernels act only
while CPU autocast is on (``forward()``, and checkpointing's recomputation, which turns CPU
autocast back on as it was in forward), and then keep CPU autocast's kernels out of the way.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.utils._pytree import tree_leaves, tree_map

_HEADER = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
_MIRROR_KEY = torch._C.DispatchKey.AutocastIPU
_CPU_KEY = torch._C.DispatchKey.AutocastCPU
_BOTH_KEYS = torch._C.DispatchKeySet(_MIRROR_KEY) | torch._C.DispatchKeySet(_CPU_KEY)
_COMPOSITE_KEY = torch._C.DispatchKey.CompositeImplicitAutograd

_MACRO_POLICIES = {
    "AT_FORALL_LOWER_PRECISION_FP": "lower_precision_fp",
    "AT_FORALL_FP32": "fp32",
    "AT_FORALL_FP32_SET_OPT_DTYPE": "fp32_set_opt_dtype",
    "AT_FORALL_PROMOTE": "promote",
}

# Registered for AutocastCUDA in autocast_mode.cpp itself, outside the header's macros.
_CPP_POLICIES = {
    "aten::cudnn_convolution": "lower_precision_fp",
    "aten::cudnn_convolution_transpose": "lower_precision_fp",
    "aten::binary_cross_entropy": "banned",
}

# PyTorch 2.13's header, for builds that do not ship include/ (one string per macro).
_FALLBACK = {
    "lower_precision_fp": "_convolution.deprecated _convolution conv1d conv2d conv3d conv_tbc "
    "conv_transpose1d conv_transpose2d.input conv_transpose3d.input convolution prelu addmm addmv "
    "addr matmul einsum mm mv linalg_vecdot linear addbmm baddbmm bmm chain_matmul "
    "linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell "
    "rnn_relu_cell _scaled_dot_product_flash_attention scaled_dot_product_attention",
    "fp32": "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan "
    "pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm rms_norm "
    "group_norm frobenius_norm.dim nuclear_norm nuclear_norm.dim cosine_similarity poisson_nll_loss "
    "cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss smooth_l1_loss "
    "huber_loss mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss "
    "triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm "
    "logsumexp upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d "
    "_upsample_nearest_exact2d upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d "
    "upsample_bilinear2d _upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d "
    "_upsample_bicubic2d_aa",
    "fp32_set_opt_dtype": "prod prod.dim_int softmax.int log_softmax.int cumprod cumsum "
    "linalg_vector_norm linalg_matrix_norm linalg_matrix_norm.str_ord sum sum.dim_IntList",
    "fp32_append_dtype": "norm.Scalar norm.ScalarOpt_dim",
    "promote": "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot "
    "scatter_add",
}

# What CUDA raises (binary_cross_entropy_banned in autocast_mode.cpp), word for word.
BCE_BANNED_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast."
)


def _header_policies(text: str) -> dict[str, str]:
    """``{'aten::op.overload': policy}`` from the macros of ``autocast_mode.h``."""
    policies = {}
    for macro, policy in _MACRO_POLICIES.items():
        body = re.search(rf"#define {macro}\(_\)(.*?)\n\n", text, re.S)
        for name, overload in re.findall(r"_\((\w+)(?:,\s*(\w+))?\)", body.group(1) if body else ""):
            policies[f"aten::{name}.{overload}" if overload else f"aten::{name}"] = policy
    body = re.search(r"#define AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE\(_\)(.*?)\n\n", text, re.S)
    for entry in (body.group(1).replace("\\\n", " ").split("_(ADD_NS(")[1:] if body else []):
        found = re.search(r'"([\w.]+)".*,\s*(\w+)\)', entry, re.S)
        if found:
            policies[f"aten::{found.group(1)}"] = found.group(2)
    return policies


def _fallback_policies() -> dict[str, str]:
    return {f"aten::{op}": policy for policy, ops in _FALLBACK.items() for op in ops.split()}


@functools.cache
def _known_policies() -> dict[str, str]:
    parsed = _header_policies(_HEADER.read_text()) if _HEADER.exists() else {}
    return {**_fallback_policies(), **parsed, **_CPP_POLICIES}


@functools.cache
def cuda_autocast_policies() -> dict[str, str]:
    """The policy of each op that CUDA autocast handles in the installed PyTorch.

    Keys are the dispatcher's names (``aten::softmax.int``; no overload means ``default``),
    values one of ``lower_precision_fp``, ``fp32``, ``fp32_set_opt_dtype``,
    ``fp32_append_dtype``, ``promote``, ``banned``.
    """
    known = _known_policies()
    registered = torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")
    return {op: known[op] for op in sorted(registered) if op in known and _resolve(op)}


@functools.cache
def not_mirrored() -> dict[str, str]:
    """CUDA autocast registrations the mirror leaves alone, and why."""
    known, skipped = _known_policies(), {}
    for op in sorted(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")):
        if not op.startswith("aten::"):
            skipped[op] = ("registered by another library with a policy of its own; "
                           "its CPU autocast kernel, if any, runs instead")
        elif op not in known:
            skipped[op] = ("no policy known to batchfit for this PyTorch version; CPU autocast's "
                           "rule applies (add it to cuda_autocast.py)")
        elif _resolve(op) is None:
            skipped[op] = "not callable from Python in this build"
    return skipped


def _resolve(qualified: str) -> torch._ops.OpOverload | None:
    name, _, overload = qualified.removeprefix("aten::").partition(".")
    return getattr(getattr(torch.ops.aten, name, None), overload or "default", None)


def _eligible(t: object) -> bool:
    """CUDA's ``is_eligible``: floating point and not double (the device is taken as CUDA)."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


class _CastCache:
    """CUDA autocast caches the low-precision copy of each fp32 leaf that requires grad."""

    def __init__(self) -> None:
        self.copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.enabled = False

    def cast(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if t.dtype == dtype:
            return t
        # cached_cast's test: a cast to the low dtype, of an fp32 leaf (not a view) that requires grad
        cacheable = (self.enabled and dtype != torch.float32 and t.dtype == torch.float32
                     and t.is_leaf and t.requires_grad and not t._is_view())
        if cacheable and id(t) in self.copies:
            return self.copies[id(t)][1]
        copy = t.to(dtype)
        if cacheable:
            self.copies[id(t)] = (t, copy)  # keep the source so its id is not reused
        return copy


_active: list[CudaAutocast] = []
_NO_CACHE = _CastCache()


def _cast_all(args, kwargs, to: Callable[[torch.Tensor], torch.Tensor]):
    cast = lambda t: to(t) if _eligible(t) else t  # noqa: E731
    return tree_map(cast, args), tree_map(cast, kwargs)


def _policy_call(op, policy: str, args: tuple, kwargs: dict) -> object:
    """What CUDA's wrapper does for ``policy`` (autocast keys already excluded)."""
    low = torch.get_autocast_dtype("cpu")
    if policy == "lower_precision_fp":
        cache = _active[-1].cache if _active else _NO_CACHE
        args, kwargs = _cast_all(args, kwargs, lambda t: cache.cast(t, low))
        return op(*args, **kwargs)
    if policy == "fp32":
        args, kwargs = _cast_all(args, kwargs, lambda t: t.float())
        return op(*args, **kwargs)
    if policy == "fp32_set_opt_dtype":
        # The output dtype becomes fp32 when none was given; the input is read as it is.
        names = [a.name for a in op._schema.arguments]
        if args and _eligible(args[0]) and "dtype" in names:
            at = names.index("dtype")
            if at < len(args) and args[at] is None:
                args = (*args[:at], torch.float32, *args[at + 1:])
            elif at >= len(args) and kwargs.get("dtype") is None:
                kwargs = {**kwargs, "dtype": torch.float32}
        return op(*args, **kwargs)
    if policy == "fp32_append_dtype":
        # norm(x, p) becomes norm(x, p, dtype=fp32): the overload that takes a dtype.
        out_dtype = torch.float32 if _eligible(args[0]) else args[0].dtype
        return _with_dtype_overload(op)(*args, **kwargs, dtype=out_dtype)
    if policy == "promote":
        widest = low
        for t in tree_leaves((args, kwargs)):
            if not _eligible(t) or t.dtype == widest:
                continue
            if t.dtype != torch.float32 and widest != torch.float32:
                raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
            widest = torch.float32
        args, kwargs = _cast_all(args, kwargs, lambda t: t.to(widest))
        return op(*args, **kwargs)
    if policy == "banned":
        raise RuntimeError(BCE_BANNED_MESSAGE)
    raise ValueError(f"unknown autocast policy {policy!r}")


@functools.cache
def _with_dtype_overload(op: torch._ops.OpOverload) -> torch._ops.OpOverload:
    """The overload of ``op``'s packet whose arguments are ``op``'s plus ``dtype``."""
    names = [a.name for a in op._schema.arguments] + ["dtype"]
    packet = getattr(torch.ops.aten, op._schema.name.removeprefix("aten::"))
    for overload in packet.overloads():
        candidate = getattr(packet, overload)
        if [a.name for a in candidate._schema.arguments] == names:
            return candidate
    raise RuntimeError(f"{op} has no overload with a dtype argument to append fp32 to")


def _mirror_kernel(op: torch._ops.OpOverload, policy: str):
    def kernel(keyset, *args, **kwargs):
        # Off outside forward: CPU autocast's flag is what checkpointing saves and restores.
        # (The keyset cannot tell: it drops AutocastCPU for ops CPU autocast has no kernel for.)
        if not torch.is_autocast_enabled("cpu"):
            return _past(op, keyset, _MIRROR_KEY, args, kwargs)
        # As CUDA's wrappers do, the op and everything it calls run with autocast off.
        with torch._C._ExcludeDispatchKeyGuard(_BOTH_KEYS):
            return _policy_call(op, policy, args, kwargs)

    return kernel


def _skip_cpu_autocast_kernel(op: torch._ops.OpOverload):
    # An op that CPU autocast casts and CUDA autocast does not: run it past both keys, so a
    # composite one (cross_entropy_loss) decomposes into ops that meet CUDA's table again.
    composite = torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), _COMPOSITE_KEY)

    def kernel(keyset, *args, **kwargs):
        if composite and _python_dispatcher_on():
            return op.decompose(*args, **kwargs)  # what the Autograd key runs after a fallthrough
        return _past(op, keyset, _BOTH_KEYS, args, kwargs)

    return kernel


def _python_dispatcher_on() -> bool:
    return torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PythonDispatcher)


def _past(op: torch._ops.OpOverload, keyset: torch._C.DispatchKeySet, keys, args: tuple, kwargs: dict) -> object:
    """``op`` run past ``keys`` (the mirror's, or both autocast keys).

    Eager, a redispatch with them removed: ops ``op`` calls inside meet the mirror again. Under
    the Python dispatcher (dynamo and AOTAutograd trace with it on) a redispatch is not one:
    ``ConcretePyInterpreterVTable::python_dispatcher`` (torch/csrc/PyInterpreter.cpp) calls the
    next key's kernel with ``callBoxedForDispatchKey`` ("not redispatch, as that will
    permanently remove the python dispatcher"), which computes the keys afresh from the
    tensors and the thread's set, finds the mirror's key again and comes back here, without
    end (the RecursionError that kept compiled traces under mixed precision eager). There the
    keys are excluded from the thread's set for the call instead.
    """
    keys = torch._C.DispatchKeySet(keys) if isinstance(keys, torch._C.DispatchKey) else keys
    if not _python_dispatcher_on():
        for key in (_MIRROR_KEY, _CPU_KEY):
            if keys.has(key):
                keyset = keyset.remove(key)
        return op.redispatch(keyset, *args, **kwargs)
    with torch._C._ExcludeDispatchKeyGuard(keys):
        return op(*args, **kwargs)


@functools.cache
def _install() -> tuple[torch.library.Library, torch.library.Library]:
    """Register the mirror's kernels, once per process; they act only where the key is on."""
    lib = torch.library.Library("aten", "IMPL")
    fallback = torch.library.Library("_", "IMPL")
    # Ops with no kernel of ours go straight on (no tensor carries the key by itself).
    fallback.fallback(torch.library.fallthrough_kernel, _MIRROR_KEY.name)
    policies = cuda_autocast_policies()
    for qualified, policy in policies.items():
        lib.impl(_resolve(qualified), _mirror_kernel(_resolve(qualified), policy),
                 _MIRROR_KEY.name, with_keyset=True)
    for qualified in sorted(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU")):
        op = _resolve(qualified) if qualified.startswith("aten::") else None
        if op is not None and qualified not in policies:
            lib.impl(op, _skip_cpu_autocast_kernel(op), _MIRROR_KEY.name, with_keyset=True)
    return lib, fallback


class CudaAutocast:
    """CUDA's autocast table on CPU, for one training step.

    Enter it around the whole step (recomputation under activation checkpointing re-enters
    autocast during backward, and must see the same table); autocast itself is on only in
    ``forward()``. As on CUDA, the low-precision copies of the weights are cached for the
    forward region and freed when it ends; casts made outside it (recomputation) are not
    cached, as CUDA frees them when each recomputation's autocast region ends.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.cache = _CastCache()
        self._saved_tls: tuple[bool, bool] | None = None

    def __enter__(self) -> CudaAutocast:
        _install()
        self._saved_tls = (torch._C._dispatch_tls_is_dispatch_key_included(_MIRROR_KEY),
                           torch._C._dispatch_tls_is_dispatch_key_excluded(_MIRROR_KEY))
        # Autocast keys start excluded for every thread; the mirror's must be let in too.
        torch._C._dispatch_tls_set_dispatch_key_excluded(_MIRROR_KEY, False)
        torch._C._dispatch_tls_set_dispatch_key_included(_MIRROR_KEY, True)
        _active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _active.remove(self)
        self.cache.copies.clear()
        included, excluded = self._saved_tls
        torch._C._dispatch_tls_set_dispatch_key_included(_MIRROR_KEY, included)
        torch._C._dispatch_tls_set_dispatch_key_excluded(_MIRROR_KEY, excluded)

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """The autocast region of the forward pass."""
        self.cache.enabled = True
        try:
            # CPU autocast's own cache stays off: the mirror keeps CUDA's.
            with torch.autocast("cpu", dtype=self.dtype, cache_enabled=False):
                yield
        finally:
            self.cache.enabled = False
            self.cache.copies.clear()
