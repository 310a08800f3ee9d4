"""The config layer (``src/batchfit/config/``): a command's flags and a ``--trainer`` file become the same
typed objects, callable from Python; every flag a command declares reaches them by name."""

from __future__ import annotations

import dataclasses
import inspect
import json

import pytest

from batchfit.bench.request import BenchRequest
from batchfit.cli.bench import bench_command
from batchfit.cli.estimate import estimate_command
from batchfit.cli.plan import plan_command
from batchfit.cli.probe import probe_command
from batchfit.config.bench import BenchFlags, bench_config
from batchfit.config.estimate import EstimateFlags, estimate_config
from batchfit.config.plan import PlanFlags, plan_config, read_plan_doors
from batchfit.config.probe import ProbeFlags, probe_config
from batchfit.config.step import StepFlags
from batchfit.errors import OptionError
from batchfit.estimator.request import EstimateRequest
from batchfit.plan.request import PlanRequest
from batchfit.plan.world import World
from batchfit.probe.request import ProbeRequest

OUTPUTS = {"json_path", "out", "emit", "trainer"}
"""Flags a command reads itself (where to write) or through its door (--trainer, --emit)."""


def parameters(command) -> set[str]:
    return set(inspect.signature(inspect.unwrap(command)).parameters)


def fields(cls) -> set[str]:
    return {field.name for field in dataclasses.fields(cls)}


@pytest.mark.parametrize(("command", "flags"), [(plan_command, PlanFlags), (estimate_command, EstimateFlags),
                                               (probe_command, ProbeFlags), (bench_command, BenchFlags)])
def test_every_flag_of_a_command_is_a_field_and_every_field_a_flag(command, flags):
    """A field spelled unlike its flag would keep its default without a word (``pick`` takes names): each
    field of the command's flags is one of its parameters, and each parameter lands in a field."""
    declared = parameters(command)
    assert fields(flags) <= declared
    assert declared - fields(flags) - fields(StepFlags) <= OUTPUTS


def test_estimate_probe_and_bench_get_their_engines_requests_from_python():
    """Each config is the engine's request, built before torch loads: estimate's search and limits, probe's
    default cap (4096, not the library's) and bench's default sizes; a bad value is refused by its field."""
    flags = EstimateFlags(model="gpt-tinystories-22m", gpu="t4-16gb", max_batch=64, limit="allocated", global_batch=32,
                          no_cache=True)
    estimate = estimate_config(flags, StepFlags(), None, None)
    assert estimate.request == EstimateRequest(max_batch=64, limit="allocated", global_batch=32, cache=False)
    assert estimate.run is None and estimate.target.spec == "virtual:t4-16gb"
    probe = probe_config(ProbeFlags(model="gpt-tinystories-22m", gpu="t4-16gb", min_batch=2), StepFlags(), None)
    assert probe.request == ProbeRequest(smallest=2, largest=4096, spec="gpt-tinystories-22m")
    with pytest.raises(OptionError, match="give `max` N"):
        probe_config(ProbeFlags(model="gpt-tinystories-22m", device="cpu"), StepFlags(), None)
    bench = bench_config(BenchFlags(model="gpt-tinystories-22m", gpu="t4-16gb", steps=5, leak_check=True),
                         StepFlags(precision="bf16-mixed"), None)
    assert bench.request == BenchRequest(batch_sizes=[8, 16, 32, 64], steps=5, leak_check_steps=5)
    assert bench.options.precision == "bf16-mixed"
    with pytest.raises(OptionError, match="`steps` must be 1 or more"):
        bench_config(BenchFlags(model="gpt-tinystories-22m", gpu="t4-16gb", steps=0), StepFlags(), None)


def test_pick_keeps_the_defaults_of_flags_a_command_lacks():
    """plan has no --accumulation-steps, --quantize or --lora: its StepOptions get the defaults."""
    step = StepFlags.pick({"precision": "bf16-mixed", "checkpointing": "full", "model": "x", "gpus": "8"})
    options = step.options()
    assert (options.precision, options.checkpointing, options.accumulation_steps, options.quantize) == (
        "bf16-mixed", "full", 1, "none")


def test_plan_flags_become_one_request(tmp_path):
    flags = PlanFlags(model="gpt-tinystories-22m", gpu="h100-80gb", gpus="1,2", nodes=None, strategies="fsdp",
                      tokens="2e11", mfu=0.5, batch_sizes="2,4", inter_node_gb_per_s=25.0)
    config = plan_config(flags, StepFlags(precision="bf16-mixed"), read_plan_doors(flags.model, None, None))
    request = config.request
    assert request.worlds == [World(1), World(2)]
    assert (request.strategies, request.tokens, request.batch_sizes) == ("fsdp", "2e11", [2, 4])
    assert (request.time_model.mfu, request.time_model.inter_node_gb_per_s) == (0.5, 25.0)
    assert config.target.device.name == "h100-80gb" and config.options.precision == "bf16-mixed"
    assert config.options.tp_loss == "sharded" and config.emits == [] and config.data_section is None


@pytest.mark.slow  # reading TrainingArguments imports transformers: 17 s alone on a 2-core machine
def test_the_trainer_args_give_the_plan_its_global_batch_and_strategy(tmp_path):
    """per_device_train_batch_size 4 x gradient_accumulation_steps 8 x the 4 GPUs planned = 128 (a saved
    TrainingArguments does not record its world size); fsdp 'full_shard' is plan's fsdp."""
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 8,
                                "bf16": True, "fsdp": "full_shard"}))
    flags = PlanFlags(model="gpt-tinystories-22m", gpu="h100-80gb", gpus="4")
    config = plan_config(flags, StepFlags(), read_plan_doors(flags.model, str(args), None))
    assert (config.request.global_batch, config.request.strategies) == (128, "fsdp")
    assert config.options.precision == "bf16-mixed" and 4 in config.request.batch_sizes


def test_plan_config_refuses_as_the_command_did():
    doors = read_plan_doors("gpt-tinystories-22m", None, None)
    with pytest.raises(OptionError, match="give `mfu` or `calibrate`, not both"):
        plan_config(PlanFlags(model="gpt-tinystories-22m", mfu=0.4, calibrate="bench.json"), StepFlags(), doors)
    with pytest.raises(OptionError, match="plan sizes a batch for a GPU"):
        plan_config(PlanFlags(model="gpt-tinystories-22m", gpus="2", device="cpu"), StepFlags(), doors)
    with pytest.raises(OptionError, match="`emit` trainer:FILE writes your TrainingArguments back"):
        read_plan_doors("gpt-tinystories-22m", None, ["trainer:out.json"])


def test_plan_takes_a_request_or_its_fields_not_both():
    from batchfit.devices import get_device
    from batchfit.plan.engine import plan

    with pytest.raises(TypeError, match="not both"):
        plan(None, PlanRequest(worlds=[World(2)]), device=get_device("h100-80gb"), strategies="ddp")
    with pytest.raises(TypeError):  # a misspelt field is refused, not dropped
        plan(None, device=get_device("h100-80gb"), worlds=[World(2)], strategy="ddp")
