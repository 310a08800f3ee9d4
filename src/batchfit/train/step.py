"""THE training step: every engine that runs a step of a model runs this one.

Who runs it: the tracer (``trace/session.py``: fake tensors, and the virtual device, which
is the traced step with a capacity), the probe and the bench (``probe/runner.py``,
``bench.py``, through ``timing.run_timed_steps``: real tensors on CUDA or the CPU), the
sweep (``sweep/run.py``: :meth:`TrainingStep.step` over the data's micro-batches), the
noise scale (``sweep/noise.py``: :meth:`~TrainingStep.forward` and
:meth:`~TrainingStep.backward` per micro-batch, to read each one's gradient) and
``ElasticStep`` (``elastic.py``: the same two per micro-batch, cut and redone on OOM, over
a model the user built, :meth:`TrainingStep.around`). Only the tensors (fake, capped fake,
real) and the watcher differ.

Where things live, all in :class:`TrainingStep`:

- precision: bf16 weights (``move_module``), autocast (:attr:`~TrainingStep.forward_autocast`),
  float8 linears (``train/float8.py``: torchao's ``convert_to_float8_training``);
- the loss: ``--loss plain | chunked:N | fused-linear`` (``train/losses.py``) picks
  :attr:`~TrainingStep.loss_fn` once, in ``__init__``;
- accumulation: each micro-batch's loss times its share of the batch before its backward;
- the GradScaler: built for fp16-mixed on a real CUDA or CPU device (a fake tensor has no
  value to check for inf, so a traced step never scales), applied in
  :meth:`~TrainingStep.backward`, unscaled before clipping in :meth:`~TrainingStep.update`,
  which reports a step it skipped;
- the optimizer step: :meth:`~TrainingStep.update` (learning rate, clipping, scaler, zeroing),
  the one place in batchfit that steps an optimizer;
- activation offloading: ``--offload activations`` (``train/offload.py``) runs the forward under
  saved-tensor hooks (:meth:`~TrainingStep.forward`);
- activation checkpointing: the policy (``--checkpointing full | selective | every:N``,
  ``train/checkpointing.py``) wraps the main blocks here (``_checkpoint_blocks``). Saving a
  run to resume it is the sweep's (``sweep/run.py``).

Hooks let an engine see where it is in the step (inputs, forward, backward, optimizer)
without the step knowing who is watching.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.checkpoint import checkpoint

from batchfit.errors import OptionError
from batchfit.options import Checkpointing
from batchfit.phases import PHASES  # noqa: F401 - the names hooks.phase() receives
from batchfit.train.attention import set_attention
from batchfit.train.checkpointing import checkpointed_blocks, selective_context_fn
from batchfit.train.float8 import convert_to_float8, precompute_scales_after_step
from batchfit.train.losses import lm_loss, loss_context, tp_loss_of, tp_loss_refusal
from batchfit.train.model import apply_freezing, block_list, build_optimizer, move_module, optimizer_params
from batchfit.train.offload import OffloadActivations
from batchfit.workload import PARAMS_OFFLOAD_NEEDS_FSDP, StepOptions, Workload


class StepHooks(Protocol):
    def phase(self, name: str) -> None:
        """Called as the step enters one of PHASES (or 'idle' when it is done)."""

    def before_zero_grad(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Called after the optimizer stepped, while gradients still exist."""


