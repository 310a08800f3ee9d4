"""QLoRA built by hand, the way QLoRA scripts write it: the base's linear layers become
bitsandbytes ``Linear4bit`` with ``Params4bit`` weights, PEFT's LoRA goes on top, and the
optimizer is bitsandbytes' 8-bit AdamW.

    batchfit estimate examples/qlora_by_hand.py:workload --gpu rtx4090-24gb

The weights are quantized where the model is moved to its device (``Params4bit.to``), as
``model.to("cuda")`` quantizes them; batchfit moves the model, so ``build`` leaves it where it
was built. The model is a 2-layer Llama built from its config (nothing is downloaded), so the
estimate runs on a CPU in seconds; put your own model in ``build``. batchfit's own
``--quantize nf4 --lora r=16 --optimizer adamw-8bit`` builds the same step from a plain model.
"""

from __future__ import annotations

import bitsandbytes as bnb
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from batchfit import Workload

VOCAB, SEQ_LEN = 512, 64
DOUBLE_QUANT = False
"""BitsAndBytesConfig's bnb_4bit_use_double_quant (batchfit's nf4-dq)."""


def build() -> nn.Module:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ_LEN,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    for name, linear in list(model.named_modules()):
        if type(linear) is not nn.Linear or name == "lm_head":  # the head stays in full precision
            continue
        layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, linear.bias is not None,
                                  compute_dtype=torch.float32, compress_statistics=DOUBLE_QUANT, quant_type="nf4")
        layer.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False,
                                         compress_statistics=DOUBLE_QUANT, quant_type="nf4")
        model.set_submodule(name, layer)
    model.is_loaded_in_4bit = True  # what from_pretrained sets: PEFT then wraps Linear4bit in its bnb layer
    model.requires_grad_(False)
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))


def workload() -> Workload:
    return Workload(name="qlora-by-hand", build_model=build,
                    make_batch=lambda b, device: torch.randint(0, VOCAB, (b, SEQ_LEN), device=device),
                    loss_fn=lambda model, ids: model(input_ids=ids, labels=ids).loss, tokens_per_sample=SEQ_LEN,
                    build_optimizer=lambda params: bnb.optim.AdamW8bit(params, lr=1e-4))
