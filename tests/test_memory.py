"""The tracer's bytes against bytes worked out by hand, and against a real CPU step.

Checked against bytes worked out by hand, and torch's own code running for real (the profiler on a CPU step)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from batchfit.trace.memory import rounded
from batchfit.trace.session import TraceSession
from batchfit.workload import StepOptions, Workload
from cpu_truth import profiled_workload_peak

# Linear(1024, 4096) + Linear(4096, 1024) in fp32: each tensor is a multiple of 512 bytes.
W1, B1, W2, B2 = 4096 * 1024 * 4, 4096 * 4, 1024 * 4096 * 4, 1024 * 4
P = W1 + B1 + W2 + B2  # 33,574,912 bytes


def test_rounding_is_the_cuda_allocators():
    assert [rounded(n) for n in (0, 1, 512, 513, 4096 * 4)] == [0, 512, 512, 1024, 16384]


def test_mlp_adamw_fp32_by_hand(mlp):
    snap = TraceSession(mlp, StepOptions()).trace(4).snapshot
    assert snap.breakdown["parameters"] == P
    assert snap.breakdown["gradients"] == P
    # AdamW keeps exp_avg and exp_avg_sq; its step counters stay on the host on CUDA.
    assert snap.breakdown["optimizer_state"] == 2 * P
    # The foreach step's one parameter-sized temporary, and the 4-byte loss in a 512 B block.
    assert snap.phase == "optimizer"
    assert snap.peak_bytes == 5 * P + 512


def test_sgd_without_momentum_has_no_state(mlp):
    snap = TraceSession(mlp, StepOptions(optimizer="sgd")).trace(4).snapshot
    assert snap.breakdown["optimizer_state"] == 0


def test_bf16_mixed_forward_by_hand():
    """One bias-free Linear(4096, 4096), batch 1, loss = y.float().sum(), under CUDA autocast."""
    n = 4096
    work = Workload(name="linear", build_model=lambda: nn.Linear(n, n, bias=False),
                    make_batch=lambda b, device: torch.randn(b, n, device=device),
                    loss_fn=lambda model, x: model(x).float().sum())
    snap = TraceSession(work, StepOptions(precision="bf16-mixed")).trace(1).snapshot
    weight, state = n * n * 4, 2 * n * n * 4
    # The forward peak is at y.float(): the fp32 weight and its Adam state, the cached bf16
    # copy of the weight, x (fp32) and its bf16 cast, y (bf16) and y.float() (fp32). Then y
    # is freed (nothing saves it) before sum() makes the 512-byte loss.
    forward = weight + state + n * n * 2 + rounded(n * 4) + rounded(n * 2) + rounded(n * 2) + rounded(n * 4)
    assert snap.peak_by_phase["forward"] == forward


def test_pure_bf16_halves_weights_and_state(mlp):
    snap = TraceSession(mlp, StepOptions(precision="bf16")).trace(4).snapshot
    assert snap.breakdown["parameters"] == P // 2
    assert snap.breakdown["optimizer_state"] == P


def test_frozen_parameters_have_no_gradients_or_state(mlp):
    snap = TraceSession(mlp, StepOptions(frozen=("0.*",))).trace(4).snapshot
    assert snap.breakdown["gradients"] == W2 + B2
    assert snap.breakdown["optimizer_state"] == 2 * (W2 + B2)


def test_gradient_accumulation_keeps_gradients_across_micro_batches(mlp):
    one = TraceSession(mlp, StepOptions()).trace(2048).snapshot
    four = TraceSession(mlp, StepOptions(accumulation_steps=4)).trace(2048).snapshot
    # From the second micro-batch on, gradients are alive through the backward pass.
    assert four.peak_bytes >= one.peak_bytes
    assert four.breakdown["gradients"] > 0


@pytest.mark.parametrize("batch_size", [64, 4096])
def test_traced_peak_matches_the_profilers_memory_timeline(mlp, batch_size, tmp_path):
    """An independent measurement: PyTorch's profiler on a real CPU step, within 2%."""
    traced = TraceSession(mlp, StepOptions(), cuda_semantics=False).trace(batch_size).snapshot.peak_bytes
    measured = profiled_workload_peak(mlp, batch_size, tmp_path)
    assert abs(traced - measured) / measured < 0.02


