"""QLoRA and 8-bit optimizers (``--quantize``, ``--lora``, bitsandbytes' optimizers): the real
libraries on fake tensors (``trace/bnb_fake.py``), held to the torch profiler's memory timeline of
the same real step on this CPU, and to the bytes bitsandbytes really allocates.

Checked against bitsandbytes' and PEFT's own code running for real on a CPU step (the profiler's timeline, the bytes
bitsandbytes allocates)."""

from __future__ import annotations

import builtins

import pytest
import torch
from torch import nn

from batchfit import Workload
from batchfit.errors import OptionError
from batchfit.options import LoRA
from batchfit.trace.session import TraceSession
from batchfit.train.step import TrainingStep
from batchfit.workload import StepOptions

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

from cpu_truth import profiled_step_peak  # noqa: E402

LAYERS = 2


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=344,
                                        num_hidden_layers=LAYERS,
                                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                        attn_implementation="sdpa"))


LLAMA = Workload(name="llama-2l", build_model=llama,
                 make_batch=lambda b, d: torch.randint(0, 512, (b, 64), device=d),
                 loss_fn=lambda m, x: m(input_ids=x, labels=x).loss, tokens_per_sample=64)


def test_the_options_are_checked_in_one_line():
    assert LoRA.parse("r=16") == LoRA(r=16, alpha=None, dora=False, targets=None)
    assert LoRA.parse("r=8,alpha=16,dora,targets=q_proj+v_proj") == LoRA(r=8, alpha=16, dora=True,
                                                                       targets=("q_proj", "v_proj"))
    for bad in ("16", "r=0", "r=8,targets=", "r=8,dropout=0.1", "alpha=8"):
        with pytest.raises(OptionError, match="r=16"):
            StepOptions(lora=bad)
    with pytest.raises(OptionError, match="nf4-dq"):
        StepOptions(quantize="nf5")


MLP = Workload(name="mlp", build_model=lambda: nn.Sequential(nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 8)),
               make_batch=lambda b, d: torch.randn(b, 512, device=d), loss_fn=lambda m, x: m(x).square().mean())


@pytest.mark.parametrize("workload, options", [
    (LLAMA, StepOptions(quantize="nf4", lora="r=16", optimizer="paged-adamw-8bit")),  # QLoRA, all linear layers
    (MLP, StepOptions(optimizer="adamw-8bit")),  # an 8-bit AdamW full fine-tune (the Llama's: benchmarks/recipes.py)
], ids=["qlora-nf4-r16-paged-adamw-8bit", "full-adamw-8bit"])
def test_the_traced_step_is_the_cpu_profilers(workload, options, tmp_path):
    """The real step on this CPU (bitsandbytes' CPU kernels; its paged optimizers fall back to
    ordinary tensors on the CPU) against the trace with CPU semantics: within 3% (it is 0.00%)."""
    with TraceSession(workload, options, cuda_semantics=False) as session:
        traced = session.trace(2).snapshot.peak_bytes
    torch.manual_seed(0)
    real = profiled_step_peak(TrainingStep(workload, options, torch.device("cpu")), 2, tmp_path)
    assert abs(traced - real) / real < 0.03
    assert abs(traced - real) < 4096


def test_the_quantized_weights_take_what_bitsandbytes_allocates():
    """nf4 with double quantization: 2 values per byte, one uint8 absmax per 64-block and, per
    256 of those, an fp32 absmax, plus the codes (nf4: 16 fp32; the 8-bit dynamic map: 256 fp32)
    and the offset. The real CPU model's storages, summed, are the trace's build."""
    options = StepOptions(quantize="nf4-dq", lora="r=8")
    real_model = TrainingStep(LLAMA, options, torch.device("cpu")).model
    storages: dict[int, int] = {}
    quantized = 0
    for module in real_model.modules():
        for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            state = getattr(tensor, "quant_state", None)
            if state is not None:
                quantized += 1
                for t in (state.absmax, state.code, state.offset, state.state2.absmax, state.state2.code):
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    assert quantized == 7 * LAYERS
    with TraceSession(LLAMA, options, cuda_semantics=False) as session:
        traced = session.tracker.live_bytes
    assert traced == sum(storages.values())


