"""``--trainer args.json``: a Hugging Face TrainingArguments (built with the real class and saved
with ``to_json_string()``) traces the same step as the equivalent batchfit flags, byte for byte,
and every field it does not use is listed; ``--emit trainer:FILE`` changes two fields only.

The equivalent flags are written out by hand below (not taken from the mapping), so each case
pins the mapping too. A 2-layer Llama of hidden 32 on 16 tokens, --limit allocated and
--max-batch 8 keep each estimate to a few traces.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # TrainingArguments needs it

from batchfit.cli.app import app  # noqa: E402
from batchfit.errors import OptionError  # noqa: E402
from batchfit.integrations.trainer_args import from_training_arguments  # noqa: E402
from batchfit.integrations.trainer_files import load_trainer_args, patched_args_text  # noqa: E402

runner = CliRunner()
COMMON = ["--gpu-memory", "1GiB", "--limit", "allocated"]


@pytest.fixture(scope="module")
def model_spec(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("llama")
    transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=128, max_position_embeddings=64).save_pretrained(folder)
    return f"hf:{folder}"


def training_args(tmp_path, **fields) -> str:
    """The JSON the user has: TrainingArguments(...).to_json_string(), plus TRL's fields if given."""
    trl = {k: fields.pop(k) for k in ("max_length", "packing") if k in fields}
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "run"), report_to=[], use_cpu=True, **fields)
    data = json.loads(args.to_json_string())
    data.update(trl)  # what SFTConfig(...).to_json_string() adds (TRL need not be installed)
    path = tmp_path / "args.json"
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return str(path)


CASES = [  # (TrainingArguments fields, the batchfit flags that mean the same step; weight_decay 0 by default)
    (dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, bf16=True, gradient_checkpointing=True),
     ["--precision", "bf16-mixed", "--checkpointing", "full", "--optimizer", "adamw", "--param-groups", "decay:0",
      "--accumulation-steps", "2", "--batch-sizes", "4", "--seq-len", "16"]),
    (dict(per_device_train_batch_size=2, fp16=True, optim="adafactor"),
     ["--precision", "fp16-mixed", "--optimizer", "adafactor", "--param-groups", "decay:0", "--batch-sizes", "2",
      "--seq-len", "16"]),
    (dict(per_device_train_batch_size=3, optim="sgd", weight_decay=0.01, use_liger_kernel=True),
     ["--optimizer", "sgd", "--param-groups", "decay:0.01", "--loss", "fused-linear", "--batch-sizes", "3",
      "--seq-len", "16"]),
    (dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, optim="adamw_torch",
          gradient_checkpointing=True, gradient_checkpointing_kwargs={"every_n_layers": 2, "use_reentrant": False}),
     ["--optimizer", "adamw", "--param-groups", "decay:0", "--checkpointing", "every:2", "--accumulation-steps", "2",
      "--batch-sizes", "2", "--seq-len", "16"]),
    (dict(per_device_train_batch_size=1, gradient_accumulation_steps=3, bf16=True, max_length=24, packing=True),
     ["--precision", "bf16-mixed", "--optimizer", "adamw", "--param-groups", "decay:0", "--accumulation-steps", "3",
      "--batch-sizes", "1", "--seq-len", "24"]),
]


