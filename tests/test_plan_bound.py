"""plan/bound.py: a candidate whose parameters, gradients and AdamW state alone pass the usable
memory is set aside before any trace; the floor is never above what the tracer counts."""

from __future__ import annotations

from batchfit.devices import Device
from batchfit.plan.bound import floor_bytes, model_bytes
from batchfit.plan.engine import plan
from batchfit.plan.sharded import parse_strategy
from batchfit.plan.world import World
from batchfit.workload import StepOptions
from tiny import OPTIONS, TINY_LLAMA_FILE, tiny_workload, traced_rank0

MiB = 1 << 20


def _params() -> int:
    return sum(p.numel() for p in tiny_workload().build_model().parameters())


def test_the_floor_by_hand_and_under_the_traced_peak():
    model = model_bytes(tiny_workload(), OPTIONS)  # fp32, AdamW: 4 + 4 + 8 bytes per parameter
    params = _params()
    assert model.param_bytes == 4 * params
    expected = {"ddp": 16 * params, "zero1": 4 * params, "fsdp": 16 * params // 2}
    for name, floor in expected.items():
        assert floor_bytes(parse_strategy(name, 2), model) == floor
        if name != "zero1":  # (ZeRO's floor is its whole parameters, a part of DDP's: two traces say the rule)
            assert floor <= traced_rank0(name, 2).peak_bytes  # rank 0's traced step holds at least that
    assert model_bytes(tiny_workload(), StepOptions(optimizer="sgd")) is None  # not certain: no floor
    assert model_bytes(tiny_workload(), StepOptions(frozen=("embed*",))) is None


def test_auto_sets_aside_what_cannot_fit_and_traces_the_rest(standin):
    params = _params()
    usable = 12 * params  # under ddp's 16 bytes per parameter, over fsdp's 8 and zero1's 4 on 2 GPUs
    device = Device(name="t", display_name="t", total_bytes=usable, context_bytes=0, workspace_bytes=0)
    result = plan(tiny_workload(), device=device, worlds=[World(2)], strategies="auto", limit="allocated",
                  trace=standin.tracer["trace"], parse=standin.parse_strategies)
    skipped = {p.strategy: p.skipped for p in result.plans if p.skipped and "take at least" in p.skipped}
    assert list(skipped) == ["ddp"] and "AdamW state alone take at least" in skipped["ddp"]
    # said once: the row's status is 'skipped' (not traced), its reason the floor ('skipped: not traced: ...' was)
    (row,) = [row for row in result.ranking if row.strategy == "ddp"]
    assert f"{row.status}: {row.why}".startswith("skipped: its parameters, gradients and AdamW state alone take ")
    assert {"fsdp", "zero1"} <= {p.strategy for p in result.plans if not p.skipped}
    small = Device(name="s", display_name="s", total_bytes=params, context_bytes=0, workspace_bytes=0)
    result = plan(tiny_workload(), device=small, worlds=[World(2)], strategies="auto", limit="allocated",
                  trace=standin.tracer["trace"], parse=standin.parse_strategies)
    # every candidate over its floor: all traced, so each row says what would make local batch 1 fit
    assert not any(p.skipped and "take at least" in p.skipped for p in result.plans)


def test_plan_asked_again_reads_its_rows_as_no_cache_traces_them(tmp_path):
    # plan/row_cache.py: the same sessions asked again (here with one GPU count more) are read, not traced
    # (not ddp: with 4 GPUs more its session would also answer their rows, world_independent),
    # and the rows are those a run without the cache writes
    import json

    from typer.testing import CliRunner

    from batchfit.cli.app import app

    (tmp_path / "tiny.py").write_text(TINY_LLAMA_FILE)

    def run(name: str, gpus: str, *flags: str) -> tuple[dict, str]:
        spec, folder = f"{tmp_path / 'tiny.py'}:workload", str(tmp_path / name.removesuffix(".json"))
        out = CliRunner().invoke(app, ["plan", spec, "--gpu", "h100-80gb", "--gpus", gpus, "--strategies", "fsdp,zero1",
                                       "--batch-sizes", "1,2", "--max-batch", "2", "--processes", "1",
                                       "--limit", "allocated", *flags, "--json", str(tmp_path / name), "--out", folder])
        assert out.exit_code == 0, out.output
        data = json.loads((tmp_path / name).read_text())
        del data["created"], data["trace_seconds"]
        return data, out.output

    first, _ = run("first.json", "2")
    again, said = run("again.json", "2,4")
    assert said.count("read from the trace cache") == 2 and "on 4 GPUs: local batch" in said  # 4 GPUs: traced
    without, _ = run("without.json", "2,4", "--no-cache")
    assert again == without
    assert [p for p in again["strategies"] if p["gpus"] == 2] == first["strategies"]
