"""--loss plain | chunked:N | fused-linear: the math against F.cross_entropy of the full logits on
real CPU steps, the traced peak against the torch profiler on a real CPU step, and bytes by hand.

The model is the zoo's Llama-style Transformer with a vocabulary large enough for the logits to
matter: 2 blocks, d_model 64, vocab 4096 (untied), batch 4 x 64 tokens, fp32 AdamW. The fp32
logits are B x T x V x 4 = 4 x 64 x 4096 x 4 = 4,194,304 bytes.

Checked against torch's own F.cross_entropy (the math) and the profiler on real CPU steps; the chunked and
fused-linear losses are batchfit's own mirrors of torchtune's and Liger's (checks their counting, not their fidelity
to torchtune's code or Liger's Triton kernel).
"""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch
import torch.nn.functional as F

from batchfit.config.step import step_options
from batchfit.errors import OptionError
from batchfit.trace.memory import MemoryTracker
from batchfit.trace.session import TraceSession
from batchfit.train.losses import chunked_cross_entropy, fused_linear_cross_entropy
from batchfit.train.step import TrainingStep
from batchfit.workload import StepOptions, Workload
from batchfit.zoo import language_model_workload
from batchfit.zoo.hf import hf_workload
from batchfit.zoo.transformer import Transformer, TransformerConfig
from cpu_truth import profiled_step_peak

B, T, D, V = 4, 64, 64, 4096
LOGITS_BYTES = B * T * V * 4
CONFIG = TransformerConfig(vocab_size=V, seq_len=T, d_model=D, n_layers=2, n_heads=4, d_ff=192, llama=True,
                           tied_embeddings=False)


def tiny(**changes) -> Workload:
    cfg = dataclasses.replace(CONFIG, **changes)
    return language_model_workload(name="tiny-lm", build_model=lambda: Transformer(cfg), vocab_size=V,
                                   seq_len=T, description="tiny lm")


def loss_and_grads(workload: Workload, loss: str, batch, precision: str = "fp32"):
    """One real CPU forward + backward under ``--loss loss``, from the same weights."""
    torch.manual_seed(0)
    step = TrainingStep(workload, StepOptions(loss=loss, precision=precision), torch.device("cpu"))
    value = step.forward(batch)
    step.backward(value)
    return value.detach(), {name: p.grad for name, p in step.model.named_parameters()}


# -- the math ---------------------------------------------------------------------------------

@pytest.mark.parametrize("loss", ["chunked:1", "chunked:3", "chunked:8", "fused-linear"])
def test_loss_and_gradients_equal_the_full_logits_cross_entropy(loss):
    """The zoo's loss_fn (F.cross_entropy of the whole logits) is the reference."""
    workload = tiny(tied_embeddings=True)  # tied: the head's gradient and the embedding's add up
    torch.manual_seed(1)
    batch = workload.make_batch(B, torch.device("cpu"))
    expected, expected_grads = loss_and_grads(workload, "plain", batch)
    got, grads = loss_and_grads(workload, loss, batch)
    torch.testing.assert_close(got, expected)
    assert grads.keys() == expected_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], expected_grads[name], msg=name)


def test_ignored_targets_count_for_nothing_as_in_cross_entropy():
    torch.manual_seed(0)
    hidden = torch.randn(2, 10, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (2, 10))
    targets[0, :4] = -100
    expected = F.cross_entropy((hidden @ weight.t()).reshape(-1, 50), targets.reshape(-1))
    expected_grads = torch.autograd.grad(expected * 3, (hidden, weight))  # a grad_output that is not 1
    for fn in (lambda: chunked_cross_entropy(hidden, weight, targets, 3),
               lambda: fused_linear_cross_entropy(hidden, weight, targets)):
        got = fn()
        torch.testing.assert_close(got, expected)
        for g, e in zip(torch.autograd.grad(got * 3, (hidden, weight)), expected_grads):
            torch.testing.assert_close(g, e)


@pytest.mark.parametrize("loss", ["chunked:4", "fused-linear"])
def test_bf16_mixed_losses_stay_close_to_the_plain_one(loss):
    workload = tiny()
    torch.manual_seed(1)
    batch = workload.make_batch(B, torch.device("cpu"))
    expected, _ = loss_and_grads(workload, "plain", batch, "bf16-mixed")
    got, grads = loss_and_grads(workload, loss, batch, "bf16-mixed")
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=1e-2)
    assert all(g.dtype == torch.float32 for g in grads.values())


def hf_tiny(tmp_path, **config) -> Workload:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return hf_workload(str(path), seq_len=32)


