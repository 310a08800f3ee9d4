"""The timed-step loop probe and bench share: it names the device in every CUDA call."""

from __future__ import annotations

import torch

from batchfit.train import timing
from batchfit.train.step import TrainingStep
from batchfit.workload import StepOptions


class _Recorder:
    """Stands in for torch.cuda: records which device each call names."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def __getattr__(self, name):
        def call(device=None):
            self.calls.append((name, device))
            return 123

        return call


class _StepOnCuda1:
    """A real CPU step that says it lives on cuda:1: the loop must ask cuda:1, never the
    current device."""

    def __init__(self, step: TrainingStep) -> None:
        self.step, self.device = step, torch.device("cuda", 1)

    def run(self, batch_size, hooks=None):
        return self.step.run(batch_size, hooks)


def test_every_cuda_call_names_the_steps_device(mlp, monkeypatch):
    step = _StepOnCuda1(TrainingStep(mlp, StepOptions(), torch.device("cpu")))
    recorder = _Recorder()
    monkeypatch.setattr(timing.torch, "cuda", recorder)
    timed = timing.run_timed_steps(step, 2, steps=2, warmup=1)
    assert recorder.calls and all(device == torch.device("cuda", 1) for _, device in recorder.calls)
    names = [name for name, _ in recorder.calls]
    assert names[0] == "reset_peak_memory_stats"
    assert names.count("synchronize") == 4  # before and after each timed step, never inside one
    assert timed.peak_allocated_bytes == timed.peak_reserved_bytes == 123
    assert len(timed.times_s) == 2
