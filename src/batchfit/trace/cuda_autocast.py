"""Make CPU autocast behave like CUDA autocast while tracing.

The tracer runs on fake CPU tensors, because this CPU build of PyTorch cannot fake CUDA
tensors past their creation. CPU autocast and CUDA autocast cast different ops: on CUDA,
``softmax``, ``log_softmax``, ``layer_norm`` and ``rms_norm`` run in fp32 (so the logits of a
language model become an fp32 tensor inside the loss), on CPU they stay in bf16. Since that
changes the bytes of the largest tensors of a step, :class:`CudaAutocast` swaps the
CPU autocast table for CUDA's for the duration of a trace.

The op lists are read from ``ATen/autocast_mode.h`` of the installed PyTorch (the same
macros that build the CUDA table), so they follow the user's PyTorch version. Each policy
does what ``WrapFunction_`` in ``aten/src/ATen/autocast_mode.h`` does for CUDA, including
the cast cache of fp32 leaf tensors that require grad (the model weights).
Use :class:`CudaAutocast` around a whole training step.
"""

from __future__ import annotations

import contextlib
import functools
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils._pytree import tree_map

_HEADER = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

# Used when the header is not shipped (some builds strip include/): PyTorch 2.13's lists.
_FALLBACK = {
    "AT_FORALL_LOWER_PRECISION_FP": "conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d "
    "conv_transpose3d convolution _convolution prelu addmm addmv addr matmul einsum mm mv "
    "linalg_vecdot linear addbmm baddbmm bmm chain_matmul linalg_multi_dot lstm_cell gru_cell "
    "rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention scaled_dot_product_attention",
    "AT_FORALL_FP32": "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan "
    "pow softplus layer_norm native_layer_norm rms_norm group_norm frobenius_norm nuclear_norm "
    "cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d "
    "hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss "
    "multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss "
    "binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp",
    "AT_FORALL_FP32_SET_OPT_DTYPE": "prod softmax log_softmax cumprod cumsum linalg_vector_norm "
    "linalg_matrix_norm sum",
    "AT_FORALL_PROMOTE": "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put "
    "tensordot scatter_add",
}


@functools.cache
def cuda_op_lists() -> dict[str, frozenset[str]]:
    """The CUDA autocast op names by policy, read from the installed PyTorch's header."""
    text = _HEADER.read_text() if _HEADER.exists() else ""
    lists = {}
    for macro, fallback in _FALLBACK.items():
        found = re.search(rf"#define {macro}\(_\)(.*?)\n\n", text, re.S)
        names = re.findall(r"_\(([a-z_0-9]+)", found.group(1)) if found else fallback.split()
        lists[macro] = frozenset(names)
    return lists


def _eligible(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


class _CastCache:
    """CUDA autocast caches the low-precision copy of each fp32 leaf that requires grad."""

    def __init__(self) -> None:
        self.copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.enabled = True

    def cast(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if t.dtype == dtype:
            return t
        cacheable = self.enabled and dtype != torch.float32 and t.is_leaf and t.requires_grad
        if cacheable and id(t) in self.copies:
            return self.copies[id(t)][1]
        copy = t.to(dtype)
        if cacheable:
            self.copies[id(t)] = (t, copy)  # keep the source so its id is not reused
        return copy


def _policy_kernel(op: torch._ops.OpOverload, policy: str, low: torch.dtype, cache: _CastCache):
    dtype_index = next(
        (i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None
    )

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            if policy == "lower":
                cast = lambda t: cache.cast(t, low) if _eligible(t) else t  # noqa: E731
                return op(*tree_map(cast, args), **tree_map(cast, kwargs))
            if policy == "fp32":
                cast = lambda t: t.float() if _eligible(t) else t  # noqa: E731
                return op(*tree_map(cast, args), **tree_map(cast, kwargs))
            if policy == "fp32_opt_dtype":
                # CUDA calls the op with dtype=float32 when none was given: the output is fp32,
                # the input is read as it is (no fp32 copy of it is made).
                if args and _eligible(args[0]) and dtype_index is not None:
                    given = args[dtype_index] if dtype_index < len(args) else kwargs.get("dtype")
                    if given is None:
                        if dtype_index < len(args):
                            args = (*args[:dtype_index], torch.float32, *args[dtype_index + 1 :])
                        else:
                            kwargs = {**kwargs, "dtype": torch.float32}
                return op(*args, **kwargs)
            # promote: every floating tensor to the widest floating dtype among them
            leaves = [t for t in (*args, *kwargs.values()) if _eligible(t)]
            widest = functools.reduce(torch.promote_types, (t.dtype for t in leaves), low)
            cast = lambda t: t.to(widest) if _eligible(t) else t  # noqa: E731
            return op(*tree_map(cast, args), **tree_map(cast, kwargs))

    return kernel


def _overloads(name: str) -> Iterator[torch._ops.OpOverload]:
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return
    for overload in packet.overloads():
        if "out" not in overload:  # autocast never wraps the out= variants
            yield getattr(packet, overload)


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
        self._lib: torch.library.Library | None = None

    def __enter__(self) -> CudaAutocast:
        lists = cuda_op_lists()
        policies = {
            "lower": lists["AT_FORALL_LOWER_PRECISION_FP"],
            "fp32": lists["AT_FORALL_FP32"],
            "fp32_opt_dtype": lists["AT_FORALL_FP32_SET_OPT_DTYPE"],
            "promote": lists["AT_FORALL_PROMOTE"],
        }
        cuda_names = set().union(*policies.values())
        self._lib = lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
            for policy, names in policies.items():
                for name in sorted(names):
                    for op in _overloads(name):
                        lib.impl(op, _policy_kernel(op, policy, self.dtype, self.cache), "AutocastCPU")
            # Ops that CPU autocast casts but CUDA autocast leaves alone fall through, so
            # composite ones (cross_entropy_loss) decompose into ops that CUDA does cast.
            for qualified in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU"):
                name, _, overload = qualified.removeprefix("aten::").partition(".")
                if name not in cuda_names and hasattr(torch.ops.aten, name):
                    op = getattr(getattr(torch.ops.aten, name), overload or "default")
                    lib.impl(op, torch.library.fallthrough_kernel, "AutocastCPU")
        return self

    def __exit__(self, *exc) -> None:
        self.cache.copies.clear()
        if self._lib is not None:
            self._lib._destroy()
            self._lib = None

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """The autocast region of the forward pass."""
        self.cache.enabled = True
        try:
            with torch.autocast("cpu", dtype=self.dtype, cache_enabled=False):
                yield
        finally:
            self.cache.enabled = False
            self.cache.copies.clear()