class NoHooks:
    def phase(self, name: str) -> None:
        pass

    def before_zero_grad(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        pass


def _checkpoint_blocks(model: nn.Module, policy: Checkpointing, preserve_rng_state: bool) -> None:
    """Wrap the main stack's blocks that ``policy`` names (full, selective, every:N) in
    ``checkpoint(use_reentrant=False)``; ``train/checkpointing.py`` holds the policies."""
    blocks = block_list(model)
    if blocks is None:
        raise OptionError(
            f"`checkpointing` {policy} needs a model with an nn.ModuleList of blocks; "
            "this model has none: apply torch.utils.checkpoint in the model and drop the option"
        )
    stack = next(name for name, module in model.named_modules() if module is blocks)
    for index in checkpointed_blocks(policy, len(blocks)):
        block = blocks[index]
        forward = block.forward
        extra = ({"context_fn": selective_context_fn(block, f"{stack}.{index}".lstrip("."))}
                 if policy.kind == "selective" else {})

        def checkpointed(*args, _forward=forward, _extra=extra, **kwargs):
            return checkpoint(_forward, *args, use_reentrant=False,
                              preserve_rng_state=preserve_rng_state, **_extra, **kwargs)

        block.forward = checkpointed


def _compile(model: nn.Module, mode: str, *, apply: bool, memory_budget: float | None = None) -> None:
    """torch.compile in place (``Module.compile``: names, parameters and hooks stay the model's):
    the whole model, or each block of its main stack (torchtitan's per-block compile). Checked
    but not ``apply``-ed on fake or meta models: the trace compiles them its own way (trace/compiled.py)."""
    blocks = block_list(model) if mode == "blocks" else None
    if mode == "blocks" and blocks is None:
        raise OptionError("`compile` blocks needs a model with an nn.ModuleList of blocks; "
                          "this model has none: use `compile` model")
    for module in (blocks or [model]) if apply else ():
        module.compile(**({} if memory_budget is None else {"backend": inductor_with_budget(memory_budget)}))


def with_memory_budget(compiler: Callable, memory_budget: float | None) -> Callable:
    """``compiler`` (a torch.compile backend) with ``torch._functorch.config.activation_memory_budget``
    set while it runs: AOTAutograd's partitioner reads it when dynamo hands a graph to the backend
    (the first call and each recompile), not when ``compile()`` is called."""
    if memory_budget is None:
        return compiler
    import torch._functorch.config as functorch_config

    def backend(module: torch.fx.GraphModule, example_inputs: list) -> Callable:
        with functorch_config.patch(activation_memory_budget=memory_budget):
            return compiler(module, example_inputs)

    return backend


def inductor_with_budget(memory_budget: float) -> Callable:
    """Inductor (what ``compile()`` uses by default) under ``memory_budget``."""
    from torch._dynamo import lookup_backend

    return with_memory_budget(lookup_backend("inductor"), memory_budget)


def _require_fsdp(model: nn.Module) -> None:
    """``--offload params`` is FSDP2's CPUOffloadPolicy: it needs a model FSDP2 wrapped (plan)."""
    from torch.distributed.fsdp import FSDPModule

    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        raise OptionError(PARAMS_OFFLOAD_NEEDS_FSDP)


LossFn = Callable[[nn.Module, Any], torch.Tensor]
"""(model, batch) -> the mean loss over the batch's samples: ``Workload.loss_fn``'s contract."""


def _is_fake(model: nn.Module) -> bool:
    """Built on fake tensors (a DTensor: its local shard; torchao's float8 weight: the one it wraps)?"""
    param = next(model.parameters(), None)
    held = getattr(getattr(param, "_local_tensor", param), "_tensor", getattr(param, "_local_tensor", param))
    return param is not None and isinstance(held, FakeTensor)


def _grad_scaler(options: StepOptions, device: torch.device, model: nn.Module) -> torch.amp.GradScaler | None:
    """fp16-mixed needs loss scaling, or small gradients underflow to 0 in fp16. Real tensors
    only: the scaler reads found-inf values (``.item()``), which fake tensors do not have, and
    the traced step stays the step the allocator figures were measured against."""
    if options.precision != "fp16-mixed" or device.type not in ("cuda", "cpu") or _is_fake(model):
        return None
    return torch.amp.GradScaler(device.type)


def _logits_of(output: Any) -> torch.Tensor:
    """The logits of a model's output: a transformers ModelOutput's ``logits``, else the output itself."""
    logits = getattr(output, "logits", output)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"an evaluation step keeps the model's logits; its output is a {type(output).__name__}")
    return logits


@dataclass(frozen=True)
class StepResult:
    """What :meth:`TrainingStep.step` did."""

    loss: float
    """The batch's mean loss over its samples (the micro-batches' losses weighted by their samples)."""
    stepped: bool
    """False when the GradScaler found inf/nan gradients and skipped the optimizer step."""