def test_paged_optimizer_state_is_its_own_figure():
    """A paged optimizer's state of 1e5 elements or more lives in CUDA unified memory: not in the
    peak, reported as paged_bytes (1 byte per element per state: AdamW's two)."""
    points = {}
    for name in ("adamw-8bit", "paged-adamw-8bit"):
        with TraceSession(MLP, StepOptions(optimizer=name)) as session:
            points[name] = session.trace(4)
    big = 512 * 256
    assert points["paged-adamw-8bit"].paged_bytes == 2 * big and points["adamw-8bit"].paged_bytes == 0
    assert points["adamw-8bit"].snapshot.peak_bytes - points["paged-adamw-8bit"].snapshot.peak_bytes == 2 * big


@pytest.mark.parametrize("failure, words", [
    (ImportError("No module named 'bitsandbytes'"), "pip install 'batchfit[quant]'"),
    (RuntimeError("CUDA Setup failed despite GPU being available"), "cannot load"),
])
def test_bitsandbytes_missing_or_broken_is_one_line(monkeypatch, failure, words):
    from batchfit.train.quantize import load_bitsandbytes

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("bitsandbytes"):
            raise failure
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(OptionError, match=words.replace("[", r"\[").replace("]", r"\]")) as info:
        load_bitsandbytes("`quantize` nf4")
    assert "\n" not in str(info.value)


def test_lora_targets_that_match_nothing_name_the_layers():
    with pytest.raises(OptionError, match="q_proj") as info:
        TraceSession(LLAMA, StepOptions(lora="r=8,targets=query+value"))
    assert "query+value" in str(info.value) and "\n" not in str(info.value)


BY_HAND = "examples/qlora_by_hand.py:workload"
"""A QLoRA model built in the user's own file (Linear4bit + Params4bit, PEFT, bnb's AdamW8bit)."""


def test_a_qlora_model_built_by_hand_is_traced_as_batchfits_own(monkeypatch):
    """The user's own QLoRA build used to stop while building ("Creating a new Tensor subclass
    Params4bit ... FakeTensor"). Its weights are quantized where batchfit moves the model
    (Params4bit.to), and the step is batchfit's --quantize nf4 --lora r=16 --optimizer adamw-8bit
    on the same Llama (held to the profiler above), byte for byte."""
    from pathlib import Path

    from batchfit.specs import load_workload

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    user = load_workload(BY_HAND)
    with TraceSession(user, StepOptions()) as session:
        by_hand = session.trace(4).snapshot
        assert session.params == sum(p.numel() for p in llama().parameters()) + 78_080  # 4-bit weights: values
        assert session.trainable_params == 78_080
    with TraceSession(LLAMA, StepOptions(quantize="nf4", lora="r=16", optimizer="adamw-8bit")) as session:
        own = session.trace(4).snapshot
    assert by_hand.peak_bytes == own.peak_bytes and by_hand.breakdown == own.breakdown
    # The 8-bit optimizer's state, by hand, each tensor in CUDA's 512-byte blocks. Each layer's 14
    # LoRA matrices: 11 of 2,048 values (under min_8bit_size 4,096: two fp32 states) and 3 of
    # 344 x 16 (two uint8 states, 5,504 bytes each, and two fp32 absmax, one per 256 values: 88 bytes);
    # and the two 256-value fp32 quantile maps.
    small, big = 11 * LAYERS * 2 * 8192, 3 * LAYERS * 2 * (5632 + 512)
    assert by_hand.breakdown["optimizer_state"] == small + big + 2 * 1024 == 436_224
