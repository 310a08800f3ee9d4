"""--offload activations (train/offload.py): torchtune's / TRL's saved-tensor hooks in the one step.

A CPU cannot tell host from device, so three checks: bytes by hand (device bytes fall by the
saved activations that left, the host figure is what was copied), the real step on this CPU
under the profiler against the trace's device + host total, and values and gradients equal to
the step without offload.

The model: 8 x (Linear(256, 256, bias=False), ReLU), loss mean(out ** 2), batch 16, fp32, SGD.
Every saved tensor is one 16 x 256 fp32 activation, S = 16,384 bytes. The forward saves (packs)
x (first linear), then each ReLU's output twice (the ReLU's own backward, and the next linear's
or the square's input): 1 + 2 x 8 = 17 packs, each copied out (torchtune copies a storage saved
twice twice), so 17 S on the host. Linears 1-7 also save their weight's transpose (x needs no
gradient, so linear 0 does not): 7 more packs, views of parameters, which stay. The stash keeps
the tensors of the last 5 packs (of all 24, as torchtune counts) on the device until their copy is
done: packs 20-24 are r6, r6, W7^T, r7, r7, two storages; the other seven of the nine saved
storages (x, r0-r5) leave.

Checked against batchfit's own mirror of torchtune's / TRL's offloading hooks running for real on a CPU step (checks
the counting, not the fidelity to those libraries' streams on a GPU), and bytes by hand.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from batchfit.errors import OptionError
from batchfit.options import Offload
from batchfit.trace.memory import MemoryTracker, pinned_rounded
from batchfit.trace.session import TraceSession
from batchfit.train.step import TrainingStep
from batchfit.workload import StepOptions, Workload
from cpu_truth import profiled_step_peak

L, W, B = 8, 256, 16
S = B * W * 4


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(L) for m in (nn.Linear(W, W, bias=False), nn.ReLU())])


def _batch(batch_size: int, device: torch.device) -> torch.Tensor:
    return torch.randn(batch_size, W, generator=torch.Generator().manual_seed(1)).to(device)


MLP = Workload(name="mlp", build_model=_mlp, make_batch=_batch, loss_fn=lambda m, x: m(x).pow(2).mean(),
               build_optimizer=lambda p: torch.optim.SGD(p, lr=0.1))


class AtBackward(MemoryTracker):
    """Also notes the device and host bytes alive as the backward starts (what the forward kept)."""

    def phase(self, name: str) -> None:
        if name == "backward":
            self.device_at_backward, self.host_at_backward = self.live_bytes, self.host_live_bytes
        super().phase(name)


def _traced(offload: str, *, cuda: bool = False) -> tuple[TraceSession, AtBackward]:
    tracker = AtBackward(round_bytes=512 if cuda else 1)
    session = TraceSession(MLP, StepOptions(offload=offload), cuda_semantics=cuda, tracker=tracker)
    return session, tracker


def test_device_bytes_fall_by_the_saved_activations_that_moved() -> None:
    plain, plain_tracker = _traced("none")
    moved, moved_tracker = _traced("activations")
    with plain, moved:
        a, b = plain.trace(B).snapshot, moved.trace(B).snapshot
    assert plain_tracker.device_at_backward - moved_tracker.device_at_backward == 7 * S
    assert moved_tracker.host_at_backward == 17 * S
    assert (a.host_peak_bytes, b.host_peak_bytes, b.host_reserved_bytes) == (0, 17 * S, 17 * S)
    assert moved.step.offload.offloaded_bytes == 2 * 17 * S  # the warm-up step and the measured one


def test_host_figure_rounds_as_the_pinned_allocator() -> None:
    assert [pinned_rounded(n) for n in (1, 1024, 1025, 3 * 2**20)] == [1, 1024, 2048, 4 * 2**20]
    session, _ = _traced("activations", cuda=True)
    with session:
        snap = session.trace(B).snapshot
    assert snap.host_peak_bytes == 17 * S  # S is a power of two already


def test_real_cpu_step_matches_the_traced_device_plus_host_total(tmp_path: Path) -> None:
    session, _ = _traced("activations")
    with session:
        traced = session.trace(B).snapshot
    real = TrainingStep(MLP, StepOptions(offload="activations"), torch.device("cpu"))
    assert profiled_step_peak(real, B, tmp_path) == traced.total_peak_bytes


def test_values_and_gradients_equal_the_step_without_offload() -> None:
    steps = [TrainingStep(MLP, StepOptions(offload=o), torch.device("cpu")) for o in ("none", "activations")]
    losses, grads = [], []
    for step in steps:
        loss = step.forward(_batch(B, torch.device("cpu")))
        step.backward(loss)
        losses.append(loss.item())
        grads.append([p.grad.clone() for p in step.model.parameters()])
    assert losses[0] == losses[1]
    assert all(torch.equal(g0, g1) for g0, g1 in zip(*grads))
    assert steps[1].offload.offloaded_bytes == 17 * S
    assert not steps[1].offload._saved and not steps[1].offload._bwd_stash  # nothing left behind


def test_output_head_and_small_tensors_stay() -> None:
    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.lm_head = nn.Linear(W, W), nn.Linear(W, 8)

        def forward(self, x):
            return self.lm_head(torch.relu(self.body(x)))

    step = TrainingStep(dataclasses.replace(MLP, build_model=Head), StepOptions(offload="activations"),
                        torch.device("cpu"))
    step.forward(_batch(B, torch.device("cpu"))).backward()
    # x (the body's input) and relu's output (relu's own): 2 S; the head's input stays, and its
    # output (B x 8 floats, 512 bytes) is under 1024 bytes anyway.
    assert step.offload.offloaded_bytes == 2 * S


@pytest.mark.parametrize("value", ["none", "activations", "params", "activations+params", "params+activations"])
def test_offload_grammar(value: str) -> None:
    Offload.parse(value)


@pytest.mark.parametrize("value", ["", "optimizer", "activations+activations", "none+params", "Activations"])
def test_offload_grammar_refuses(value: str) -> None:
    with pytest.raises(OptionError, match="use none, activations, params or activations"):
        StepOptions(offload=value)


def test_transfer_time_by_hand() -> None:
    """0.3 s of compute (forward 0.1, backward 0.2); 12.8 GB out and back over the H100's PCIe Gen5
    x16 (64 GB/s a way): 0.2 s each way, 0.1 s longer than the forward it hides behind."""
    from types import SimpleNamespace

    from batchfit.devices import custom_device, get_device, host_link_seconds
    from batchfit.plan.sharded import parse_strategy
    from batchfit.plan.time_model import TimeModel, step_time
    from batchfit.plan.world import World

    h100 = get_device("h100-80gb")
    point = SimpleNamespace(flops=int(0.3 * 989e12 * 0.5), collectives=(), offloaded_bytes=int(12.8e9))
    time = step_time(point, parse_strategy("fsdp", 1), World(1), h100, "bf16-mixed", TimeModel(mfu=0.5))
    assert (time.compute_s, time.offload_transfer_s) == (pytest.approx(0.3), pytest.approx(0.2))
    assert (time.offload_exposed_s, time.step_time_s) == (pytest.approx(0.1), pytest.approx(0.4))
    assert host_link_seconds(32 * 10**9, custom_device(24 * 2**30)) == 1.0  # PCIe Gen4 x16 assumed
