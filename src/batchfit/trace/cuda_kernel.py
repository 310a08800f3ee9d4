"""Replacing one aten op's kernel while tracing, in the tracing thread only.

A CUDA mirror (``cuda_attention``, ``cuda_norm``) registers its kernel on the op's
CompositeImplicitAutograd key: below autocast (which has already cast the inputs), above
autograd, so activation-checkpointing recomputation sees it too. A dispatcher registration is
process-wide, so the kernel asks :func:`mirrored_here` and hands another thread's call (a user's
real step running beside a trace) back to PyTorch.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import torch

_depth: dict[str, threading.local] = {}
"""Per op: ``depth``, how many KernelMirror contexts of it this thread is in."""


def mirrored_here(op: str) -> bool:
    """Whether this thread is inside a :class:`KernelMirror` of ``op``."""
    return getattr(_depth.setdefault(op, threading.local()), "depth", 0) > 0


class KernelMirror:
    """Context manager: aten ``op`` runs ``kernel`` while entered (nothing when not ``available``:
    a torch without the CUDA kernel being mirrored)."""

    def __init__(self, op: str, kernel: Callable, *, available: bool = True) -> None:
        self.op, self.kernel, self.available = op, kernel, available
        self._lib: torch.library.Library | None = None

    def __enter__(self) -> KernelMirror:
        if self.available:
            self._lib = torch.library.Library("aten", "IMPL")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
                self._lib.impl(self.op, self.kernel, "CompositeImplicitAutograd")
        local = _depth.setdefault(self.op, threading.local())
        local.depth = getattr(local, "depth", 0) + 1
        return self

    def __exit__(self, *exc) -> None:
        _depth[self.op].depth -= 1
        if self._lib is not None:
            self._lib._destroy()
            self._lib = None
