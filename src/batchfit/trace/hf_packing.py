"""transformers' packed-sequence check, answered on fake tensors as the values would answer it.

Before it builds an attention mask, transformers (``masking_utils._preprocess_mask_arguments``)
asks ``find_packed_sequence_indices(position_ids)`` whether several sequences are packed into one
row. On real tensors it reads the positions; on fake tensors it cannot (``is_tracing``) and
answers "packed", so the model builds a [B, 1, T, T] mask and, with grouped-query attention,
repeats K and V per query head: bytes a GPU run of an unpacked batch never holds (GiBs for a
large GQA model at long sequences). ``hf:`` workloads answered the question themselves
(``zoo/hf.py: _unpacked_sequences``); a model a user builds in ``file.py:fn`` did not.

The answer, during every trace: when the model numbered the positions itself (no
``position_ids`` in the batch: transformers makes them from ``cache_position``, one row expanded
over the batch, stride 0), they are 0..T-1, not packed: the answer is certain. When the batch
passes its own ``position_ids`` (one row per sample), the values decide and the trace cannot read
them: it answers "not packed" and says so on every output (:func:`packing_approximation`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from torch._subclasses.fake_tensor import FakeTensor

from batchfit.trace.approximation import Approximation


class PackedSequences:
    """Installed around a traced step: fake position ids read as unpacked; ``assumed`` counts
    the answers the values would have decided (the batch passed its own position ids)."""

    def __init__(self) -> None:
        self.assumed = 0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        module = sys.modules.get("transformers.masking_utils")  # never imports transformers itself
        original = getattr(module, "find_packed_sequence_indices", None)
        if original is None:
            yield
            return

        def answered(position_ids):
            if not isinstance(position_ids, FakeTensor):
                return original(position_ids)
            if _one_row_per_sample(position_ids):
                self.assumed += 1  # the batch's own positions
            return None

        module.find_packed_sequence_indices = answered
        try:
            yield
        finally:
            module.find_packed_sequence_indices = original


def batch_passes_position_ids(workload) -> bool:
    """Whether a transformers model reads position ids the workload's batch passes (one row per
    sample): the question plan asks before its ranks trace, in another process. The batch is made
    on the meta device (no memory); a batch that cannot be made there says nothing."""
    import torch

    if "transformers.masking_utils" not in sys.modules:
        return False
    try:
        batch = workload.make_batch(2, torch.device("meta"))
    except Exception:  # a make_batch that reads data: the ranks' traces still answer, unsaid
        return False
    ids = batch.get("position_ids") if isinstance(batch, dict) else None
    return isinstance(ids, torch.Tensor) and ids.dim() == 2 and _one_row_per_sample(ids)


def _one_row_per_sample(position_ids) -> bool:
    """Position ids a batch passed (a row per sample), not the model's own 0..T-1 expanded over the
    batch (stride 0): only then do the values decide whether sequences are packed."""
    return position_ids.shape[0] > 1 and position_ids.stride(0) != 0


def packing_approximation(assumed: int) -> list[Approximation]:
    """Said when the batch passed position ids the trace could not read."""
    if not assumed:
        return []
    return [Approximation(
        what="the batch's position_ids were read as one unpacked sequence per row",
        may_differ_by="a packed batch (positions restarting inside a row) adds, on the GPU, a [B, 1, T, T] "
                      "attention mask per layer and, with grouped-query attention, K and V repeated per query "
                      "head (a tiny bf16 GQA Qwen3-MoE: +24,576 B over 2 layers, 2% of its peak)",
        source="docs/tracing/value-reads.md",
        detail="transformers' find_packed_sequence_indices reads the values; fake tensors hold none")]
