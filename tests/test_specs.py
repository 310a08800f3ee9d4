"""MODEL specs: zoo names, shipped hf configs, config.json files, user functions."""

from __future__ import annotations

import json

import pytest

from batchfit.errors import ModelSpecError
from batchfit.specs import load_workload
from batchfit.trace.session import TraceSession
from batchfit.workload import StepOptions
from batchfit.zoo import ZOO


def params(spec: str, **kwargs) -> int:
    return TraceSession(load_workload(spec, **kwargs), StepOptions()).params


@pytest.mark.parametrize("spec,count", [
    ("gpt-tinystories-22m", 22_696_448),    # seed 002's table
    ("gpt2-124m", 124_439_808),             # GPT-2 small, tied embeddings
    ("hf:gpt2", 124_439_808),
    ("hf:llama-3.2-1b", 1_235_814_400),     # Llama 3.2 1B's published count
])
def test_parameter_counts(spec, count):
    assert params(spec) == count


def test_every_zoo_model_traces():
    for name in ZOO:
        workload = load_workload(name, seq_len=8)
        batch = workload.batch_multiple()  # grpo-gpt2-124m: a whole group of 8
        snap = TraceSession(workload, StepOptions(precision="bf16-mixed")).trace(batch).snapshot
        assert snap.peak_bytes > 0, name


def test_hf_config_json_path(tmp_path):
    config = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    workload = load_workload(f"hf:{path}")
    assert workload.tokens_per_sample == 256
    assert TraceSession(workload, StepOptions()).params > 0


def test_seq_len_overrides_and_is_checked():
    assert load_workload("gpt2-124m", seq_len=128).tokens_per_sample == 128
    with pytest.raises(ModelSpecError, match="--seq-len"):
        load_workload("gpt2-124m", seq_len=0)
