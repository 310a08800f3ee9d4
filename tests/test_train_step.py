"""The one training step (``batchfit.train.step.TrainingStep``): fp16-mixed scales its loss on a real
device, a step the GradScaler skips is reported and not an error, and the sweep runs it.

The model is Linear(4, 1) without bias, every weight 0.5, trained on batches of ones with the
loss ``mean(y) x C``. Each weight's gradient is then exactly C (d mean(y) / dw_j = mean(x_j) = 1).
With C = 2**-27 every figure is a power of two, so the step can be worked out by hand:

- fp32: the gradient is 2**-27; SGD at lr 2**20 moves each weight by -2**-7, to 0.4921875.
- fp16-mixed: autocast computes y in fp16, so the gradient of y (C / 2 = 2**-28 per sample)
  is an fp16 number, and fp16's smallest (subnormal) number is 2**-24: it underflows to 0,
  and without loss scaling the weights do not move at all. The GradScaler's scale 2**16 lifts
  it to 2**-12; the weight gradient 2**-11 is unscaled back to 2**-27: the fp32 step, exactly.

With C = 2**10 instead, the scaled weight gradient (2**10 x scale, an fp16 number) is above
fp16's largest number (65504) until the scale is 2**5: the scaler skips the step and halves its
scale 11 times in a row (from 2**16), then steps.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchfit.runs.budget import Budget, Schedule
from batchfit.runs.data import BatchSource
from batchfit.runs.store import Store
from batchfit.sweep.run import RunSpec, train_run
from batchfit.trace.session import TraceSession
from batchfit.train.step import TrainingStep
from batchfit.workload import StepOptions, Workload

UNDERFLOWS = 2.0**-27
OVERFLOWS = 2.0**10
SKIPS = 11
SMALL_LR = 2.0**-20
LR = 2.0**20
MOVED = 0.5 - LR * UNDERFLOWS  # 0.4921875, exact in fp32
CPU = torch.device("cpu")


def linear_workload(scale: float, built: list[nn.Module] | None = None) -> Workload:
    def build_model() -> nn.Module:
        model = nn.Linear(4, 1, bias=False)
        nn.init.constant_(model.weight, 0.5)
        if built is not None:
            built.append(model)
        return model

    return Workload(name="linear", build_model=build_model,
                    make_batch=lambda n, device: torch.ones(n, 4, device=device),
                    loss_fn=lambda model, x: model(x).float().mean() * scale,
                    build_optimizer=lambda params: torch.optim.SGD(params, lr=LR))


def one_step(precision: str, *, scaler: bool = True) -> torch.Tensor:
    trainer = TrainingStep(linear_workload(UNDERFLOWS), StepOptions(precision=precision), CPU)
    if not scaler:
        trainer.scaler = None
    assert trainer.step([(2, torch.ones(2, 4))], 2, lr=LR).stepped
    return trainer.model.weight.detach().clone()


def test_fp32_moves_each_weight_by_lr_times_the_gradient():
    assert one_step("fp32").tolist() == [[MOVED] * 4]


def test_fp16_mixed_without_a_scaler_underflows_and_does_not_move():
    """What every fp16-mixed sweep did before it ran the one step (issue 19, defect 2)."""
    assert one_step("fp16-mixed", scaler=False).tolist() == [[0.5] * 4]


def test_fp16_mixed_on_a_real_cpu_step_scales_and_moves_as_fp32_does():
    assert one_step("fp16-mixed").tolist() == [[MOVED] * 4]


def test_a_traced_step_has_no_scaler_and_a_real_one_scales_on_its_device():
    """Fake tensors have no values for the scaler's inf check (and the traced peaks stay what
    they were): the tracer's fp16-mixed step is unscaled; a real CPU one has a CPU scaler."""
    with TraceSession(linear_workload(1.0), StepOptions(precision="fp16-mixed")) as session:
        assert session.step.scaler is None
    real = TrainingStep(linear_workload(1.0), StepOptions(precision="fp16-mixed"), CPU)
    assert isinstance(real.scaler, torch.amp.GradScaler) and real.scaler._device == "cpu"
    assert TrainingStep(linear_workload(1.0), StepOptions(precision="bf16-mixed"), CPU).scaler is None


def test_a_step_the_scaler_skips_is_reported_and_leaves_the_weights():
    trainer = TrainingStep(linear_workload(OVERFLOWS), StepOptions(precision="fp16-mixed"), CPU)
    results = [trainer.step([(2, torch.ones(2, 4))], 2, lr=SMALL_LR) for _ in range(SKIPS + 1)]
    assert [r.stepped for r in results] == [False] * SKIPS + [True]
    assert trainer.scaler.get_scale() == 2.0**5  # halved 11 times from 2**16
    assert all(r.loss == 2 * OVERFLOWS for r in results)  # y = 2: the loss itself is finite
    # the skipped steps left the weights at 0.5; the last moved them by lr x 2**10 = 2**-10
    assert trainer.model.weight.detach().tolist() == [[0.5 - 2.0**-10] * 4]