HF_CONFIGS = {
    "gpt2": dict(model_type="gpt2", vocab_size=1000, n_positions=64, n_embd=32, n_layer=2, n_head=2),
    "llama-tied": dict(model_type="llama", vocab_size=1000, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       max_position_embeddings=64, tie_word_embeddings=True),
}


@pytest.mark.parametrize("arch", sorted(HF_CONFIGS))
@pytest.mark.parametrize("loss", ["chunked:4", "fused-linear"])
def test_hf_causal_lm_losses_equal_its_own_loss(tmp_path, arch, loss):
    """HF's ``model(**batch).loss`` (shifted labels, logits upcast to fp32) is the reference."""
    workload = hf_tiny(tmp_path, **HF_CONFIGS[arch])
    torch.manual_seed(1)
    batch = workload.make_batch(3, torch.device("cpu"))
    expected, expected_grads = loss_and_grads(workload, "plain", batch)
    got, grads = loss_and_grads(workload, loss, batch)
    torch.testing.assert_close(got, expected)
    for name in grads:
        torch.testing.assert_close(grads[name], expected_grads[name], msg=name)


# -- options and errors -----------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["chunked", "chunked:0", "chunked:-2", "chunked: 4", "fused", "Plain"])
def test_an_unknown_loss_says_the_valid_ones_in_one_line(bad):
    with pytest.raises(OptionError) as error:
        StepOptions(loss=bad)
    message = str(error.value)
    assert "\n" not in message and "plain, chunked:N (e.g. chunked:8), fused-linear" in message


def test_a_workload_without_lm_parts_says_what_is_missing(tmp_path):
    workload = dataclasses.replace(tiny(), lm_parts=None)
    with pytest.raises(OptionError, match="gives no lm_parts: set Workload.lm_parts, or use `loss` plain"):
        TrainingStep(workload, StepOptions(loss="fused-linear"), torch.device("cpu"))
    masked = hf_tiny(tmp_path, model_type="bert", vocab_size=100, hidden_size=32, num_hidden_layers=1,
                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
                     architectures=["BertForMaskedLM"])
    assert masked.lm_parts is None  # a masked LM's loss is not next-token
    TrainingStep(workload, StepOptions(loss="plain"), torch.device("cpu"))  # plain needs none


def test_a_tensor_parallel_model_refuses_a_non_plain_loss_in_one_line():
    """A TP plan splits the head's weight by the vocabulary (it says so on the model); DDP and
    FSDP2 take the chunked and fused losses (tests/test_distributed_losses.py)."""
    from batchfit.train.losses import TP_LOSS_ATTR

    def tensor_parallel(model):
        setattr(model, TP_LOSS_ATTR, "sharded")
        return model

    with pytest.raises(OptionError, match="does not run under tensor parallelism: use `loss` plain"):
        TrainingStep(tiny(), StepOptions(loss="chunked:4"), torch.device("cpu"), wrap=tensor_parallel)
    TrainingStep(tiny(), StepOptions(loss="chunked:4"), torch.device("cpu"), wrap=lambda model: model)


def test_the_report_folder_names_the_loss():
    from batchfit.cli.common import report_folder
    from batchfit.targets import parse_target

    folder = report_folder(None, "estimate", "gpt2-124m", parse_target("virtual:h100-80gb"),
                           StepOptions(loss="chunked:8"))
    assert folder.name.endswith("-loss-chunked_8")
    plain = report_folder(None, "estimate", "gpt2-124m", parse_target("virtual:h100-80gb"), StepOptions())
    assert "loss" not in plain.name


def test_the_cli_passes_the_loss_through():
    assert step_options("fp32", None, "none", None, None, 1, loss="chunked:8").loss == "chunked:8"
    assert step_options("fp32", None, "none", None, None, 1).loss == "plain"


# -- memory -----------------------------------------------------------------------------------

def traced_peak(workload: Workload, loss: str, tracker: MemoryTracker | None = None,
                precision: str = "fp32") -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        options = StepOptions(loss=loss, precision=precision)
        with TraceSession(workload, options, cuda_semantics=False, tracker=tracker) as session:
            return session.trace(B).snapshot.peak_bytes


def profiled_peak(workload: Workload, loss: str, tmp_path, precision: str = "fp32") -> int:
    torch.manual_seed(0)
    step = TrainingStep(workload, StepOptions(loss=loss, precision=precision), torch.device("cpu"))
    return profiled_step_peak(step, B, tmp_path)


@pytest.mark.parametrize("loss,precision", [
    (loss, precision) if (loss, precision) != ("fused-linear", "fp32")
    else pytest.param(loss, precision, marks=pytest.mark.slow)  # the bf16-mixed one stays in the fast tier
    for loss in ("plain", "chunked:4", "fused-linear") for precision in ("fp32", "bf16-mixed")])
