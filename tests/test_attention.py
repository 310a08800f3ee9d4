"""--attention: each transformers family gets the attention it supports, the user's choice is
applied or refused in one line, and the one used is named in every output (train/attention.py).

Checked against torch's own code running for real (the profiler on a CPU step, for a family built eager);
the rest checks batchfit's own choice and wording."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from batchfit.errors import OptionError
from batchfit.workload import StepOptions, Workload

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, vocab_size=64, max_position_embeddings=128)


def _config(tmp_path, model_type: str, **more) -> str:
    path = tmp_path / f"{model_type}.json"
    path.write_text(json.dumps(dict(TINY, model_type=model_type, **more)))
    return f"hf:{path}"


def test_a_family_without_sdpa_is_built_eager_and_traced_as_the_profiler_measures_it(tmp_path):
    """Gemma 2 has no SDPA path (``_supports_sdpa`` False): built with SDPA it failed to build; built eager
    it holds its [B, H, T, T] scores (softcapped: tanh and softmax each T x T too), which the trace
    counts as a real CPU step does, within 1%."""
    from batchfit.specs import load_workload
    from batchfit.trace.session import TraceSession
    from batchfit.train.step import TrainingStep
    from cpu_truth import profiled_step_peak, same_kernels_on_any_x86

    work = load_workload(_config(tmp_path, "gemma2"), seq_len=64)
    assert work.attention == "eager"
    traced = TraceSession(work, StepOptions(), cuda_semantics=False).trace(4).snapshot.peak_bytes
    with same_kernels_on_any_x86():
        measured = profiled_step_peak(TrainingStep(work, StepOptions(), torch.device("cpu")), 4, tmp_path)
    # -144 B today (3,116,588 traced, 3,116,732 measured)
    assert abs(traced - measured) / measured < 0.01, (traced, measured)
    scores = 4 * 4 * 64 * 64 * 4  # one layer's [B, H, T, T] fp32 scores: 262,144 B
    assert traced > 2 * scores


def test_eager_holds_the_scores_that_sdpa_does_not(tmp_path):
    """--attention eager on a Llama (which builds with SDPA) traces the T x T scores that the fused
    kernels never hold: at T = 128 they outweigh everything else of this tiny model. (No grouped-query
    attention: in fp32 CUDA runs a GQA call on the math path, which holds the scores too.)"""
    from batchfit.specs import load_workload
    from batchfit.trace.session import TraceSession

    work = load_workload(_config(tmp_path, "llama", num_key_value_heads=4), seq_len=128)
    assert work.attention == "sdpa"
    sdpa = TraceSession(work, StepOptions()).trace(4).snapshot.peak_bytes
    eager = TraceSession(work, StepOptions(attention="eager")).trace(4).snapshot.peak_bytes
    scores = 4 * 4 * 128 * 128 * 4  # [B, H, T, T] fp32, one layer: 1 MiB
    assert eager - sdpa > 2 * scores, (sdpa, eager)


def test_the_config_names_the_attention(tmp_path):
    from batchfit.errors import ModelSpecError
    from batchfit.specs import load_workload

    assert load_workload(_config(tmp_path, "llama", attn_implementation="eager")).attention == "eager"
    assert load_workload(_config(tmp_path, "llama", _attn_implementation="eager")).attention == "eager"
    flash = load_workload(_config(tmp_path, "llama", attn_implementation="flash_attention_2"))
    assert flash.attention == "flash" and flash.build_model().config._attn_implementation == "sdpa"
    with pytest.raises(ModelSpecError, match="set it to eager, sdpa or flash_attention_2"):
        load_workload(_config(tmp_path, "llama", attn_implementation="flex_attention"))
    with pytest.raises(ModelSpecError,
                       match="Gemma2ForCausalLM does not support: set it to eager or flash_attention_2"):
        load_workload(_config(tmp_path, "gemma2", attn_implementation="sdpa"))


def test_an_unsupported_attention_is_refused_in_one_line(tmp_path):
    from batchfit.specs import load_workload
    from batchfit.trace.session import TraceSession
    from batchfit.train.step import TrainingStep

    gemma = load_workload(_config(tmp_path, "gemma2"), seq_len=16)
    with pytest.raises(OptionError, match="use `attention` eager or flash for Gemma2ForCausalLM") as error:
        TraceSession(gemma, StepOptions(attention="sdpa"))
    assert "\n" not in str(error.value)
    with pytest.raises(OptionError, match="fp16 / bf16 only.*`precision` bf16-mixed"):
        TraceSession(gemma, StepOptions(attention="flash"))  # fp32: flash_attn refuses it on a GPU too
    with pytest.raises(OptionError, match="a cpu step cannot"):
        TrainingStep(gemma, StepOptions(attention="flash", precision="bf16-mixed"), torch.device("cpu"))
    with pytest.raises(OptionError, match="unknown attention 'fast'"):
        StepOptions(attention="fast")
    own = Workload(name="linear", build_model=lambda: torch.nn.Linear(4, 4), make_batch=lambda b, d: torch.ones(b, 4),
                   loss_fn=lambda model, batch: model(batch).sum())
    with pytest.raises(OptionError, match="Linear is not one.*drop `attention`"):
        TraceSession(own, StepOptions(attention="eager"))


def test_flash_is_traced_as_flash_attention_2_saves_and_said(tmp_path):
    """--attention flash on fake tensors: transformers' flash path with PyTorch's copy of the
    FlashAttention-2 kernel (train/attention.py). A bf16 Llama's SDPA call, which the CUDA mirror
    sends to the same kernel (no mask, bf16: trace/cuda_attention.py), holds the same bytes; Gemma 2
    (softcapped, no SDPA path) holds none of eager's T x T scores; every output says it is approximated."""
    from batchfit import estimate, get_device
    from batchfit.specs import load_workload
    from batchfit.trace.session import TraceSession

    bf16 = dict(precision="bf16-mixed")
    llama = load_workload(_config(tmp_path, "llama"), seq_len=128)
    flash = TraceSession(llama, StepOptions(attention="flash", **bf16)).trace(4).snapshot.peak_bytes
    assert flash == TraceSession(llama, StepOptions(**bf16)).trace(4).snapshot.peak_bytes
    gemma = load_workload(_config(tmp_path, "gemma2"), seq_len=128)
    eager = TraceSession(gemma, StepOptions(**bf16)).trace(4).snapshot.peak_bytes
    flash = TraceSession(gemma, StepOptions(attention="flash", **bf16)).trace(4).snapshot.peak_bytes
    scores = 4 * 4 * 128 * 128 * 2  # one layer's [B, H, T, T] bf16 scores
    assert eager - flash > 2 * scores, (eager, flash)
    short = load_workload(_config(tmp_path, "gemma2"), seq_len=16)
    said = estimate(short, device=get_device("t4-16gb"), options=StepOptions(attention="flash", **bf16),
                    batch_sizes=[2], suggest=False, limit="allocated", max_batch=2)
    assert said.options.attention == "flash"
    assert [a for a in said.approximations if "FlashAttention-2" in a.what]