def _estimate(*args: str, max_batch: int) -> dict:
    """--max-batch at the args' own batch: one or two traces per estimate."""
    result = runner.invoke(app, ["estimate", *args, *COMMON, "--max-batch", str(max_batch), "--json", "-"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _comparable(data: dict) -> dict:
    """The estimate minus what names the source or the clock."""
    return {k: v for k, v in data.items() if k not in ("trainer", "created", "trace_seconds")}


@pytest.mark.parametrize("fields, flags", [  # every2 and sft-packing: the slow tier
    case if i < 3 else pytest.param(*case, marks=pytest.mark.slow) for i, case in enumerate(CASES)],
    ids=["bf16-ckpt", "fp16-adafactor", "sgd-liger", "every2", "sft-packing"])
def test_trainer_reproduces_the_equivalent_flags_byte_for_byte(model_spec, tmp_path, monkeypatch, fields, flags):
    monkeypatch.chdir(tmp_path)  # the reports/ folders go here
    path = training_args(tmp_path, **fields)
    seq = [] if "max_length" in fields else ["--seq-len", "16"]
    batch = fields["per_device_train_batch_size"]
    from_file = _estimate(model_spec, "--trainer", path, *seq, max_batch=batch)
    by_hand = _estimate(model_spec, *flags, max_batch=batch)
    assert json.dumps(_comparable(from_file), sort_keys=True) == json.dumps(_comparable(by_hand), sort_keys=True)
    section = from_file["trainer"]
    assert section["source"] == path
    unused = {u["field"]: u for u in section["trainer_fields_unused"]}
    assert unused["learning_rate"]["why"] == "does not change training memory"
    assert "traced at the longest" not in json.dumps(section) or "max_length" in fields
    answer = section["answer"]
    assert answer["per_device_train_batch_size"] * answer["gradient_accumulation_steps"] == (
        fields["per_device_train_batch_size"] * fields.get("gradient_accumulation_steps", 1))


def test_the_mapping_names_every_field_and_the_unsupported_ones():
    args = transformers.TrainingArguments(output_dir="run", report_to=[], optim="galore_adamw", tf32=False,
                                          label_smoothing_factor=0.1, torch_compile=True,
                                          fsdp="full_shard offload")
    data = json.loads(args.to_json_string())
    mapping = from_training_arguments(data)
    accounted = {u.field.split(".")[0] for u in mapping.used + mapping.unused}
    assert accounted == set(data)  # nothing silently ignored
    unused = {u.field: u.why for u in mapping.unused}
    assert "not one batchfit traces" in unused["optim"]
    assert "log-softmax" in unused["label_smoothing_factor"]
    assert mapping.step["compile"] == "model"
    assert mapping.strategy == "fsdp"  # full_shard -> plan's FSDP2


def test_deepspeed_stages_map_onto_plan_strategies_and_stage3_offload_is_listed(tmp_path):
    for stage, strategy in ((1, "zero1"), (2, "zero2"), (3, "fsdp")):
        config = {"zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"},
                                        "offload_param": {"device": "cpu"}}}
        (tmp_path / "ds.json").write_text(json.dumps(config))
        (tmp_path / "args.json").write_text(json.dumps({"per_device_train_batch_size": 2, "deepspeed": "ds.json"}))
        mapping = from_training_arguments(load_trainer_args(str(tmp_path / "args.json")).data,
                                          deepspeed_config=config)
        lines = [u.line() for u in mapping.used + mapping.unused]
        ds = next(line for line in lines if line.startswith(("deepspeed=", "not used: deepspeed=")))
        assert strategy in ds  # mapped, or named as not (yet) supported
        assert any("offload_optimizer" in line for line in lines)  # used as --offload, or listed


def test_bad_args_files_are_one_line_errors(model_spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({"per_device_train_batchsize": 4, "bf16": True}))
    not_json = tmp_path / "args.json"
    not_json.write_text("per_device_train_batch_size: 4\n")
    both = tmp_path / "both.json"
    both.write_text(json.dumps({"bf16": True, "fp16": True}))
    for path, words in ((typo, "did you mean 'per_device_train_batch_size'"), (not_json, "is not JSON"),
                        (tmp_path / "none.json", "no such file"), (both, "both bf16 and fp16")):
        result = runner.invoke(app, ["estimate", model_spec, "--gpu-memory", "1GiB", "--trainer", str(path)])
        assert result.exit_code == 2, result.output
        assert words in result.output and "Traceback" not in result.output
    result = runner.invoke(app, ["estimate", model_spec, "--gpu-memory", "1GiB", "--trainer", str(typo.with_name(
        "none.json")), "--emit", "args.out.json"])
    assert "trainer:FILE" in result.output or "no such file" in result.output
    # a flag that contradicts the args: which one wins would be a guess
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"bf16": True}))
    result = runner.invoke(app, ["estimate", model_spec, "--gpu-memory", "1GiB", "--trainer", str(good),
                                 "--precision", "fp16-mixed"])
    assert result.exit_code == 2 and "contradicts" in result.output


def test_emit_changes_the_two_fields_and_keeps_every_other_byte(tmp_path):
    path = training_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    args = load_trainer_args(path)
    text = patched_args_text(args, 8, 1)
    before, after = args.text.splitlines(), text.splitlines()
    changed = [(a, b) for a, b in zip(before, after) if a != b]
    assert len(before) == len(after) and changed == [('  "gradient_accumulation_steps": 2,',
                                                      '  "gradient_accumulation_steps": 1,'),
                                                     ('  "per_device_train_batch_size": 4,',
                                                      '  "per_device_train_batch_size": 8,')]


