"""Hugging Face ``transformers`` models built from their config, with no weights, no network.

``hf:<name>`` uses the config numbers shipped below (copied from each model's public
``config.json``); ``hf:path/to/config.json`` reads a config file, and ``hf:path/to/folder``
the folder's ``config.json`` (a downloaded model). The model is built with
``AutoModelFor*.from_config`` and the attention transformers gives its class: the config's
``attn_implementation``, else PyTorch's SDPA where the class supports it (``_supports_sdpa``),
else eager (Gemma 2); ``--attention`` (``StepOptions.attention``) sets another.
"""

from __future__ import annotations

import contextlib
import difflib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from batchfit.errors import ModelSpecError, OptionError, read_text
from batchfit.workload import HF_ATTENTION, Workload

_LLAMA3 = dict(model_type="llama", vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
               max_position_embeddings=131072, hidden_act="silu", attention_bias=False)

CONFIGS: dict[str, dict] = {
    "gpt2-124m": dict(model_type="gpt2", vocab_size=50257, n_positions=1024, n_embd=768,
                      n_layer=12, n_head=12),
    "llama-3.2-1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         tie_word_embeddings=True),
    "llama-3.2-3b": dict(_LLAMA3, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                         tie_word_embeddings=True),
    "llama-3.1-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         tie_word_embeddings=False),
    "llama-3.1-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                          tie_word_embeddings=False),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584,
                       intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1e6,
                       rms_norm_eps=1e-6, tie_word_embeddings=False),
    "mistral-7b": dict(model_type="mistral", vocab_size=32768, hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, max_position_embeddings=32768, rope_theta=1e6,
                       sliding_window=None, tie_word_embeddings=False),
    "qwen3-moe-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
                              intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                              num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                              num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                              mlp_only_layers=[], max_position_embeddings=40960, rope_theta=1e6,
                              rms_norm_eps=1e-6, tie_word_embeddings=False),
    "mixtral-8x7b": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
                         rope_theta=1e6, rms_norm_eps=1e-5, sliding_window=None, tie_word_embeddings=False),
    "bert-large": dict(model_type="bert", vocab_size=30522, hidden_size=1024, num_hidden_layers=24,
                       num_attention_heads=16, intermediate_size=4096, max_position_embeddings=512,
                       architectures=["BertForMaskedLM"]),
}
ALIASES = {"gpt2": "gpt2-124m", "bert-large-uncased": "bert-large", "llama-3.1-8b-instruct": "llama-3.1-8b",
           "llama-3.1-70b-instruct": "llama-3.1-70b",
           "mistral-7b-v0.3": "mistral-7b", "qwen3-30b-a3b": "qwen3-moe-30b-a3b", "mixtral-8x7b-v0.1": "mixtral-8x7b",
           "qwen2.5-7b-instruct": "qwen2.5-7b"}
DEFAULT_SEQ_LEN = 2048


def _read_config(file: Path) -> dict:
    try:
        config = json.loads(read_text(file, str(file), ModelSpecError))
    except json.JSONDecodeError as error:
        raise ModelSpecError(f"{file}:{error.lineno}: not valid JSON ({error.msg}, column {error.colno}): "
                             "fix the file") from None
    if not isinstance(config, dict):
        raise ModelSpecError(f"{file} holds a JSON {type(config).__name__}, not an object: "
                             "give a transformers config.json")
    return config


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ModelSpecError(
            "hf: models need the transformers package: pip install 'batchfit[hf]'"
        ) from None
    return transformers


@contextlib.contextmanager
def _unpacked_sequences(transformers) -> Iterator[None]:
    """These batches pass no position_ids, so the model numbers positions 0..T-1 itself: no
    sequence is packed. On a GPU transformers reads that from the tensor values and then runs
    SDPA with ``is_causal`` and native GQA; on fake tensors it cannot read values, assumes
    packing, and builds a [B, 1, T, T] mask with K/V repeated per query head, which a GPU run
    never holds. Answer its question as the values would."""
    masking = getattr(getattr(transformers, "masking_utils", None), "find_packed_sequence_indices", None)
    if masking is None:  # a transformers without packed-sequence detection
        yield
        return
    module = transformers.masking_utils
    module.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        module.find_packed_sequence_indices = masking


