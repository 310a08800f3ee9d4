"""plan/bound.py: a candidate whose parameters, gradients and AdamW state alone pass the usable
memory is set aside before any trace; the floor is never above what the tracer counts."""

from __future__ import annotations

from batchfit.devices import Device
from batchfit.plan.bound import floor_bytes, model_bytes
from batchfit.plan.engine import plan
from batchfit.plan.sharded import parse_strategy
from batchfit.plan.world import World
from batchfit.workload import StepOptions
from tiny import OPTIONS, tiny_workload, traced_rank0

MiB = 1 << 20


def _params() -> int:
    return sum(p.numel() for p in tiny_workload().build_model().parameters())


def test_the_floor_by_hand_and_under_the_traced_peak():
    model = model_bytes(tiny_workload(), OPTIONS)  # fp32, AdamW: 4 + 4 + 8 bytes per parameter
    params = _params()
    assert model.param_bytes == 4 * params
    expected = {"ddp": 16 * params, "zero1": 4 * params + 8 * params // 2, "fsdp": 16 * params // 2}
    for name, floor in expected.items():
        assert floor_bytes(parse_strategy(name, 2), model) == floor
        if name != "zero1":  # (ZeRO's floor is DDP's with the state sharded: two traces say the rule)
            assert floor <= traced_rank0(name, 2).peak_bytes  # rank 0's traced step holds at least that
    assert model_bytes(tiny_workload(), StepOptions(optimizer="sgd")) is None  # not certain: no floor
    assert model_bytes(tiny_workload(), StepOptions(frozen=("embed*",))) is None


def test_auto_sets_aside_what_cannot_fit_and_traces_the_rest(standin):
    params = _params()
    usable = 12 * params  # under ddp's 16 bytes per parameter, over fsdp's 8 and zero1's 8 on 2 GPUs
    device = Device(name="t", display_name="t", total_bytes=usable, context_bytes=0, workspace_bytes=0)
    result = plan(tiny_workload(), device=device, worlds=[World(2)], strategies="auto", limit="allocated",
                  trace=standin.tracer["trace"], parse=standin.parse_strategies)
    skipped = {p.strategy: p.skipped for p in result.plans if p.skipped and "not traced" in p.skipped}
    assert list(skipped) == ["ddp"] and "AdamW state alone take at least" in skipped["ddp"]
    assert {"fsdp", "zero1"} <= {p.strategy for p in result.plans if not p.skipped}
    small = Device(name="s", display_name="s", total_bytes=params, context_bytes=0, workspace_bytes=0)
    result = plan(tiny_workload(), device=small, worlds=[World(2)], strategies="auto", limit="allocated",
                  trace=standin.tracer["trace"], parse=standin.parse_strategies)
    # every candidate over its floor: all traced, so each row says what would make local batch 1 fit
    assert not any(p.skipped and "not traced" in p.skipped for p in result.plans)
