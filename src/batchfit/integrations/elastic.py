"""``ElasticStep``: one optimizer step per batch, in micro-batches, that shrinks instead of dying of OOM.

    step = batchfit.ElasticStep(model, optimizer, loss_fn, micro_batch=64)
    for batch in loader:          # each batch is the global batch (per rank)
        info = step(batch)        # info.loss, info.micro_batch, info.accumulation_steps, info.oom_events

Each batch is cut along dim 0 into micro-batches (``elastic_split``). Each micro-batch's loss
(a mean over its samples) is scaled by its share of the batch, so the accumulated gradient is
the gradient of the mean loss over the whole batch, however the batch was cut; then the
optimizer steps once. Forward, backward (with the user's GradScaler) and the optimizer step
are ``batchfit.train.step.TrainingStep``'s (``TrainingStep.around`` the user's model and optimizer),
the one training step every engine runs; this module adds the cutting, the redoing and the
ranks. A step the GradScaler skips (inf/nan gradients) is not an OOM: the batch is not redone,
and ``ElasticInfo.scaler_skipped`` says so. On an out-of-memory error
(``batchfit.train.oom.classify``: the same test the probe uses; anything else propagates unchanged)
the step:

1. leaves the ``except`` block first (inside it the traceback keeps every frame of the failed
   forward alive, and with them its activations: what Lightning's batch finder gets wrong),
2. drops the partial gradients and the failed micro-batch (``zero_grad(set_to_none=True)``;
   on CUDA the cached blocks go back with ``empty_cache``),
3. shrinks the micro-batch: predicted from the peaks measured at sizes that ran (CUDA), else
   halved, always a multiple of ``multiple_of``,
4. redoes the whole batch: no sample is dropped, counted twice, or stepped twice.

With ``grow_after=N`` it doubles the micro-batch again (up to the first one) after N clean steps.

Several ranks (DDP, FSDP2): every rank must cut the same number of micro-batches, so the
ranks agree after every micro-batch on the smallest proposed size (one int all-reduce,
``probe.ranks.agree_min``); a rank that ran out proposes a smaller one, and every rank then
redoes the batch at that size. Between the agreements no rank enters a collective the
others skip.

DDP: every micro-batch runs under ``no_sync`` and the step averages the gradients itself once
the whole pass ran on every rank. Letting DDP sync in the last micro-batch does not survive an
OOM there on one rank: the ranks whose forward finished have told DDP's reducer a backward is
coming, and their next backward, even under ``no_sync``, all-reduces buckets the others never
send (a collective mismatch, seen with gloo). The cost: the last backward does not overlap its
all-reduce, and DDP communication hooks are not applied.
FSDP2 reduces gradients in the last micro-batch (``set_requires_gradient_sync``); the ranks
agree before every backward (which all-gathers resharded parameters) that every forward ran.
After an OOM, the gradients FSDP2 accumulated on its unsharded parameters are dropped too.
Known limit: an OOM that only one rank hits inside a collective (FSDP2's all-gathers, or its
backward) leaves the others waiting in it: the process group's timeout ends the run, as it
would without batchfit.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from batchfit.errors import OptionError
from batchfit.integrations.elastic_split import batch_size, live_workload, same_optimizer, size_micro_batch, split_batch
from batchfit.probe import ranks
from batchfit.train.oom import classify, describe
from batchfit.train.step import LossFn, TrainingStep
from batchfit.workload import StepOptions

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class ElasticInfo:
    """What one ElasticStep call did."""

    loss: float
    """The mean loss over the batch's samples (the micro-batches' losses weighted by their samples)."""
    samples: int
    """Samples in the batch (on this rank)."""
    micro_batch: int
    """Samples per micro-batch in the pass that stepped (the last micro-batch may hold fewer)."""
    accumulation_steps: int
    """Micro-batches in the pass that stepped."""
    oom_events: int
    """Out-of-memory errors recovered from in this step (on any rank)."""
    failed_micro_batches: tuple[int, ...] = ()
    """The micro-batch sizes that ran out, in order."""
    grew_to: int | None = None
    """Set when this step tried a larger micro-batch after ``grow_after`` clean steps."""
    scaler_skipped: bool = False
    """The GradScaler found inf/nan gradients and skipped the optimizer step (it lowered its
    scale; the batch is not redone): fp16's usual first steps, not an error."""