def test_traced_peak_matches_the_profiler_on_a_real_cpu_step(loss, precision, tmp_path):
    """Within 0.1% (the issue asks 1%; today it is within 100 bytes). Under bf16-mixed the fused
    loss accumulates the head's gradient with an fp32 addmm of the chunk, as Liger does; a
    bf16 [V, H] product added to the fp32 gradient made the real step 0.9% higher here."""
    traced = traced_peak(tiny(), loss, precision=precision)
    measured = profiled_peak(tiny(), loss, tmp_path, precision)
    assert abs(traced - measured) <= 0.001 * measured, (traced, measured)


@pytest.mark.parametrize("chunks", [2, 4])
def test_chunking_takes_two_logits_sized_backward_buffers_down_to_a_chunk(chunks):
    """The plain loss's backward holds three fp32 [B, T, V] tensors at once (the saved
    log-softmax, the gradient of the NLL, the gradient of the log-softmax); chunked:N keeps the
    saved log-softmax of every chunk (as torchtune does) but makes the two gradients one chunk's
    each: plain - chunked:N = 2 x B x T x V x 4 x (1 - 1/N)."""
    saved = traced_peak(tiny(), "plain") - traced_peak(tiny(), f"chunked:{chunks}")
    expected = 2 * LOGITS_BYTES * (1 - 1 / chunks)
    assert abs(saved - expected) <= 0.001 * expected, (saved, expected)


class AllocationLog(MemoryTracker):
    """Every allocation of the traced steps."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.log = []

    def record(self, key, storage, **kwargs):
        record = super().record(key, storage, **kwargs)
        if record is not None:
            self.log.append(record)
        return record


def test_fused_linear_never_allocates_the_logits():
    """No allocation of B x T x V elements (or more than one Liger chunk of rows x V): Liger's
    chunk here is next_power_of_2(cdiv(256 rows, cdiv(4096, 64))) = 4 rows."""
    tracker = AllocationLog(round_bytes=1)
    peak = traced_peak(tiny(), "fused-linear", tracker)
    vocab_wide = [r for r in tracker.log if r.shape and r.shape[-1] == V and r.shape != (V, D)]
    assert vocab_wide, "the fused loss's logits chunks are traced"
    assert max(r.nbytes for r in vocab_wide) == 4 * V * 4  # [4, 4096] fp32
    assert all(r.nbytes < LOGITS_BYTES // 8 for r in tracker.log if r.shape != (V, D))
    # plain holds three [B*T, V] fp32 tensors at its peak; the fused step's peak is below plain's by
    # more than two of them (what it saves instead: [B*T, D] and [V, D] gradients, ~1/60 as much)
    assert traced_peak(tiny(), "plain") - peak > 2 * LOGITS_BYTES


# -- the CLI ----------------------------------------------------------------------------------

def test_estimate_takes_the_loss_and_fits_a_larger_batch_with_it(tmp_path):
    """gpt-tinystories-22m, seq 64, 2 GiB (allocated): the fused loss drops the [B, T, 10000]
    logits, so more samples fit than with the plain loss; the JSON and the folder name say which."""
    from typer.testing import CliRunner

    from batchfit.cli.app import app

    fits = {}
    for loss in ("plain", "fused-linear"):
        result = CliRunner().invoke(app, ["estimate", "gpt-tinystories-22m", "--gpu-memory", "2GiB", "--seq-len", "64",
                                          "--limit", "allocated", "--loss", loss, "--out", str(tmp_path / loss),
                                          "--json", str(tmp_path / f"{loss}.json")])
        assert result.exit_code == 0, result.output
        data = json.loads((tmp_path / f"{loss}.json").read_text())
        assert data["options"]["loss"] == loss
        fits[loss] = data["max_batch_size"]
    assert fits["fused-linear"] > fits["plain"], fits
    bad = CliRunner().invoke(app, ["estimate", "gpt-tinystories-22m", "--loss", "chunked:0"])
    assert bad.exit_code == 2 and "use plain, chunked:N (e.g. chunked:8), fused-linear" in bad.output


def test_more_chunks_than_tokens_is_refused_in_one_line():
    """chunked:100000 on a 256-token sequence made 100,000 empty chunks, an op each: it hung."""
    from batchfit.options import Loss
    from batchfit.specs import load_workload
    from batchfit.train.losses import lm_loss

    with pytest.raises(OptionError, match="at most 256"):
        lm_loss(Loss.parse("chunked:100000"), load_workload("gpt-tinystories-22m"))
    assert lm_loss(Loss.parse("chunked:256"), load_workload("gpt-tinystories-22m")) is not None
