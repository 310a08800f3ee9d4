"""Tiny workloads and helpers that more than one test module holds its truths with (none is a
test). Each says where its figures come from; a test module imports them from here, never from
another test module.

- the tiny Llama of the sharded truths (tests/test_plan_trace.py and the gloo runs beside it):
  its config, parameter counts by hand, its traced rank 0 and rank 0's profiled peak;
- the ten-block Llama the depth extrapolation is checked on (tests/test_plan_deep.py, test_plan_reserved.py);
- the tiny Qwen3-MoE with a forced router (tests/test_routing.py, tests/test_expert_parallel.py);
- an example script loaded as a module (tests/test_elastic.py, test_hf_trainer.py, test_lightning.py);
- the sweep's tiny GPT written as a model file, and a corpus written on the spot (the sweep,
  recommend and noise tests): the zoo's Transformer at 2 layers, d_model 32 (about 40k
  parameters), a byte-sized vocabulary so the ``bytes`` tokenizer fits it; a step takes
  milliseconds on one CPU thread. The corpus comes from a small grammar, so it has something to learn.
"""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import torch

from batchfit.devices import get_device
from batchfit.train.step import TrainingStep
from batchfit.workload import StepOptions, Workload
from batchfit.zoo.transformer import TransformerConfig
from cpu_truth import tiny_llama_workload

# --- the tiny Llama of the sharded truths ----------------------------------------------------------
# Llama blocks (RMSNorm, SwiGLU, RoPE, GQA), untied head: every parameter's first dimension
# divides by 4, so FSDP shards are exact (no padding) on 2 and 4 ranks.
CFG = TransformerConfig(vocab_size=512, seq_len=64, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=256,
                        llama=True, tied_embeddings=False)
LOCAL_BATCH = 4

TINY_LLAMA_FILE = """
from batchfit.zoo import language_model_workload
from batchfit.zoo.transformer import Transformer, TransformerConfig

CFG = TransformerConfig(vocab_size=256, seq_len=32, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=128,
                        llama=True, tied_embeddings=False)


def workload():
    return language_model_workload(name="tiny-llama", build_model=lambda: Transformer(CFG), vocab_size=256,
                                   seq_len=32, description="tiny llama, 1 layer")
"""
"""A model file for the CLI (``file.py:workload``): a 1-layer Llama, d 64 (its plans trace in seconds)."""
OPTIONS = StepOptions()  # fp32, AdamW


def tiny_workload() -> Workload:
    return tiny_llama_workload(CFG)


def tiny_t5_workload() -> Workload:
    """An encoder-decoder (HF T5 from a small config, no weights): two stacks of T5Block."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                      num_heads=4, decoder_start_token_id=0, pad_token_id=0)

    def make_batch(batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randint(1, 256, (batch_size, 32), device=device),
                torch.randint(1, 256, (batch_size, 16), device=device))

    return Workload(name="tiny-t5", build_model=lambda: T5ForConditionalGeneration(config), make_batch=make_batch,
                    loss_fn=lambda model, batch: model(input_ids=batch[0], labels=batch[1]).loss,
                    tokens_per_sample=48, description="tiny T5: 2 encoder + 2 decoder blocks")


# Ten Llama blocks (twelve with the embedding and the head), small enough to trace whole in a
# second: the whole model's trace that the depth extrapolation (plan/deep.py) must equal.
DEEP_CFG = TransformerConfig(vocab_size=512, seq_len=32, d_model=64, n_layers=10, n_heads=4, n_kv_heads=2, d_ff=128,
                             llama=True, tied_embeddings=False)


def deep_workload() -> Workload:
    """The ten-block Llama of the depth truths (tests/test_plan_deep.py, test_plan_reserved.py)."""
    from batchfit.zoo import language_model_workload
    from batchfit.zoo.transformer import Transformer

    return language_model_workload(name="tiny-llama-12", build_model=lambda: Transformer(DEEP_CFG),
                                   vocab_size=DEEP_CFG.vocab_size, seq_len=DEEP_CFG.seq_len,
                                   description="12 tiny blocks")


def tiny_workload_named(name: str) -> Workload:
    """``tiny_t5_workload`` for a strategy name ending ``:t5``, else ``tiny_workload``."""
    return tiny_t5_workload() if name.endswith(":t5") else tiny_workload()


# Parameter elements of the tiny model, from CFG by hand (head_dim 32; qkv holds 4 + 2 + 2 heads).
BLOCK = (128 * 8 * 32) + (128 * 128) + (128 * 2 * 256) + (256 * 128) + 2 * 128  # qkv, proj, up (gate+up), down, norms
ROOT = 512 * 128 + 128 + 128 * 512  # embedding, final norm, head
TOTAL = ROOT + 2 * BLOCK
assert (BLOCK, ROOT, TOTAL) == (147712, 131200, 426624)


def profiled_rank_peak(step: TrainingStep, path: str) -> int | None:
    """Rank 0's peak over one more steady step, from the profiler's memory timeline; None when
    the timeline's own data-flow check fails ("version mismatch": seen once in a full CI run,
    never alone), and the caller profiles the next step instead."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        step.run(LOCAL_BATCH)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            prof.export_memory_timeline(path, device="cpu")
    except AssertionError:
        return None
    with open(path) as f:
        _, sizes = json.load(f)
    return max(sum(row) for row in sizes)


