"""--precision fp8-tensorwise | fp8-rowwise: torchao's float8 training, traced with torchao's own
modules and tensor subclasses on fake tensors, against a real CPU step and bytes by hand.

The model is the zoo's Llama-style Transformer, 2 blocks, d_model 64, MLP 256, vocab 128 (so the
linears, not the logits, make the peak), batch 4 x 32 tokens, AdamW. The tensorwise recipe's CPU
truth, and both on a larger model, are rows of benchmarks/recipes.py (slower: the profiler).

Checked against torchao's own float8 modules and tensor subclasses running for real on a CPU step, and bytes by
hand.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("torchao.float8")

from batchfit.devices import get_device, precision_warning  # noqa: E402
from batchfit.errors import OptionError  # noqa: E402
from batchfit.trace.session import TraceSession  # noqa: E402
from batchfit.train.float8 import convert_to_float8  # noqa: E402
from batchfit.train.step import TrainingStep  # noqa: E402
from batchfit.workload import StepOptions, Workload  # noqa: E402
from batchfit.zoo import language_model_workload  # noqa: E402
from batchfit.zoo.transformer import Transformer, TransformerConfig  # noqa: E402
from cpu_truth import profiled_step_peak  # noqa: E402

B, T = 4, 32
CONFIG = TransformerConfig(vocab_size=128, seq_len=T, d_model=64, n_layers=2, n_heads=4, d_ff=256, llama=True,
                           tied_embeddings=False)
LM = language_model_workload(name="tiny-lm", build_model=lambda: Transformer(CONFIG), vocab_size=128, seq_len=T,
                             description="tiny lm")


def test_traced_float8_step_matches_the_cpu_profiler(tmp_path):
    """Rowwise (per-row scales, its backward's fp32 rescaling). torch._scaled_mm runs on this CPU (an
    fp32 emulation): the real step, measured by the profiler, against the trace with CPU semantics
    (which runs that kernel's scratch op by op: ``trace/cuda_float8.py``); everything else is
    torchao's own code on both sides."""
    options = StepOptions(precision="fp8-rowwise")
    with TraceSession(LM, options, cuda_semantics=False) as session:
        traced = session.trace(B).snapshot.peak_bytes
        assert len(session.step.float8_layers) == 8  # qkv, proj, up, down in each block; not the head
    torch.manual_seed(0)
    measured = profiled_step_peak(TrainingStep(LM, options, torch.device("cpu")), B, tmp_path)
    assert abs(traced - measured) / measured < 0.02
    assert abs(traced - measured) < 1024  # 72 B apart when this was written


def _two_linears(k: int) -> Workload:
    return Workload(name="two-linears",
                    build_model=lambda: nn.Sequential(nn.Linear(k, k, bias=False), nn.Linear(k, k, bias=False)),
                    make_batch=lambda b, device: torch.randn(b, k, device=device),
                    loss_fn=lambda model, x: model(x).float().pow(2).mean())


def _kept_after_forward(precision: str, tokens: int, k: int) -> int:
    """Bytes a CUDA-semantics forward leaves alive for backward (its output included)."""
    workload = _two_linears(k)
    with TraceSession(workload, StepOptions(precision=precision)) as session:
        step, tracker = session.step, session.tracker
        with session.tracing("a forward"), step.step_context():
            x = workload.make_batch(tokens, torch.device("cpu"))
            before = tracker.live_bytes
            with step.forward_autocast():
                out = step.model(x)
            kept = tracker.live_bytes - before
            del out
    return kept


@pytest.mark.parametrize("precision", ["fp8-tensorwise", "fp8-rowwise"])
def test_a_float8_linear_keeps_the_bf16_input_and_no_weight_copy(precision):
    """By hand, M tokens through two K x K linears (fp32 input, bf16 autocast). torchao's Float8Linear
    casts its input to bf16 (CUDA's autocast flag, mirrored) and saves it with the fp32 weight itself
    (``matmul_with_hp_or_float8_args.forward``: ``save_for_backward(input_hp, weight_hp_t)``); its
    float8 copies are remade in backward, never kept. So per token it keeps 2 x K bytes, as a bf16
    Linear does; the bf16 Linear also keeps its bf16 weight copy (2 x K x K bytes) where its input
    needs a gradient (the second one: the first one's input is data)."""
    m, k = 256, 512
    fp8 = _kept_after_forward(precision, m, k)
    bf16 = _kept_after_forward("bf16-mixed", m, k)
    per_linear_input = 2 * m * k  # bf16
    assert fp8 == 3 * per_linear_input  # the first input's bf16 copy, the hidden state, the output
    assert bf16 - fp8 == 2 * k * k  # the second linear's bf16 weight copy, which autograd keeps


def test_torchtitans_filter_leaves_the_head_and_odd_dims():
    model = nn.Module()
    model.body = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 24))  # 24: not divisible by 16
    model.lm_head = nn.Linear(64, 128)
    converted = convert_to_float8(model, "tensorwise")
    assert converted == ["body.0"]
    assert convert_to_float8(model, "tensorwise") == ["body.0"]  # idempotent: converted layers stay


