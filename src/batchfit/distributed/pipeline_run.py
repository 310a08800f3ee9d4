"""One pipeline rank's optimizer step, its actions (``pp_schedules.rank_actions``) run as torch's
``_PipelineScheduleRuntime`` and ``PipelineStage`` run them (torch 2.13, ``schedules.py``,
``stage.py``, ``_backward.py``), on the TrainingStep's pieces.

What a stage holds, and until when (``stage.py``):

- For each micro-batch, a receive buffer of the input activation (stages after the first;
  ``_create_act_recv_info``) and of the output gradient (stages before the last;
  ``_create_grad_recv_info``), made once and kept between steps. Where the neighbouring stage
  sits on the same rank (the bottom of a V: stages p-1 and p on rank p-1) nothing is received:
  ``set_local_fwd_input`` makes the buffer the previous stage's output, detached, and
  ``set_local_bwd_input`` makes the gradient buffer the next stage's input gradient; each stays
  until the next step replaces it.
- A forward's output and inputs in ``fwd_cache`` until that micro-batch's backward (on the last
  stage the logits, not only the loss), the loss scaled by 1/micro-batches (``scale_grads``).
- A full backward (B) hands the input's gradient to the send (``stage_backward`` leaves ``.grad``
  None). A send's ``dist.Work`` holds its tensor (a stage's output to the next rank, an input
  gradient to the previous one) as long as the schedule keeps the Work: the multi-stage runtime
  and GPipe keep every one until the step's actions are done (``send_ops``,
  ``fwd_sends_to_wait`` / ``bwd_sends_to_wait``); 1F1B only the latest of each (its ``fwd_sends``
  / ``bwd_sends`` / ``send_work`` variables, reassigned as it goes), besides the send of its
  second-to-last warm-up forward, which ``send_work`` keeps until the 1B1F loop breaks, and the
  latest forward's output (its ``output`` variable: the last stage's logits) until the next
  forward returns.
- I (``backward_one_chunk(full_backward=False)``): on every stage but the first,
  ``stage_backward_input``: ``autograd.grad`` to the stage input with ``retain_graph=True``, and a
  hook that keeps the gradient reaching each weight's node (``param_groups``); the graph and
  those gradients stay in ``backward_state`` until W. The input's gradient stays in ``.grad``.
  The first stage computes nothing at I (its input needs no gradient) and keeps its graph.
- W (``backward_weight_one_chunk``): ``stage_backward_weight`` from what I kept (the graph is
  freed by it), or on the first stage the whole backward (``stage_backward``).
- R (REDUCE_GRAD, where torch's ``_add_reduce_grad`` puts it): FSDP2's reduce-scatter of the
  stage's gradients, accumulated unsharded since the step began (``perform_reduce_grad``).

torch's own ``stage_backward_input`` / ``stage_backward_weight`` / ``stage_backward`` run here on
the traced tensors, so what the trace holds between I and W is what torch holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchfit.distributed.pipeline import backward_sync, reduce_grad
from batchfit.distributed.pipeline_hf import hf_stage_loss, is_hf_stage
from batchfit.errors import OptionError

if TYPE_CHECKING:
    import torch


def stage_batch(batch) -> list:
    """A workload's batch as [the first stage's input, what the last stage's loss reads...]: a zoo
    batch (inputs, targets) as it is; an HF batch {input_ids, labels} as [input_ids, labels]. An HF
    batch with more (its own position ids or attention mask) is refused: torch's schedules hand
    inputs to the first stage only, so the later stages would not see them."""
    if not isinstance(batch, dict):
        return list(batch)
    if set(batch) != {"input_ids", "labels"}:
        raise OptionError(f"pipeline parallelism on an HF model traces batches of input_ids and labels; this batch "
                          f"has {', '.join(sorted(batch))} (torch's schedules give inputs to the first stage "
                          "only): make_batch must return input_ids and labels alone, or use fsdp / tp strategies")
    return [batch["input_ids"], batch["labels"]]


class PipelineRun:
    """One optimizer step of a pipeline rank, in torch's action order: replaces
    ``TrainingStep.run`` (same signature) for a step whose model is a ``RankStages``. Its batch
    size is the pipeline's whole local batch, split into ``microbatches`` equal micro-batches
    (``schedule.step(whole batch)`` splits it so)."""

    def __init__(self, step, *, actions: list[tuple[str, int, int]], microbatches: int, stages: int,
                 d_model: int, seq_len: int, sends: str = "runtime") -> None:
        self.step = step
        self.sends = sends
        """How long the schedule keeps its sends: 'runtime' or 'gpipe' (to the end of the actions), '1f1b'."""
        kinds = [kind for kind, _, _ in actions]
        last_f = max((i for i, kind in enumerate(kinds) if kind == "F"), default=-1)
        self.warmup = kinds.index("B") if "B" in kinds else len(kinds)
        self.loop_break = next((i for i in range(last_f, len(kinds)) if kinds[i] == "B"), None)
        """1F1B: the action after which its 1B1F loop breaks (the first backward after the last forward)."""
        self.actions = actions
        self.m = microbatches
        self.stages = stages
        self.d_model, self.seq_len = d_model, seq_len
        self.act_buffers: dict[tuple[int, int], torch.Tensor] = {}
        self.grad_buffers: dict[tuple[int, int], torch.Tensor] = {}
        self.last_backward = {s: (kind, mb) for kind, s, mb in actions if kind in ("B", "W")}
        """Each stage's last B or W (torch's ``backward_counter`` reaching the micro-batches: DDP syncs in it)."""

    def _buffer(self, table: dict, key: tuple[int, int], micro: int, dtype, requires_grad: bool):
        import torch

        if key not in table:  # made once, kept between steps (PipelineStage's recv infos)
            table[key] = torch.empty((micro, self.seq_len, self.d_model), dtype=dtype,
                                     device=self.step.device).requires_grad_(requires_grad)
        return table[key]

    def __call__(self, batch_size: int, hooks=None):
        from batchfit.train.losses import loss_context
        from batchfit.train.step import NoHooks

        step, hooks = self.step, hooks or NoHooks()
        if batch_size % self.m:
            raise OptionError(f"a pipeline step of {self.m} micro-batches needs a local batch that is a multiple of "
                              f"{self.m}, got {batch_size}")
        holder = step.model
        self.by_index = dict(zip(holder.stage_indices, holder.stages))
        self.micro = batch_size // self.m
        self.last_context = loss_context(self.by_index.get(self.stages - 1, holder))  # the TP plan marks the stage
        with step.step_context():
            self._clear_runtime_states()
            hooks.phase("inputs")
            first, last = 0 in self.by_index, self.stages - 1 in self.by_index
            # The first stage reads the inputs, the last the targets: each rank keeps only its own.
            batch = None
            if first or last:
                batch = stage_batch(step.workload.make_batch(batch_size, step.device))
                batch[0] = batch[0] if first else None
                batch[1:] = batch[1:] if last else [None] * (len(batch) - 1)
            self.parts = ([tuple(None if t is None else t.tensor_split(self.m)[i] for t in batch)
                           for i in range(self.m)] if batch else None)
            self.cache: dict[tuple[int, int], tuple] = {}  # fwd_cache
            self.state: dict[tuple[int, int], tuple] = {}  # backward_state, I to W
            self.sent: list = []  # the sends' tensors the schedule keeps until its actions are done
            self.latest: dict[str, object] = {}  # 1F1B's variables: "output", "grad", "warmup send"
            self.loss = None
            phase = None
            for self.index, (kind, s, mb) in enumerate(self.actions):
                now = "forward" if kind == "F" else "backward"
                if phase != now:
                    hooks.phase(now)
                    phase = now
                if kind == "R":
                    reduce_grad(self.by_index[s])
                else:
                    getattr(self, f"_{kind}")(s, mb)
            del batch
            self.parts = self.cache = self.state = self.sent = self.latest = None
            hooks.phase("optimizer")
            step.update(hooks=hooks)
            hooks.phase("idle")
        import torch

        return self.loss if self.loss is not None else torch.zeros(())

    def _clear_runtime_states(self) -> None:
        """The received activations' gradients go (a function of its own, as torch's: a loop variable
        left in ``__call__`` would keep the last buffer alive through the step, which a V-shaped
        rank replaces)."""
        for buf in self.act_buffers.values():
            buf.grad = None

    def _F(self, s: int, mb: int) -> None:
        step, module = self.step, self.by_index[s]
        if s == 0:
            x = self.parts[mb][0]
        elif s - 1 in self.by_index:  # set by the previous stage's forward on this rank
            x = self.act_buffers[(s, mb)]
        else:
            x = self._buffer(self.act_buffers, (s, mb), self.micro, next(module.parameters()).dtype, True)
        with step.forward_autocast(), self.last_context():
            out = module(x)
            if self.sends == "1f1b":  # its output variable, the previous forward's output freed now
                self.latest["output"] = out
            if s == self.stages - 1:
                # The schedule computes the loss from the stage's output, which fwd_cache keeps
                # until this micro-batch's backward (the logits, not only the loss).
                logits = out
                if is_hf_stage(module):  # the causal LM's own loss from its labels
                    loss = hf_stage_loss(module, logits, self.parts[mb][1]) / self.m
                else:
                    loss = step.loss_fn(lambda _inputs: logits, (x, *self.parts[mb][1:])) / self.m
                out = (loss, logits)
                del logits, loss
        self.cache[(s, mb)] = (out, x)
        if s + 1 in self.by_index:  # set_local_fwd_input: the output itself, detached, a leaf again
            self.act_buffers[(s + 1, mb)] = out.detach().requires_grad_(True)
        elif s < self.stages - 1:  # SEND_F: its Work holds the output
            if self.sends != "1f1b":
                self.sent.append(out)
            elif self.index < self.warmup - 1:  # send_work: kept until the 1B1F loop breaks
                self.latest["warmup send"] = out

    def _output_grad(self, s: int, mb: int, dtype):
        if s + 1 in self.by_index:  # set_local_bwd_input: the next stage's input gradient
            return self.grad_buffers[(s, mb)]
        return self._buffer(self.grad_buffers, (s, mb), self.micro, dtype, False)

    def _sync(self, s: int, kind: str, mb: int):
        return backward_sync(self.by_index[s], last=self.last_backward[s] == (kind, mb))

    def _B(self, s: int, mb: int) -> None:
        import torch

        out, x = self.cache.pop((s, mb))
        with self._sync(s, "B", mb):
            if s == self.stages - 1:
                with self.last_context():  # loss_parallel under a TP plan's sharded loss
                    out[0].backward()
                self.loss = out[0].detach()
            else:
                torch.autograd.backward(out, self._output_grad(s, mb, out.dtype))
        if s - 1 in self.by_index:  # stage_backward hands the input gradient over, leaving .grad None
            self.grad_buffers[(s - 1, mb)], x.grad = x.grad, None
        elif s > 0:  # ... to SEND_B, whose Work holds it
            if self.sends == "1f1b":
                self.latest["grad"] = x.grad
            else:
                self.sent.append(x.grad)
            x.grad = None
        if self.index == self.loop_break and self.sends == "1f1b":  # send_work = the backward's sends now
            self.latest.pop("warmup send", None)

    def _I(self, s: int, mb: int) -> None:
        from torch.distributed.pipelining._backward import stage_backward_input

        out, x = self.cache.pop((s, mb))
        module = self.by_index[s]
        last = s == self.stages - 1
        if last:
            outputs, grads = (out[0],), None
            self.loss = out[0].detach()
        else:
            outputs, grads = (out,), (self._output_grad(s, mb, out.dtype),)
        param_groups = None
        if s != 0:  # the first stage leaves it all to W (its input needs no gradient)
            with self._sync(s, "I", mb), self.last_context():
                dinputs, param_groups = stage_backward_input(outputs, grads, [x], module.parameters())
            if s - 1 in self.by_index:
                self.grad_buffers[(s - 1, mb)] = dinputs[0]
            del dinputs
        self.state[(s, mb)] = ([x], param_groups, outputs, grads)
        if last and s != 0:  # the logits: "no longer used in the last stage for backward"
            logits = out[1]
            if not logits._is_view():
                logits.detach_()
            del logits
        del out, x

    def _W(self, s: int, mb: int) -> None:
        from torch.distributed.pipelining._backward import stage_backward, stage_backward_weight

        inputs, param_groups, outputs, grads = self.state.pop((s, mb))
        with self._sync(s, "W", mb), self.last_context():
            if s != 0:
                stage_backward_weight(self.by_index[s].parameters(), param_groups)
            else:
                stage_backward(outputs, grads, inputs)
        del inputs, param_groups, outputs, grads