class TrainingStep:
    """A model and optimizer built from a Workload, ready to run optimizer steps.

    The step knows nothing about who watches it: an engine passes ``hooks`` to :meth:`run`,
    and the tracer installs its CUDA mirrors by replacing :attr:`step_context` and
    :attr:`forward_autocast` (see ``trace/session.py``). Nor does it know about distribution:
    ``wrap`` (``batchfit.distributed.wrap.step_wrapper``) turns the model into what a multi-GPU run
    trains (DDP, FSDP2) and :attr:`model` is what it returns.

    Three ways to run it: :meth:`run` (``make_batch`` batches, what the tracer, probe and bench
    time), :meth:`step` (given micro-batches, a learning rate, clipping: the sweep), and the
    pieces :meth:`forward`, :meth:`backward`, :meth:`update` for a loop that must act
    between micro-batches (``ElasticStep`` redoes a batch on OOM, the noise scale reads each
    micro-batch's gradient).
    """

    def __init__(self, workload: Workload, options: StepOptions, device: torch.device, *,
                 wrap: Callable[[nn.Module], nn.Module] | None = None) -> None:
        self.workload: Workload | None = workload
        self.options = options
        self.device = device
        # Built directly on the target device: a model built on the CPU first would need its
        # whole fp32 copy in host memory (32 GB for an 8B model) before moving.
        with device:
            model = workload.build_model()
        dtype = torch.bfloat16 if options.precision == "bf16" else None
        self.model = move_module(model, device, dtype)
        # The attention implementation first: quantization and PEFT wrap the model it is set on.
        set_attention(self.model, options.attention or workload.attention, device, fake=_is_fake(self.model),
                      precision=options.precision)
        if options.quantize != "none" or options.lora != "none":
            # The base quantized by bitsandbytes and frozen, PEFT's adapters on top (train/quantize.py)
            from batchfit.train.quantize import apply_lora, quantize_model

            quantize_model(self.model, options, device)
            self.model = apply_lora(self.model, options)
        # First, as torchtitan's model converters run before parallelisms, AC and compile.
        self.float8_layers: list[str] = (convert_to_float8(self.model, options.precision_spec.fp8_recipe)
                                         if options.precision_spec.fp8_recipe else [])
        """The linears torchao's float8 training converted (fp8 precisions only)."""
        apply_freezing(self.model, options)
        if options.checkpointing != "none":
            # Fake tensors cannot snapshot the CPU generator; dropout-free steps do not need it.
            _checkpoint_blocks(self.model, options.checkpointing_spec, preserve_rng_state=device.type == "cuda")
        if options.compile != "none":
            _compile(self.model, options.compile, apply=device.type != "meta" and not _is_fake(self.model),
                     memory_budget=options.memory_budget)
        if wrap is not None:
            # After freezing and checkpointing (they name and patch the plain model's modules),
            # before the optimizer: FSDP2 replaces the parameters with their shards, and the
            # optimizer (and its state) must be built over those.
            self.model = wrap(self.model)
        if options.loss != "plain" and tp_loss_of(self.model) is not None:
            raise OptionError(tp_loss_refusal(options.loss))
        if options.offload_spec.params:
            _require_fsdp(self.model)
        self.offload: OffloadActivations | None = (OffloadActivations(self.model, device)
                                                   if options.offload_spec.activations else None)
        """The saved-tensor hooks of ``--offload activations`` (``train/offload.py``), else None."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params:
            raise OptionError("every parameter is frozen: loosen `frozen` or `trainable`")
        groups = optimizer_params(self.model, params, options)  # one group, or the HF Trainer's two
        self.optimizer = (build_optimizer(options.optimizer, groups, self.model) if options.optimizer
                          else workload.build_optimizer(groups))
        if self.float8_layers:
            precompute_scales_after_step(self.model, self.optimizer)  # FSDP2 float8 all-gather only
        self.loss_fn: LossFn = lm_loss(options.loss_spec, workload)  # plain: workload.loss_fn itself
        self.loss_context: Callable[[], contextlib.AbstractContextManager] = loss_context(self.model)
        """Entered around the forward (which computes the loss) and the backward: torch's
        loss_parallel() when a tensor-parallel plan kept the logits sharded on the vocabulary."""
        self.scaler = _grad_scaler(options, device, self.model)
        """The GradScaler of a real fp16-mixed step, else None."""
        self.step_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        """Entered around each whole step (the tracer's CUDA autocast mirror lives here)."""
        self.forward_autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        """The autocast region of the forward pass (and generation)."""
        if options.autocast_dtype is not None:  # bf16-mixed, fp16-mixed, and float8's other ops
            dtype = getattr(torch, options.autocast_dtype)
            self.forward_autocast = lambda: torch.autocast(device.type, dtype=dtype)

    @classmethod
    def around(cls, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn, *,
               scaler: torch.amp.GradScaler | None = None) -> TrainingStep:
        """The step of a model and optimizer the user built (``ElasticStep``): no Workload, so no
        :meth:`run`; no autocast either (the user's ``loss_fn`` enters its own), and the user's
        ``scaler`` (or none)."""
        step = cls.__new__(cls)
        param = next(model.parameters(), None)
        step.workload, step.options = None, StepOptions()
        step.device = param.device if param is not None else torch.device("cpu")
        step.model, step.optimizer, step.loss_fn, step.scaler = model, optimizer, loss_fn, scaler
        step.offload = None
        step.step_context = step.forward_autocast = step.loss_context = contextlib.nullcontext
        return step

    # -- the pieces ------------------------------------------------------------------------

    def forward(self, batch: Any) -> torch.Tensor:
        """The loss of ``batch`` (a mean over its samples), under the step's autocast (and the
        offload hooks, which cover the loss as TRL's do)."""
        offload = self.offload.hooks() if self.offload is not None else contextlib.nullcontext()
        with self.forward_autocast(), self.loss_context(), offload:
            loss = self.loss_fn(self.model, batch)
        # loss_parallel's loss is a replicated DTensor: its local value is the loss itself (the
        # backward goes through the DTensor, under loss_context again).
        to_local = getattr(loss, "to_local", None)
        return to_local() if to_local is not None else loss

    def backward(self, loss: torch.Tensor, share: float = 1.0) -> torch.Tensor:
        """Backward of ``loss x share`` (times the GradScaler's scale when there is one):
        micro-batches whose shares (samples / batch samples) sum to 1 accumulate the gradient of
        the batch's mean loss. Returns ``loss x share``, detached."""
        weighted = loss * share if share != 1 else loss
        self._backward(weighted)
        return weighted.detach()

    def _backward(self, loss: torch.Tensor) -> None:
        with self.loss_context():
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def update(self, *, lr: float | None = None, max_grad_norm: float | None = None,
               hooks: StepHooks | None = None) -> bool:
        """Step the optimizer on the accumulated gradients, then drop them.

        ``lr`` sets every parameter group's learning rate first; ``max_grad_norm`` clips the
        gradients (unscaled first when a GradScaler scaled them). Returns False when the
        GradScaler found inf/nan gradients and skipped the step (it lowered its scale; the
        gradients are dropped all the same): not an error, the next step goes on.
        """
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        stepped = True
        if self.scaler is not None:
            if max_grad_norm is not None:
                self.scaler.unscale_(self.optimizer)
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_grad_norm)
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            stepped = not self.scaler.is_enabled() or self.scaler.get_scale() >= scale  # a skip backs off
        else:
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_grad_norm)
            self.optimizer.step()
        (hooks or NoHooks()).before_zero_grad(self.model, self.optimizer)
        # Zeroing right after the step (as nanoGPT does) frees the gradients before the next
        # forward; zeroing before backward instead would keep them through it.
        self.optimizer.zero_grad(set_to_none=self.options.set_to_none)
        return stepped

    # -- whole steps -----------------------------------------------------------------------

    def step(self, micro_batches: Iterable[tuple[int, Any]], batch_size: int, *, lr: float | None = None,
             max_grad_norm: float | None = None) -> StepResult:
        """One optimizer step over ``(samples, batch)`` micro-batches that together hold
        ``batch_size`` samples: each loss weighted by its samples over ``batch_size``, so the
        gradient is the whole batch's mean-loss gradient however it was cut."""
        total, seen = 0.0, 0
        with self.step_context():
            for samples, batch in micro_batches:
                loss = self.forward(batch)
                del batch  # the graph keeps what backward needs
                self.backward(loss, samples / batch_size)
                total += loss.item() * samples
                seen += samples
                del loss
            if seen != batch_size:
                raise ValueError(f"the micro-batches hold {seen} samples, the batch {batch_size}")
            stepped = self.update(lr=lr, max_grad_norm=max_grad_norm)
        return StepResult(total / batch_size, stepped)

    def run(self, batch_size: int, hooks: StepHooks | None = None) -> torch.Tensor:
        """One optimizer step over ``accumulation_steps`` micro-batches of ``batch_size`` samples
        from ``make_batch``; returns the last loss."""
        if self.workload is None:
            raise TypeError("TrainingStep.around has no Workload to make batches: use step()")
        with self.step_context():
            return self._run(batch_size, hooks or NoHooks())

    def evaluate(self, batch_size: int, hooks: StepHooks | None = None, *, held_steps: int = 1) -> torch.Tensor:
        """``held_steps`` evaluation steps of ``batch_size`` samples from ``make_batch``, as HF Trainer's
        evaluation loop runs them (``prediction_step``, ``evaluation_loop``): ``model.eval()``, no
        gradients, the model's own loss (``Workload.loss_fn``: the Trainer's eval calls the model, so no
        chunked or fused loss), and the model's whole output alive until the step ends (the logits, and
        whatever else it returns). With ``compute_metrics`` the Trainer keeps every
        step's logits on the device, concatenated after each step (``nested_concat``), until
        ``eval_accumulation_steps`` steps moved them to the host: ``held_steps`` is that count. The
        model is in train mode again afterwards; returns the last loss."""
        if self.workload is None:
            raise TypeError("TrainingStep.around has no Workload to make batches")
        hooks = hooks or NoHooks()
        outputs: list[Any] = []
        keep = self.model.register_forward_hook(lambda module, args, output: outputs.append(output))
        held: torch.Tensor | None = None
        self.model.eval()
        try:
            with self.step_context(), torch.no_grad():
                for _ in range(held_steps):
                    hooks.phase("inputs")
                    batch = self.workload.make_batch(batch_size, self.device)
                    hooks.phase("forward")
                    with self.forward_autocast():
                        loss = self.workload.loss_fn(self.model, batch).detach()
                    del batch
                    logits = _logits_of(outputs.pop())
                    outputs.clear()  # the rest of the output (the KV cache) goes with the step
                    # nested_concat: the held and the new logits alive while their concatenation is made
                    held = logits if held is None else torch.cat((held, logits), dim=0)
                    del logits
        finally:
            keep.remove()
            self.model.train()
        del held
        hooks.phase("idle")
        return loss

    def _run(self, batch_size: int, hooks: StepHooks) -> torch.Tensor:
        forward_autocast = self.forward_autocast
        accumulation = self.options.accumulation_steps
        # A tracer may run fewer micro-batches and write the rest's allocations down (the
        # tracker's ``repeat_micro_batch``, trace/memory.py); every other watcher runs them all.
        ran = getattr(hooks, "micro_batches", lambda n: n)(accumulation)
        loss = None
        index = 0
        while index < accumulation:
            if index == ran and getattr(hooks, "repeat_micro_batch", lambda n: False)(accumulation - ran):
                break
            getattr(hooks, "micro_batch_begins", lambda i: None)(index)
            index += 1
            hooks.phase("inputs")
            batch = self.workload.make_batch(batch_size, self.device)
            if self.workload.generate is not None:
                hooks.phase("generate")
                with torch.no_grad(), forward_autocast():
                    batch = self.workload.generate(self.model, batch)
            if self.workload.reference is not None:
                hooks.phase("reference")
                with torch.no_grad(), forward_autocast():
                    batch = self.workload.reference(self.model, batch)
            hooks.phase("forward")
            loss = self.forward(batch)
            del batch  # the graph keeps what backward needs; let the rest go
            hooks.phase("backward")
            self._backward(loss / accumulation if accumulation > 1 else loss)
            loss = loss.detach()
        hooks.phase("optimizer")
        self.update(hooks=hooks)
        hooks.phase("idle")
        return loss