def predict_micro_batch(peaks_bytes: dict[int, int], capacity_bytes: int, failed: int, *,
                        target_util: float = 0.9) -> int | None:
    """The largest micro-batch whose peak, on the line through the measured peaks, stays under
    ``target_util`` of ``capacity_bytes``, below the size that failed; None without two sizes."""
    sizes = sorted(b for b in peaks_bytes if b < failed)
    if len(sizes) < 2:
        return None
    lo, hi = sizes[0], sizes[-1]
    per_sample = (peaks_bytes[hi] - peaks_bytes[lo]) / (hi - lo)
    if per_sample <= 0:
        return None
    fixed = peaks_bytes[hi] - per_sample * hi
    return min(failed - 1, math.floor((target_util * capacity_bytes - fixed) / per_sample))


class ElasticStep:
    """A training step that cuts each batch into micro-batches and never dies of an OOM it can shrink away.

    ``loss_fn(model, micro_batch)`` returns the mean loss over the micro-batch's samples (as
    ``Workload.loss_fn``). ``micro_batch=None`` starts from ``batchfit.estimate`` on the first
    batch: for the GPU the model is on, else for ``gpu`` / ``gpu_memory`` (a catalog name such
    as ``h100-80gb``, or ``24GiB``), else for a traced H100, which the log says.

    ``multiple_of``: every micro-batch size it picks is a multiple of this (the last
    micro-batch of a batch holds what is left). ``grow_after``: after this many clean steps,
    double the micro-batch again, up to the first one (None: never). ``scaler``: a GradScaler
    for fp16 autocast. ``max_grad_norm``: clip before the optimizer steps. ``target_util``,
    ``options`` (precision, checkpointing) and ``limit`` are the estimate's, and the target of
    a predicted shrink.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn, *,
                 micro_batch: int | None = None, multiple_of: int = 1, grow_after: int | None = None,
                 scaler: torch.amp.GradScaler | None = None, max_grad_norm: float | None = None,
                 target_util: float = 0.9, gpu: str | None = None, gpu_memory: str | None = None,
                 options: StepOptions | None = None, limit: str = "reserved") -> None:
        if micro_batch is not None and micro_batch < 1:
            raise OptionError(f"micro_batch must be 1 or more (or None to estimate it), got {micro_batch}")
        if multiple_of < 1:
            raise OptionError(f"multiple_of must be 1 or more, got {multiple_of}")
        if grow_after is not None and grow_after < 1:
            raise OptionError(f"grow_after must be 1 or more clean steps (or None: never grow), got {grow_after}")
        if not 0 < target_util <= 1:
            raise OptionError(f"target_util must be in (0, 1], e.g. 0.9; got {target_util}")
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.micro_batch = micro_batch
        """The micro-batch the next step starts with (None until the first batch is estimated)."""
        self.multiple_of, self.grow_after, self.target_util = multiple_of, grow_after, target_util
        self.scaler, self.max_grad_norm = scaler, max_grad_norm
        self._step = TrainingStep.around(model, optimizer, loss_fn, scaler=scaler)
        self.gpu, self.gpu_memory, self.options, self.limit = gpu, gpu_memory, options, limit
        self._ceiling = micro_batch  # growth never passes the first size
        self._clean_steps = 0
        self._last_oom: str | None = None
        self.peaks_bytes: dict[int, int] = {}
        """Measured peak allocated bytes per micro-batch size that ran (CUDA only)."""

    # -- the step --------------------------------------------------------------------------

    def __call__(self, batch: Any) -> ElasticInfo:
        total = batch_size(batch)
        if self.micro_batch is None:
            self.micro_batch = self._ceiling = self._estimate(batch, total)
        grew_to = self._maybe_grow()
        failed: list[int] = []
        while True:
            micro = min(self.micro_batch, total)
            loss, proposal = self._attempt(batch, micro, total)
            if loss is not None:
                break
            # Out of the except block: the failed micro-batch's frames are gone. Drop what the
            # pass accumulated, then shrink and redo the whole batch.
            failed.append(micro)
            self.optimizer.zero_grad(set_to_none=True)
            _drop_fsdp_unsharded_grads(self.model)
            if proposal < 1:
                raise torch.OutOfMemoryError(
                    f"ElasticStep: even a micro-batch of {micro} samples runs out of memory "
                    f"({self._last_oom or 'on another rank'}): lower the memory of one sample (bf16-mixed "
                    "precision, activation checkpointing) or shard the model (FSDP)")
            if self._cuda is not None:
                torch.cuda.empty_cache()
            self.micro_batch = proposal
            self._clean_steps = 0
            logger.warning("out of memory at a micro-batch of %d samples: redoing the batch of %d as "
                           "micro-batches of %d", micro, total, proposal)
        stepped = self._step.update(max_grad_norm=self.max_grad_norm)
        if not failed:  # a step the scaler skipped ran without an OOM: it counts as clean
            self._clean_steps += 1
        return ElasticInfo(loss=loss, samples=total, micro_batch=micro, accumulation_steps=math.ceil(total / micro),
                           oom_events=len(failed), failed_micro_batches=tuple(failed), grew_to=grew_to,
                           scaler_skipped=not stepped)

    def _attempt(self, batch: Any, micro: int, total: int) -> tuple[float | None, int]:
        """One pass over the batch: (mean loss, micro) when every micro-batch ran, else (None,
        the micro-batch every rank agreed to redo it with)."""
        parts = split_batch(batch, micro)
        loss_sum: torch.Tensor | None = None
        for i in range(len(parts)):
            samples = batch_size(parts[i])
            last = i == len(parts) - 1
            with self._gradient_sync(last):
                self._reset_peak()
                loss, oom = self._forward(parts[i])
                if ranks.active() and not self._ddp:
                    # FSDP2's backward all-gathers the resharded parameters (and the last one
                    # reduce-scatters the gradients): every rank enters it, or none does.
                    proposal = self._agree(micro, oom)
                    if proposal < micro:
                        return None, proposal
                if oom is None:
                    weighted, oom = self._backward(loss, samples / total)
                    if weighted is not None:
                        loss_sum = weighted if loss_sum is None else loss_sum + weighted
                loss = None  # the graph is gone after backward; the value is in loss_sum
            if oom is None:
                self._record_peak(samples)
            proposal = self._agree(micro, oom)
            if proposal < micro:
                logger.debug("micro-batch %d of %d: %s", i + 1, len(parts), oom or "out of memory on another rank")
                return None, proposal
        if self._ddp and ranks.active():
            self._average_gradients()
        return float(loss_sum), micro

    def _average_gradients(self) -> None:
        """DDP's gradient average, done here after every rank's pass ran (see the module docstring)."""
        group = getattr(self.model, "process_group", None)
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # unused on this rank: every rank must reduce the same tensors
                p.grad = torch.zeros_like(p)
        works = [dist.all_reduce(p.grad, group=group, async_op=True) for p in params]
        for work in works:
            work.wait()
        world = dist.get_world_size(group)
        for p in params:
            p.grad.div_(world)

    def _forward(self, part: Any) -> tuple[torch.Tensor | None, str | None]:
        """(loss, None), or (None, the OOM's one-line description): only the description
        leaves, so nothing holds the failed forward's frames once this returns."""
        try:
            return self._step.forward(part), None
        except Exception as error:
            if classify(error) != "oom":
                raise
            message = describe(error)
        return None, message

    def _backward(self, loss: torch.Tensor, share: float) -> tuple[torch.Tensor | None, str | None]:
        """(the loss weighted by its share of the batch, None), or (None, the OOM's description)."""
        try:
            weighted = self._step.backward(loss, share)
            return weighted.to(torch.promote_types(weighted.dtype, torch.float32)), None
        except Exception as error:
            if classify(error) != "oom":
                raise
            message = describe(error)
        return None, message

    def _agree(self, micro: int, oom: str | None) -> int:
        """The micro-batch to go on with: ``micro`` if no rank ran out, else the smallest proposal."""
        proposal = micro if oom is None else self._shrink(micro, oom)
        return ranks.agree_min(proposal)

    def _shrink(self, failed: int, message: str) -> int:
        m = self.multiple_of
        if failed <= m:
            self._last_oom = message
            return 0  # nothing smaller to try: every rank raises once they agree on it
        predicted = None
        if self._cuda is not None:
            capacity = torch.cuda.get_device_properties(self._cuda).total_memory
            predicted = predict_micro_batch(self.peaks_bytes, capacity, failed, target_util=self.target_util)
        size = predicted if predicted is not None else failed // 2
        return max(m, min(size, failed - 1) // m * m)

    def _maybe_grow(self) -> int | None:
        if (self.grow_after is None or self._clean_steps < self.grow_after
                or self.micro_batch >= (self._ceiling or 0)):
            return None
        grown = min(2 * self.micro_batch, self._ceiling) // self.multiple_of * self.multiple_of
        self._clean_steps = 0
        if grown <= self.micro_batch:
            return None
        logger.info("%d clean steps: trying micro-batches of %d (from %d)", self.grow_after, grown, self.micro_batch)
        self.micro_batch = grown
        return grown

    # -- where the model lives ---------------------------------------------------------------

    @property
    def _ddp(self) -> bool:
        return isinstance(self.model, nn.parallel.DistributedDataParallel)

    @property
    def _cuda(self) -> torch.device | None:
        param = next(self.model.parameters(), None)
        return param.device if param is not None and param.device.type == "cuda" else None

    def _reset_peak(self) -> None:
        if self._cuda is not None:
            torch.cuda.reset_peak_memory_stats(self._cuda)

    def _record_peak(self, micro: int) -> None:
        if self._cuda is not None:
            peak = torch.cuda.max_memory_allocated(self._cuda)
            self.peaks_bytes[micro] = max(peak, self.peaks_bytes.get(micro, 0))

    @contextlib.contextmanager
    def _gradient_sync(self, last: bool):
        """FSDP2 reduces gradients only in the last micro-batch; DDP in none (``_average_gradients``)."""
        if self._ddp:
            with self.model.no_sync():
                yield
        elif last:
            yield
        elif hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2's FSDPModule
            self.model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.model.set_requires_gradient_sync(True)
        else:
            yield

    def _estimate(self, batch: Any, total: int) -> int:
        model = self.model.module if isinstance(self.model, nn.parallel.DistributedDataParallel) else self.model
        optimizer = self.optimizer
        workload = live_workload(model, batch, self.loss_fn, name=type(model).__name__,
                                 build_optimizer=lambda params: same_optimizer(optimizer, params))
        sized = size_micro_batch(workload, model=model, max_batch=total, multiple_of=self.multiple_of,
                                 target_util=self.target_util, gpu=self.gpu, gpu_memory=self.gpu_memory,
                                 options=self.options, limit=self.limit)
        return ranks.agree_min(max(sized.micro_batch, self.multiple_of))


def _drop_fsdp_unsharded_grads(model: nn.Module) -> None:
    """FSDP2 keeps the gradients of micro-batches run without gradient sync on its unsharded
    parameters, where ``optimizer.zero_grad`` (on the sharded ones) does not reach: drop them,
    or the redone pass adds the failed pass's gradients again (seen with gloo)."""
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = getattr(state(), "_fsdp_param_group", None) if state else None
        for fsdp_param in getattr(group, "fsdp_params", ()):
            fsdp_param.unsharded_accumulated_grad = None
            if getattr(fsdp_param, "_unsharded_param", None) is not None:
                fsdp_param._unsharded_param.grad = None