def test_fp8_options_say_what_to_do():
    assert "fp8-rowwise" in str(pytest.raises(OptionError, StepOptions, precision="fp8-row").value)
    for name in ("a100-80gb", "v100-16gb", "t4"):
        assert "float8" in precision_warning(get_device(name), "fp8-tensorwise")
    for name in ("h100-80gb", "l4", "rtx4090"):
        assert precision_warning(get_device(name), "fp8-rowwise") is None


def test_fp8_without_torchao_says_how_to_install(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    import batchfit.workload as workload
    from batchfit.cli.app import app

    monkeypatch.setattr(workload, "_installed", lambda name: False)
    error = pytest.raises(OptionError, StepOptions, precision="fp8-tensorwise").value
    assert "pip install 'batchfit[fp8]'" in str(error) and "\n" not in str(error)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["estimate", "gpt-tinystories-22m", "--seq-len", "16", "--gpu", "h100",
                                      "--precision", "fp8-rowwise"])
    said = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code in (1, 2) and len(said) == 1 and "pip install 'batchfit[fp8]'" in said[0], result.output


def test_fsdp2_gathers_float8_weights_with_one_byte_per_element():
    """Tensorwise under FSDP2 on 2 ranks (the fake process group), torchtitan's settings: each block's
    all-gather carries its 4 float8 linears' weights at 1 byte per element and its 2 norms in bf16,
    where bf16-mixed gathers 2 bytes per element; gradients are reduce-scattered in fp32 either way.
    The scales: one all-reduce of every weight's amax after the optimizer step (torchao's
    precompute_float8_dynamic_scale_for_fsdp), none in forward. A real 2-process gloo run of the same
    step peaks 44 B above this trace (benchmarks/recipes.py, "fsdp2 x2" rows)."""
    from tiny import BLOCK, ROOT, collective_bytes, traced_rank0

    linears = 128 * 8 * 32 + 128 * 128 + 128 * 2 * 256 + 256 * 128  # qkv, proj, up (gate+up), down
    norms = 2 * 128
    assert linears + norms == BLOCK
    fp8 = traced_rank0("fsdp", 2, StepOptions(precision="fp8-tensorwise"))
    # the root: bf16 (head filtered)
    assert collective_bytes(fp8, "all_gather") == [2 * ROOT] + [linears + 2 * norms] * 4
    assert collective_bytes(fp8, "reduce_scatter") == [4 * BLOCK, 4 * BLOCK, 4 * ROOT]
    assert [(c.phase, c.bytes) for c in fp8.collectives if c.op == "all_reduce"] == [("optimizer", 8 * 4)]


@pytest.mark.parametrize("cuda_semantics", [True, False])
def test_float8_under_compile_runs_inductors_code_for_torchaos_graphs(cuda_semantics):
    """--compile with float8: torchao's subclasses go through dynamo and AOTAutograd on fake tensors,
    and each graph runs as the wrapper inductor generates for it (kernels skipped), on CUDA
    semantics too. The truth is slow (inductor builds the float8 kernels): benchmarks/float8_compile.py,
    a 2-layer Llama against inductor on this CPU, tensorwise and rowwise, +0.0003% when written."""
    from batchfit.trace.compiled import inductor_fallbacks
    from batchfit.trace.cuda_float8 import FLOAT8_COMPILED_TRACED, float8_approximations

    options = StepOptions(precision="fp8-tensorwise", compile="model")
    with TraceSession(_two_linears(64), options, cuda_semantics=cuda_semantics) as session:
        peak = session.trace(64).snapshot.peak_bytes
        assert session.compiled and inductor_fallbacks() == ""
        backward = {r.op for r in session.tracker._window if r.phase == "backward"}
    assert "empty_strided" in backward and "_scaled_mm" not in backward  # inductor's buffers, out= matmuls
    assert peak > 0
    said = [a.what for a in float8_approximations(options, traced_compiled=True)]
    assert FLOAT8_COMPILED_TRACED.what in said and not any("traced eager" in what for what in said)


def test_the_compiled_float8_range_is_the_measured_one():
    """FLOAT8_COMPILED_TRACED states benchmarks/float8_compile.py's rows, rounded."""
    import json
    from pathlib import Path

    from batchfit.trace.cuda_float8 import FLOAT8_COMPILED_TRACED

    root = Path(__file__).parents[1]
    rows = json.loads((root / FLOAT8_COMPILED_TRACED.source.split(" ")[0]).read_text())["rows"]
    errors = [row["error"] for row in rows]
    assert FLOAT8_COMPILED_TRACED.may_differ_by.startswith(f"{min(errors):+.2%} to {max(errors):+.2%} ")
    assert {(row["precision"], row["compile"]) for row in rows} == {
        ("fp8-tensorwise", "model"), ("fp8-rowwise", "model"), ("fp8-tensorwise", "blocks")}