def test_adafactor_state_is_row_and_column_factors(mlp):
    """torch's Adafactor reads its step counter and norms with .item(); traced, its state is
    a row and a column factor per matrix (not R x C) and a full second moment per vector."""
    from batchfit import estimate, get_device

    r = estimate(mlp, device=get_device("t4-16gb"), options=StepOptions(optimizer="adafactor"), max_batch=4,
                 limit="allocated")
    block = 512  # each fp32 factor is its own storage, rounded to 512 B
    rounded = lambda n: -(-4 * n // block) * block  # noqa: E731
    # Linear(1024, 4096): weight (4096, 1024) -> rows 4096 + cols 1024; bias 4096
    # Linear(4096, 1024): weight (1024, 4096) -> rows 1024 + cols 4096; bias 1024
    expected = sum(rounded(n) for n in (4096, 1024, 4096, 1024, 4096, 1024))
    assert r.points[0].breakdown["optimizer_state"] == expected == 61440


def test_a_shape_error_is_one_line_naming_the_users_line(tmp_path, capfd):
    from batchfit import estimate, get_device
    from batchfit.errors import TraceError
    from batchfit.specs import load_workload

    (tmp_path / "bad.py").write_text(
        "import torch\nfrom torch import nn\nfrom batchfit import Workload\n\n"
        "def workload():\n"
        "    return Workload(name='bad', build_model=lambda: nn.Linear(8, 8),\n"
        "                    make_batch=lambda b, device: torch.randn(b, 9, device=device),\n"
        "                    loss_fn=lambda m, x: m(x).sum())\n")
    with pytest.raises(TraceError) as error:
        estimate(load_workload(f"{tmp_path}/bad.py:workload"), device=get_device("t4-16gb"))
    assert "bad.py:8" in str(error.value) and "same reduction dim" in str(error.value)
    assert capfd.readouterr().err == ""  # no fake-tensor log before the clean error


def test_module_hooks_live_only_inside_the_trace(mlp):
    from torch.nn.modules import module

    before = (len(module._global_forward_pre_hooks), len(module._global_forward_hooks))
    session = TraceSession(mlp, StepOptions())
    session.trace(2)
    assert (len(module._global_forward_pre_hooks), len(module._global_forward_hooks)) == before
    session.trace(4)
    made_in_forward = {r.module for r in session.tracker._window if r.phase == "forward" and r.role is None}
    assert made_in_forward <= {"0", "1", "2", None} and {"0", "1"} & made_in_forward
    session.close()


def test_parameters_gradients_and_state_are_named_by_their_parameter():
    """A (128256, 4096) state tensor of Llama was attributed to layers.0.mlp.down_proj (the module
    running at the time); now every owned tensor names its parameter."""
    work = Workload(name="lm", build_model=lambda: nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 64),
                                                                 nn.Linear(64, 1000)),
                    make_batch=lambda b, device: torch.randint(0, 1000, (b, 8), device=device),
                    loss_fn=lambda m, x: m(x).float().logsumexp(-1).mean())
    top = TraceSession(work, StepOptions()).trace(2).snapshot.top
    by_shape = {(t["category"], tuple(t["shape"])): t["module"] for t in top}
    assert by_shape[("parameters", (1000, 64))] in ("0.weight", "2.weight")
    assert by_shape[("optimizer_state", (1000, 64))] in ("0.weight", "2.weight")
    assert all(t["module"].endswith((".weight", ".bias")) for t in top
               if t["category"] in ("parameters", "gradients", "optimizer_state"))


class _CastWhileBuilt(nn.Module):
    """The MLP above, cast to bf16 in its own __init__ (as HF's from_config(dtype=...) and many
    user models do), with one module listed twice and one weight tied to another module's."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(1024, 4096), nn.Linear(4096, 1024)
        self.stack = nn.ModuleList([self.up, self.down])  # the same two modules, listed again
        self.tied = nn.Linear(1024, 4096, bias=False)
        self.tied.weight = self.up.weight
        self.to(torch.bfloat16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x.bfloat16()))).float()


def _cast_while_built() -> Workload:
    return Workload(name="cast-while-built", build_model=_CastWhileBuilt,
                    make_batch=lambda b, device: torch.randn(b, 1024, device=device),
                    loss_fn=lambda model, x: model(x).square().mean())


def test_a_model_that_casts_itself_while_built_is_traced_in_bf16():
    """Its bf16 parameters once each (P / 2: the tie kept, the listed-twice modules cast once),
    bf16 gradients, and AdamW's two bf16 states."""
    snap = TraceSession(_cast_while_built(), StepOptions()).trace(4).snapshot
    assert snap.breakdown["parameters"] == P // 2
    assert snap.breakdown["gradients"] == P // 2
    assert snap.breakdown["optimizer_state"] == P
    model = torch.nn.Module.__new__(_CastWhileBuilt)  # and the cast is PyTorch's outside a trace
    model.__init__()
    assert model.tied.weight is model.up.weight and model.up.weight.dtype == torch.bfloat16


def test_a_model_that_casts_itself_while_built_is_planned_with_ddp():
    from batchfit.devices import get_device
    from batchfit.plan.sharded import parse_strategy, trace_sharded

    point = trace_sharded(_cast_while_built(), StepOptions(), get_device("h100-80gb"), parse_strategy("ddp", 2), 4)
    assert point.breakdown["parameters"] == P // 2 and point.breakdown["optimizer_state"] == P


def test_a_storage_keeps_its_key_while_any_tensor_holds_it():
    """The tracker keys a storage by ``id(tensor.untyped_storage())`` and frees its record when that Python
    object dies. torch keeps a storage's Python object alive while anything else holds the storage (the
    refcount's ``kHasPyObject`` bit, c10/util/intrusive_ptr.h): a fake tensor's too, through a new Parameter
    over it, a ``.data`` swap and a view, its only holders in turn. A torch that let it die early would free
    the record of a live tensor: this fails first."""
    died: list[str] = []
    with FakeTensorMode():
        tensor = torch.empty(256, 32)
        key = id(tensor.untyped_storage())
        weakref.finalize(tensor.untyped_storage(), died.append, "storage")
        param = nn.Parameter(tensor)
        del tensor
        other = nn.Parameter(torch.empty(256, 32))
        other.data = param.data
        del param
        view = other.view(-1)
        del other
        gc.collect()
        assert id(view.untyped_storage()) == key and not died
        del view
    assert died == ["storage"]
