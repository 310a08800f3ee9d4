"""The Hugging Face path: a tiny GPT-2 built from its config (no download), sized for a tiny GPU.

700 MiB leaves 188 MiB usable after the 512 MiB CUDA context, 64 MiB of it cuBLAS workspace:
this model's traced micro-batch (seq 32, vocab 4096: the logits dominate) is below the global
batch, so the Trainer must accumulate. The real ``transformers.Trainer`` also needs ``accelerate``.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

from batchfit.integrations.transformers import PeakCheck, fit_training, fit_training_args  # noqa: E402

GLOBAL_BATCH, SEQ = 64, 32
GPU = "700MiB"


def tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=4096, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


@dataclasses.dataclass
class Args:
    """The fields of TrainingArguments that fit_training reads (TrainingArguments itself needs accelerate)."""

    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    bf16: bool = False
    fp16: bool = False
    gradient_checkpointing: bool = False
    optim: str = "adamw_torch"
    world_size: int = 1


def test_the_trace_runs_as_the_trainer_will_and_the_product_is_the_global_batch(caplog):
    model = tiny_gpt2()
    before = [p.detach().clone() for p in model.parameters()]
    args = Args(bf16=True, gradient_checkpointing=True, world_size=2)
    with caplog.at_level(logging.INFO, logger="batchfit"):
        # limit="allocated": what the tensors hold (batchfit estimate --limit allocated), 3 traces
        # here; the default, reserved, replays each size through the allocator model (11 traces, 40 s)
        fit = fit_training(model, args, global_batch=2 * GLOBAL_BATCH, seq_len=SEQ, gpu_memory="620MiB",
                           limit="allocated")
    traced = fit.plan.sizing.result
    assert (traced.options.precision, traced.options.checkpointing) == ("bf16-mixed", "full")
    assert traced.tokens_per_sample == SEQ and traced.device.total_bytes == 620 * 2**20
    micro, accumulation = fit.args.per_device_train_batch_size, fit.args.gradient_accumulation_steps
    assert micro * accumulation * args.world_size == 2 * GLOBAL_BATCH and accumulation > 1
    assert traced.limit == "allocated"
    assert micro <= traced.max_batch_size_at_target and fit.traced_peak_bytes <= traced.capacity_bytes
    assert f"per_device_train_batch_size={micro}, gradient_accumulation_steps={accumulation}" in caplog.text
    assert args.per_device_train_batch_size == 8  # the caller's arguments are not changed
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # traced on a copy


def test_fit_training_args_then_the_trainer_trains_with_those_numbers(tmp_path, caplog):
    pytest.importorskip("accelerate")
    model = tiny_gpt2()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=2,
                                          save_strategy="no", logging_strategy="no", disable_tqdm=True,
                                          per_device_train_batch_size=1, learning_rate=1e-3)
    with caplog.at_level(logging.INFO, logger="batchfit"):
        fit = fit_training(model, args, global_batch=GLOBAL_BATCH, seq_len=SEQ, gpu_memory=GPU)
    fitted = fit.args
    micro, accumulation = fitted.per_device_train_batch_size, fitted.gradient_accumulation_steps
    assert micro * accumulation * fitted.world_size == GLOBAL_BATCH and accumulation > 1
    assert "traced with AdamW" not in caplog.text  # the Trainer's own optimizer (adamw_torch) was traced
    seen: list[int] = []
    model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape[0]),
                                    with_kwargs=True)
    ids = torch.randint(0, model.config.vocab_size, (4 * GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    check = fit.callback(after_steps=1)
    assert isinstance(check, PeakCheck)
    trainer = transformers.Trainer(model=model, args=fitted, train_dataset=dataset, callbacks=[check])
    trainer.train()
    assert trainer.state.global_step == 2
    assert seen == [micro] * (2 * accumulation)  # each optimizer step: accumulation micro-batches of micro
    if not torch.cuda.is_available():
        assert check.observed_peak_bytes is None
    # fit_training_args is the same decision, arguments only
    again = fit_training_args(tiny_gpt2(), args, global_batch=GLOBAL_BATCH, seq_len=SEQ, gpu_memory=GPU)
    assert (again.per_device_train_batch_size, again.gradient_accumulation_steps) == (micro, accumulation)


def test_the_hf_example_runs(tmp_path):
    pytest.importorskip("accelerate")
    from test_elastic import load_example

    args, trainer = load_example("hf_trainer").main(str(tmp_path))
    assert trainer.state.global_step == 2
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size == 64
