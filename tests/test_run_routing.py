"""--routing per step in the run's replay (issue 32, item 3): a tiny Qwen3-MoE (8 experts, top-2, HF's
expert loop) whose routing changes from worst to balanced at step 2. Each replayed step's allocated
peak equals the same step's in a replay with that one routing throughout (the state before it is the
same: routing moves tokens between experts, not the parameters or the optimizer state), and the run's
peak is named with its step and routing in the terminal and the JSON."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from batchfit.cli.app import app
from batchfit.devices import custom_device, parse_size
from batchfit.errors import OptionError
from batchfit.estimator.batching import Shape
from batchfit.estimator.churn import churn
from batchfit.estimator.run import Lengths
from batchfit.options import Routing, RoutingSchedule
from batchfit.specs import load_workload
from batchfit.workload import StepOptions

transformers = pytest.importorskip("transformers")


def test_the_schedule_grammar_is_parsed_once():
    schedule = RoutingSchedule.parse("worst*2,capacity:1.5,balanced")
    assert [str(schedule.at(i)) for i in range(6)] == ["worst", "worst", "capacity:1.5", "balanced", "balanced",
                                                       "balanced"]  # the last holds after
    assert str(schedule) == "worst*2,capacity:1.5,balanced" and schedule.varies
    assert not RoutingSchedule.parse("worst*3").varies
    assert StepOptions(routing="worst*3").routing_spec == Routing("worst")
    for bad, words in (("worst*0", "positive number of times"), ("worst*x", "positive number"),
                       ("balanced,even", "use balanced")):
        with pytest.raises(OptionError, match=words):
            RoutingSchedule.parse(bad)


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("moe")
    (folder / "config.json").write_text(json.dumps(dict(
        model_type="qwen3_moe", vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=128)))
    return f"hf:{folder}"


@pytest.mark.slow
def test_each_step_runs_its_routing_and_the_runs_peak_is_named(moe, tmp_path):
    device = custom_device(parse_size("1GiB"))
    shapes = [Shape(4, 16)] * 4

    def steps(routing: str) -> list[int]:
        at = Lengths(lambda n: load_workload(moe, seq_len=n), 16)
        replay = churn(at, shapes, 4, StepOptions(routing=routing), device).default
        return [s.peak_allocated_bytes for s in replay.steps]

    mixed, worst, balanced = steps("worst*2,balanced"), steps("worst"), steps("balanced")
    assert mixed[:2] == worst[:2] and mixed[2:] == balanced[2:]
    assert balanced[3] > worst[3]  # HF's loop: each expert hit sends back a weight-sized gradient
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"n": 16}) + "\n" for _ in range(16)))
    out = tmp_path / "m.json"
    result = CliRunner().invoke(app, ["estimate", moe, "--gpu-memory", "1GiB", "--limit", "allocated", "--data",
                                      str(data), "--length-column", "n", "--max-batch", "4", "--replay-steps", "4",
                                      "--routing", "worst*2,balanced", "--json", str(out),
                                      "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    assert "the run's peak is step 2's" in " ".join(result.output.split())
    replay = json.loads(out.read_text())["run"]["churn"]
    assert (replay["peak_step"], replay["peak_bytes"]) == (2, mixed[2])
    assert [s["routing"] for s in replay["default"]["steps"]] == ["worst", "worst", "balanced", "balanced"]


def test_a_routing_per_step_needs_the_replay(moe):
    result = CliRunner().invoke(app, ["estimate", moe, "--gpu-memory", "1GiB", "--routing", "worst,balanced"])
    assert result.exit_code != 0 and "add --data FILE --replay-steps K" in result.output
    result = CliRunner().invoke(app, ["bench", moe, "--device", "virtual:a100-40gb", "--routing", "worst,balanced"])
    assert result.exit_code != 0 and "only estimate --data FILE --replay-steps K replays" in result.output