def hf_workload(target: str, seq_len: int | None = None) -> Workload:
    """A Workload for ``hf:<target>``: a config.json path, a model folder, or a shipped config name.

    A path that exists wins over a shipped name (a folder named ``llama-3.1-8b`` is read, not
    replaced by the shipped Llama 3.1 8B). A hub id such as ``meta-llama/Llama-3.1-8B`` that
    is no local path finds the shipped config by its last segment.
    """
    path = Path(target).expanduser()
    key = ALIASES.get(target.lower().split("/")[-1], target.lower().split("/")[-1])
    if path.exists():
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise ModelSpecError(f"the folder '{target}' has no config.json: give a model folder that has one, "
                                 "or the path of a config.json")
        config_dict, name = _read_config(file), f"hf:{file}"
    elif path.suffix == ".json" or target.startswith(("/", ".", "~")):
        raise ModelSpecError(f"no file or folder '{target}': give the path of a config.json or of a model "
                             f"folder holding one, or a shipped name ({', '.join(sorted(CONFIGS))})")
    elif key in CONFIGS:
        config_dict, name = dict(CONFIGS[key]), f"hf:{key}"
    else:
        raise ModelSpecError(
            f"unknown hf model '{target}': use one of {', '.join(sorted(CONFIGS))}, "
            "or hf:path/to/config.json"
        )
    transformers = _transformers()
    model_type = config_dict.pop("model_type", None)
    if model_type is None:
        raise ModelSpecError(f"{name} has no model_type: it is not a transformers config.json")
    if not isinstance(model_type, str) or model_type not in transformers.CONFIG_MAPPING:
        # transformers' own error lists every model type it knows (hundreds): name a few.
        close = difflib.get_close_matches(str(model_type), list(transformers.CONFIG_MAPPING.keys()), n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise ModelSpecError(
            f"model_type '{model_type}' in {name[3:]} is not a transformers model type: {hint}"
            f"e.g. llama, gpt2, qwen2, mistral, bert (a transformers newer than {transformers.__version__} "
            "may know it)"
        )
    # MoE layers: HF's expert loop (the "eager" experts implementation, which runs anywhere: on
    # fake tensors its routing is answered by --routing, trace/routing.py) unless the config
    # names another ("experts_implementation": "grouped_mm", which needs bf16 weights).
    _check_sizes(config_dict, name)
    moe = any(k in config_dict for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    experts = config_dict.pop("experts_implementation", "eager") if moe else None
    try:
        config = transformers.AutoConfig.for_model(model_type, **config_dict)
    except Exception as error:  # a value transformers rejects: say which config, in one line
        first = (str(error).strip().splitlines() or [""])[0]
        raise ModelSpecError(f"transformers rejects the config {name[3:]}: {type(error).__name__}: {first}: "
                             "fix the config") from error
    config.use_cache = False
    masked = any("MaskedLM" in a for a in (getattr(config, "architectures", None) or []))
    seq2seq = bool(getattr(config, "is_encoder_decoder", False))  # T5, BART: the labels feed the decoder
    auto = (transformers.AutoModelForMaskedLM if masked else transformers.AutoModelForSeq2SeqLM if seq2seq
            else transformers.AutoModelForCausalLM)
    attention = _attention(config, auto, name)
    if attention == "flash":  # set by the step (train/attention.py: flash_attn on a GPU, its saves when traced)
        config._attn_implementation_internal = None
    max_len = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    seq = seq_len or min(max_len or DEFAULT_SEQ_LEN, DEFAULT_SEQ_LEN)
    if max_len and seq > max_len:
        raise ModelSpecError(f"`seq_len` {seq} is longer than {name} allows ({max_len})")

    def build_model() -> nn.Module:
        more = {"experts_implementation": experts} if experts else {}
        model = auto.from_config(config, attn_implementation=HF_ATTENTION[attention] if attention != "flash" else None,
                                 **more)
        if not masked and not seq2seq:  # GPT-2's class name does not tell transformers which loss it uses
            model.loss_type = "ForCausalLM"
        return model

    def make_batch(batch_size: int, device: torch.device) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, config.vocab_size, (batch_size, seq), device=device)
        return {"input_ids": ids, "labels": ids}

    def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with _unpacked_sequences(transformers):
            return model(**batch).loss

    def lm_parts(model: nn.Module, batch: dict[str, torch.Tensor]):
        """(the decoder's last hidden states, the lm_head weight, the labels shifted left with -100
        at the end): what ``model(**batch).loss`` computes from (transformers' ForCausalLMLoss)."""
        plain = getattr(model, "module", model)  # DDP's wrapper runs; the head is the model's
        head = plain.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise OptionError(f"`loss` chunked:N / fused-linear needs a bias-free lm_head; {name}'s has a bias: "
                              "use `loss` plain")
        # The whole model runs with the head passing its input through (its matmul skipped): the
        # root's forward is what DDP and FSDP2 hook (FSDP2 gathers the embedding and head there).
        head.forward = lambda x: x
        try:
            with _unpacked_sequences(transformers):
                hidden = model(input_ids=batch["input_ids"]).logits
        finally:
            del head.forward
        labels = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
        return hidden, head.weight, labels

    # A masked LM's loss is not next-token; a softcapped or biased head is not hidden @ weight.T.
    head_is_plain = (not masked and not seq2seq and getattr(config, "final_logit_softcapping", None) is None
                     and getattr(config, "logit_scale", None) is None)
    kind = ("masked LM" if masked else "encoder-decoder LM (the labels are the decoder's sequence)" if seq2seq
            else "causal LM")
    return Workload(name=name, build_model=build_model, make_batch=make_batch, loss_fn=loss_fn,
                    tokens_per_sample=seq, description=f"transformers {model_type} {kind}, seq {seq}",
                    lm_parts=lm_parts if head_is_plain else None, attention=attention)


SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
         "head_dim", "vocab_size", "max_position_embeddings", "n_embd", "n_layer", "n_head", "n_positions",
         "d_model", "d_ff", "d_kv", "num_layers", "num_heads")