def test_clipping_sees_the_unscaled_gradient():
    """C = 2**-4: four weights' gradients of 2**-4, norm 2**-3. Clipped at 2**-4 they halve, and
    SGD at lr 1 moves each weight by 2**-5. Clipping the scaled gradient (norm 2**13) instead
    would leave almost nothing of it."""
    trainer = TrainingStep(linear_workload(2.0**-4), StepOptions(precision="fp16-mixed"), CPU)
    assert trainer.step([(2, torch.ones(2, 4))], 2, lr=1.0, max_grad_norm=2.0**-4).stepped
    torch.testing.assert_close(trainer.model.weight.detach(), torch.full((1, 4), 0.5 - 2.0**-5))


def test_micro_batches_must_hold_the_batch():
    trainer = TrainingStep(linear_workload(1.0), StepOptions(), CPU)
    with pytest.raises(ValueError, match="hold 2 samples, the batch 4"):
        trainer.step([(2, torch.ones(2, 4))], 4)


# --- the sweep's run path ----------------------------------------------------------------


class Stop(Exception):
    pass


def sweep_run(tmp_path, workload: Workload, steps: int, *, lr: float = LR, store_name: str = "s.db",
              stop_at: int | None = None, said: list[str] | None = None) -> dict:
    """One sweep run of ``steps`` steps at batch 2 (constant ``lr``, no clipping), evaluated
    and checkpointed after every step; ``stop_at``: stop it (as a kill would) after that step's
    evaluation, before its checkpoint."""
    store = Store(tmp_path / store_name)
    spec = RunSpec(run_id=store.add_run(2, lr, steps), batch_size=2, lr=lr, micro_batch=2,
                   budget=Budget(unit="samples", total=2 * steps, tokens_per_sample=None),
                   schedule=Schedule(total=2 * steps, warmup=0, min_lr_ratio=1.0), seed=0,
                   eval_every=2, checkpoint_every=2, eval_samples=2, grad_clip=None, precision="fp16-mixed")

    def progress(message: str) -> None:
        (said if said is not None else []).append(message)
        if stop_at is not None and f"step {stop_at}/" in message:
            raise Stop

    return train_run(workload, BatchSource(workload, seed=0), spec, store, tmp_path / f"{store_name}.ckpt", CPU,
                     progress)


def test_an_fp16_mixed_sweep_run_scales_and_trains_as_fp32_would(tmp_path):
    built: list[nn.Module] = []
    row = sweep_run(tmp_path, linear_workload(UNDERFLOWS, built), steps=1)
    assert row["status"] == "done"
    assert built[0].weight.detach().tolist() == [[MOVED] * 4]  # unscaled fp16 left it at 0.5
    # the validation loss is mean(y) x C = 4 x weight x C, before and after the step
    assert row["initial_val_loss"] == 4 * 0.5 * UNDERFLOWS
    assert row["final_val_loss"] == 4 * MOVED * UNDERFLOWS


def test_skipped_steps_are_not_errors_and_a_resumed_run_keeps_the_scale(tmp_path):
    """Eleven skipped steps, then three that move; a run stopped after step 5 and resumed from
    step 4's checkpoint must carry on at that checkpoint's scale (2**12), not skip 11 again
    (which would leave the weights where they started)."""
    built: list[nn.Module] = []
    said: list[str] = []
    whole = sweep_run(tmp_path, linear_workload(OVERFLOWS, built), steps=SKIPS + 3, lr=SMALL_LR, said=said)
    assert whole["status"] == "done" and whole["steps_done"] == SKIPS + 3
    assert said[-1].endswith("(11 steps skipped by the fp16 loss scaler)")
    assert built[0].weight.detach().tolist() == [[0.5 - 3 * 2.0**-10] * 4]

    with pytest.raises(Stop):
        sweep_run(tmp_path, linear_workload(OVERFLOWS), steps=SKIPS + 3, lr=SMALL_LR, store_name="r.db", stop_at=5)
    resumed = sweep_run(tmp_path, linear_workload(OVERFLOWS), steps=SKIPS + 3, lr=SMALL_LR, store_name="r.db")
    keys = ("status", "steps_done", "final_train_loss", "final_val_loss", "best_val_loss")
    assert {k: resumed[k] for k in keys} == {k: whole[k] for k in keys}
