"""The Hugging Face path: a tiny GPT-2 built from its config (no download), sized for a tiny GPU.

700 MiB leaves 188 MiB usable after the 512 MiB CUDA context, 64 MiB of it cuBLAS workspace:
this model's traced micro-batch (seq 32, vocab 4096: the logits dominate) is below the global
batch, so the Trainer must accumulate. The real ``transformers.Trainer`` also needs ``accelerate``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
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
    # what Trainer.get_optimizer_cls_and_kwargs reads to build args.optim's optimizer
    learning_rate: float = 5e-5
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    optim_args: str | None = None


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
    # the Trainer's own optimizer was traced: optim adamw_torch_fused, AdamW(fused=True), two fp32
    # states per parameter and, fused, each parameter's step counter on the GPU (28 tensors:
    # wte, wpe, 12 per block, ln_f's 2), 4 bytes in a 512-byte block each
    assert fitted.optim == "adamw_torch_fused"
    assert fit.plan.sizing.result.points[0].breakdown["optimizer_state"] == 2 * _param_bytes(model) + 28 * 512
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
    from tiny import load_example

    args, trainer = load_example("hf_trainer").main(str(tmp_path))
    assert trainer.state.global_step == 2
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size == 64


def _param_bytes(model) -> int:
    """Each parameter once (GPT-2 ties its head to the embedding), fp32, in 512-byte blocks."""
    return sum(-(-p.numel() * 4 // 512) * 512 for p in {id(p): p for p in model.parameters()}.values())


def test_the_trainers_own_optimizer_is_traced_not_adamw():
    """SGD with momentum, as given to Trainer(optimizers=...): one fp32 momentum buffer per
    parameter, where AdamW would hold two."""
    model = tiny_gpt2()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    fit = fit_training(model, Args(), global_batch=GLOBAL_BATCH, seq_len=SEQ, gpu_memory="620MiB",
                       limit="allocated", optimizer=sgd)
    point = fit.plan.sizing.result.points[0]
    # wte 262,144 + wpe 4,096 + 2 blocks x 16,384 (12 tensors, the small ones in one 512-byte block) + ln_f 1,024
    assert point.breakdown["optimizer_state"] == _param_bytes(model) == 300_032


@pytest.mark.parametrize("args,named", [
    (Args(optim="adamw_bnb_8bit"), "optim='adamw_bnb_8bit' cannot be built here"),  # bitsandbytes: not here
    (object(), "object has no 'optim'"),
])
def test_an_optimizer_that_cannot_be_read_is_an_error_naming_it(args, named):
    if named.startswith("optim='adamw_bnb") and importlib.util.find_spec("bitsandbytes"):
        pytest.skip("bitsandbytes is installed here: the Trainer's optimizer can be built")
    from batchfit.errors import OptionError

    with pytest.raises(OptionError, match=named.replace("(", r"\(")) as error:
        fit_training(tiny_gpt2(), args, global_batch=GLOBAL_BATCH, seq_len=SEQ, gpu_memory="620MiB",
                     limit="allocated")
    assert "optimizer=" in str(error.value) and "\n" not in str(error.value)