def rank0_profiled_peaks(step: TrainingStep, path: str, *, wanted: int = 2, tries: int = 30) -> list[int]:
    """Rank 0's peaks over steady steps (:func:`profiled_rank_peak`) until ``wanted`` were read, at most
    ``tries`` steps (a step whose timeline fails its check is profiled again: with gloo's collectives in
    the step the check fails on 0-2 of 5 steps here, and failed 10 in a row once in CI, so the tries are
    many and cost only when they fail); every other rank runs as many real steps, told by rank 0 when
    to stop. The caller keeps the least: on a loaded machine
    a collective that completes late keeps a buffer alive a little longer (seen: +128 KiB, one
    block's output, with 4 ranks on 2 cores). [] on the other ranks."""
    import torch.distributed as dist

    peaks: list[int] = []
    for _ in range(tries):
        if dist.get_rank() == 0:
            peak = profiled_rank_peak(step, path)
            peaks += [peak] if peak is not None else []
        else:
            step.run(LOCAL_BATCH)
        done = torch.tensor([int(len(peaks) >= wanted)])
        dist.broadcast(done, src=0)  # rank 0's answer for every rank
        if done.item():
            break
    return peaks


_TRACED: dict = {}


def traced_rank0(name: str, world_size: int, options: StepOptions = OPTIONS, workload: Workload | None = None):
    """Rank 0 of ``name`` at LOCAL_BATCH with CPU semantics; the tiny model's traces are kept
    (several tests read the same one)."""
    from batchfit.plan.sharded import parse_strategy, trace_sharded

    key = (name, world_size, options.precision) if workload is None else None
    if key in _TRACED:
        return _TRACED[key]
    point = trace_sharded(workload or tiny_workload_named(name), options, get_device("h100-80gb"),
                          parse_strategy(name.removesuffix(":t5"), world_size), LOCAL_BATCH, cuda_semantics=False)
    if key is not None:
        _TRACED[key] = point
    return point


def collective_bytes(point, op: str, phase: str | None = None) -> list[int]:
    return [c.bytes for c in point.collectives if c.op == op and (phase is None or c.phase == phase)]


# --- a tiny MoE with a forced router ---------------------------------------------------------------
B, T, EXPERTS, TOP_K = 2, 32, 8, 2


def forced(kind: str):
    """A router whose indices are set after it ran (its own allocations kept): balanced sends
    token t to experts (t x top_k + j) mod experts, worst sends every token to experts 0..top_k-1."""
    def wrap(gate):
        original = gate.forward

        def forward(hidden_states):
            logits, scores, indices = original(hidden_states)
            tokens = indices.shape[0]
            if kind == "balanced":
                new = (torch.arange(tokens * TOP_K, device=indices.device) % EXPERTS).view(tokens, TOP_K)
            else:
                new = torch.arange(TOP_K, device=indices.device).expand(tokens, TOP_K).contiguous()
            return logits, scores, new
        gate.forward = forward
    return wrap


def tiny_moe(router: str | None = None, implementation: str = "eager") -> Workload:
    """A 2-layer Qwen3-MoE (8 experts, top-2, no weights), its router forced ``balanced`` or
    ``worst`` (``forced``) or left as trained."""
    import transformers

    from batchfit.zoo.hf import _unpacked_sequences

    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, decoder_sparse_step=1, mlp_only_layers=[], use_cache=False)

    def build():
        model = transformers.Qwen3MoeForCausalLM._from_config(config, attn_implementation="sdpa",
                                                               experts_implementation=implementation)
        if router is not None:
            for layer in model.model.layers:
                forced(router)(layer.mlp.gate)
        return model

    def loss_fn(model, ids):
        with _unpacked_sequences(transformers):  # as hf: workloads call it (zoo/hf.py)
            return model(input_ids=ids, labels=ids).loss

    return Workload(name="tiny-qwen3-moe", build_model=build,
                    make_batch=lambda b, device: torch.randint(0, 128, (b, T), device=device), loss_fn=loss_fn)


# --- the examples -----------------------------------------------------------------------------------
def load_example(name: str):
    """An example script as a module, so its main() runs here as it runs from the command line."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the sweep's tiny GPT and corpus ---------------------------------------------------------------
TINY = '''
import torch
from batchfit.zoo import language_model_workload
from batchfit.zoo.transformer import Transformer, TransformerConfig

FAIL_AT = {fail_at}

def workload(seq_len=None):
    cfg = TransformerConfig(vocab_size=320, seq_len=seq_len or 16, d_model=32, n_layers=2, n_heads=2, d_ff=64,
                            llama=True)
    w = language_model_workload(name="tiny-gpt", build_model=lambda: Transformer(cfg), vocab_size=320,
                                seq_len=cfg.seq_len, description="tiny GPT: 2 layers, d 32")
    if FAIL_AT is not None:
        inner = w.loss_fn

        def loss_fn(model, batch):
            if batch[0].shape[0] == FAIL_AT:
                raise ValueError(f"this workload cannot train at batch size {{FAIL_AT}}")
            return inner(model, batch)

        w.loss_fn = loss_fn
    return w
'''


def write_tiny(folder: Path, name: str = "tiny_gpt", fail_at: int | None = None) -> str:
    """Write the tiny workload as a file; returns its MODEL spec (file.py:workload)."""
    path = Path(folder) / f"{name}.py"
    path.write_text(TINY.format(fail_at=fail_at))
    return f"{path}:workload"


def write_corpus(path: Path, lines: int = 600, seed: int = 0) -> Path:
    rng = random.Random(seed)
    names, verbs = ["Tom", "Lily", "Sam", "Mia", "Ben"], ["saw", "liked", "found", "lost", "made"]
    things, moods = ["ball", "cat", "tree", "cake", "boat"], ["big", "red", "fun", "sad"]
    text = "\n".join(f"{rng.choice(names)} {rng.choice(verbs)} a {rng.choice(things)}. It was {rng.choice(moods)}."
                     for _ in range(lines))
    Path(path).write_text(text)
    return Path(path)
