"""fit_training_args: the Hugging Face Trainer with the per-device batch and accumulation from a trace.

    python examples/hf_trainer.py

Runs on the CPU in seconds (the Trainer needs the accelerate package). The model is a
2-layer GPT-2 built from its config, so nothing is downloaded; use your own model the same
way. Without a GPU it sizes for the GPU you name (a small one here, so the global batch of 64
needs accumulation: name yours, e.g. gpu="h100-80gb").
"""

from __future__ import annotations

import logging
import tempfile

import torch
import transformers

import batchfit.transformers

SEQ_LEN = 32


def main(output_dir: str | None = None) -> tuple[transformers.TrainingArguments, transformers.Trainer]:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=4096, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    args = transformers.TrainingArguments(output_dir=output_dir or tempfile.mkdtemp(prefix="batchfit-hf-"),
                                          report_to=[], use_cpu=True, max_steps=2, save_strategy="no",
                                          learning_rate=1e-3, disable_tqdm=True)
    fit = batchfit.transformers.fit_training(model, args, global_batch=64, seq_len=SEQ_LEN, gpu_memory="700MiB")
    ids = torch.randint(0, config.vocab_size, (256, SEQ_LEN))
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    trainer = transformers.Trainer(model=model, args=fit.args, train_dataset=dataset,
                                   callbacks=[fit.callback(after_steps=1)])
    trainer.train()
    print(f"trained {trainer.state.global_step} steps of {fit.args.per_device_train_batch_size} x "
          f"{fit.args.gradient_accumulation_steps} samples")
    return fit.args, trainer


if __name__ == "__main__":
    main()