def test_a_python_file_that_builds_the_args_with_peft_and_quantization(tmp_path):
    (tmp_path / "args.py").write_text(
        "from transformers import TrainingArguments\n"
        "def args():\n"
        "    return TrainingArguments(output_dir='run', report_to=[], per_device_train_batch_size=2, fp16=True,\n"
        "                             use_cpu=True)\n"
        "peft_config = {'peft_type': 'LORA', 'r': 16, 'target_modules': ['q_proj', 'v_proj'], 'lora_dropout': 0.0}\n"
        "quantization_config = {'load_in_4bit': True, 'bnb_4bit_quant_type': 'nf4',\n"
        "                       'bnb_4bit_use_double_quant': True, 'bnb_4bit_compute_dtype': 'bfloat16'}\n")
    args = load_trainer_args(str(tmp_path / "args.py"))
    mapping = from_training_arguments(args.data)
    assert mapping.step["precision"] == "fp16-mixed" and mapping.per_device_train_batch_size == 2
    lines = " ".join(u.line() for u in mapping.used + mapping.unused)
    # --lora / --quantize are used where this batchfit has them, else listed as not (yet) supported
    assert "--lora r=16,targets=q_proj+v_proj" in lines or "no --lora option" in lines
    assert "--quantize nf4-dq" in lines or "no --quantize option" in lines
    with pytest.raises(OptionError, match="has no 'build'"):
        load_trainer_args(str(tmp_path / "args.py") + ":build")


def test_a_trainer_started_estimate_takes_the_same_mapping(monkeypatch, caplog):
    """Item 4: fit_training (HF) and BatchFit (Lightning) build their StepOptions with the mapping
    --trainer uses: Liger and every-N checkpointing come through, and what is not used is logged."""
    import logging

    import batchfit.integrations.transformers as hf

    seen = {}

    def plan_global_batch(workload, *, options, **kwargs):  # capture, do not trace
        seen["options"], seen["seq"] = options, workload.tokens_per_sample
        raise RuntimeError("captured")

    monkeypatch.setattr(hf, "plan_global_batch", plan_global_batch)
    args = transformers.TrainingArguments(output_dir="run", report_to=[], use_cpu=True, use_liger_kernel=True,
                                          gradient_checkpointing=True, label_smoothing_factor=0.1,
                                          gradient_checkpointing_kwargs={"every_n_layers": 2})
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=128))
    with caplog.at_level(logging.INFO, logger="batchfit"), pytest.raises(RuntimeError, match="captured"):
        hf.fit_training(model, args, global_batch=8, seq_len=16)
    assert (seen["options"].loss, seen["options"].checkpointing, seen["seq"]) == ("fused-linear", "every:2", 16)
    assert "not used: label_smoothing_factor=0.1" in caplog.text

    lightning = pytest.importorskip("lightning.pytorch")
    from batchfit.integrations.lightning import trainer_options

    trainer = lightning.Trainer(precision="bf16-mixed", accumulate_grad_batches=4, gradient_clip_val=1.0,
                                logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                accelerator="cpu")
    with caplog.at_level(logging.INFO, logger="batchfit"):
        options = trainer_options(trainer)
    assert options.precision == "bf16-mixed" and options.accumulation_steps == 1  # BatchFit picks accumulation
    assert "not used: max_grad_norm=1.0" in caplog.text


def test_sft_model_init_kwargs_and_checkpointing_aliases():
    """TRL's model_init_kwargs load the weights in bf16 (pure bf16, not autocast over fp32), and
    transformers 5's deprecated gradient_checkpointing alias is the same setting, not a second one."""
    mapping = from_training_arguments(
        {"bf16": True, "activation_checkpointing": True, "gradient_checkpointing": True,
         "activation_checkpointing_kwargs": {"every_n_layers": 2},
         "gradient_checkpointing_kwargs": {"every_n_layers": 2},
         "model_init_kwargs": {"torch_dtype": "bfloat16", "attn_implementation": "sdpa"}, "max_length": 512},
        check_fields=False)
    assert mapping.step == {"precision": "bf16", "checkpointing": "every:2", "attention": "sdpa",
                            "param_groups": "decay:0"}
    assert mapping.seq_len == 512
    used = {u.field: u for u in mapping.used}
    assert "replaces --precision bf16-mixed" in used["model_init_kwargs.torch_dtype"].why
    assert used["gradient_checkpointing"].why == "the same as activation_checkpointing"
    assert used["model_init_kwargs.attn_implementation"].option == "--attention sdpa"