def test_the_attention_used_is_named_in_every_output(tmp_path):
    from batchfit.cli.app import app

    spec = _config(tmp_path, "gemma2")
    result = CliRunner().invoke(app, ["estimate", spec, "--gpu", "t4-16gb", "--seq-len", "16", "--batch-sizes", "2",
                                      "--max-batch", "2", "--limit", "allocated", "--json", str(tmp_path / "e.json"),
                                      "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    assert "attention: eager" in result.output
    assert json.loads((tmp_path / "e.json").read_text())["options"]["attention"] == "eager"
    assert "| Attention | eager" in (tmp_path / "r" / "report.md").read_text()


def test_the_trainer_args_name_the_attention_and_a_flag_may_not_contradict_them(tmp_path):
    from batchfit.cli.app import app
    from batchfit.integrations.trainer_args import from_training_arguments

    args = {"per_device_train_batch_size": 2, "model_init_kwargs": {"attn_implementation": "eager"}}
    assert from_training_arguments(args, check_fields=False).step == {"attention": "eager", "param_groups": "decay:0"}
    path = tmp_path / "args.json"
    path.write_text(json.dumps(args))
    result = CliRunner().invoke(app, ["estimate", _config(tmp_path, "llama"), "--gpu", "t4-16gb", "--seq-len", "16",
                                      "--trainer", str(path), "--attention", "sdpa", "--out", str(tmp_path / "r")])
    assert result.exit_code == 2, result.output
    assert "--attention sdpa contradicts --trainer" in result.output