"""The sizes of a transformers config (its own names, GPT-2's and T5's): each counts something, 1 or more
(not the MoE counts: some dense configs write num_experts 0)."""


def _check_sizes(config_dict: dict, name: str) -> None:
    """Refuse a size below 1 as the bad input it is (exit 2), naming the key: transformers takes
    ``hidden_size: 0`` and the model build fails deep inside (0.0 raised to a negative power)."""
    for key in SIZES:
        value = config_dict.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 1:
            raise ModelSpecError(f"{key} is {value} in {name[3:]}: a size must be 1 or more; fix the config")


def _attention(config, auto, name: str) -> str:
    """The attention implementation the model is built with, in --attention's words: the config's
    (``attn_implementation`` in config.json), else what transformers picks for the class: SDPA
    where ``_supports_sdpa``, else eager (``PreTrainedModel.get_correct_attn_implementation``)."""
    named = config._attn_implementation_internal
    model_class = auto._model_mapping.get(type(config), None)
    supports = {"eager": True, "sdpa": getattr(model_class, "_supports_sdpa", True),
                "flash": getattr(model_class, "_supports_flash_attn", True)}
    if named is None:
        return "sdpa" if supports["sdpa"] else "eager"
    ours = next((key for key, value in HF_ATTENTION.items() if value == named), None)
    if ours is None or not supports[ours]:
        names = [HF_ATTENTION[k] for k, ok in supports.items() if ok]
        can = f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]
        why = "which batchfit does not trace" if ours is None else f"which {model_class.__name__} does not support"
        raise ModelSpecError(f"{name[3:]} names attn_implementation '{named}', {why}: set it to {can} in the config")
    return ours
