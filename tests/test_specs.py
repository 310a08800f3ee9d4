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


@pytest.mark.slow
def test_every_zoo_model_traces():
    for name in ZOO:
        if name == "frozen-pair":  # 15B frozen parameters: frozen-pair-tiny is the same code
            continue
        if name.startswith("enoki-") and name != "enoki-28h":  # the same code at more heads (~7 s each)
            continue
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
    with pytest.raises(ModelSpecError, match="`seq_len`"):
        load_workload("gpt2-124m", seq_len=0)


def test_hf_folder_wins_over_the_shipped_name(tmp_path):
    # A downloaded model folder named like a shipped config: its own config.json is the model.
    folder = tmp_path / "llama-3.1-8b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 256}))
    model = load_workload(f"hf:{folder}").build_model()
    # per layer: q 64x64, k and v 64x32, o 64x64, gate/up/down 3 x 64x128, 2 RMSNorms of 64;
    # plus embedding and untied head 512x64 each, final norm 64
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert sum(p.numel() for p in model.parameters()) == 2 * per_layer + 2 * 512 * 64 + 64 == 139_584


def test_hf_paths_that_do_not_exist_are_errors(tmp_path):
    with pytest.raises(ModelSpecError, match="no file or folder"):
        load_workload(f"hf:{tmp_path}/missing/config.json")
    with pytest.raises(ModelSpecError, match="no file or folder"):
        load_workload(f"hf:{tmp_path}/llama-3.1-8b")  # not the shipped config, silently
    with pytest.raises(ModelSpecError, match="has no config.json"):
        load_workload(f"hf:{tmp_path}")
    assert load_workload("hf:meta-llama/Llama-3.1-8B").name == "hf:llama-3.1-8b"  # a hub id


# (file contents, line the message must name, words it must contain); the model is
# tmp_path/<name>.py:workload, or an hf: config for the .json cases.
BAD_SPECS = {
    "syntax": ("import torch\n\ndef workload(:\n    pass\n", 3, "SyntaxError"),
    "failing_import": ("import torch\nimport not_a_module_batchfit\n", 2, "No module named 'not_a_module_batchfit'"),
    "required_argument": ("\n\ndef workload(config):\n    pass\n", 3, "give 'config' a default"),
    "raises": ("import torch\n\ndef helper():\n    raise ValueError('no data in /x\\nsecond line')\n\n"
               "def workload():\n    return helper()\n", 4, "ValueError: no data in /x"),
    "raises_in_torch": ("import torch\n\ndef workload():\n    return torch.zeros(2) @ torch.zeros(3)\n",
                        4, "RuntimeError"),
    "not_json.json": ('{"model_type": "llama",\n "hidden_size": 64\n "vocab_size": 512}\n', 3, "not valid JSON"),
    "unknown_type.json": ('{"model_type": "foo"}', None,
                          "model_type 'foo' in {path} is not a transformers model type: "
                          "e.g. llama, gpt2, qwen2, mistral, bert"),
}


@pytest.mark.parametrize("name", BAD_SPECS)
def test_a_bad_model_spec_is_one_line_naming_the_place(tmp_path, name):
    from typer.testing import CliRunner

    from batchfit.cli.app import app

    text, line, words = BAD_SPECS[name]
    path = tmp_path / (name if name.endswith(".json") else f"{name}.py")
    path.write_text(text)
    spec = f"hf:{path}" if name.endswith(".json") else f"{path}:workload"
    result = CliRunner().invoke(app, ["estimate", spec, "--gpu", "t4-16gb"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) <= 3 and "Traceback" not in result.output, result.output
    assert words.format(path=path) in lines[0]
    if line is not None:
        assert f"{path}:{line}:" in lines[0]
