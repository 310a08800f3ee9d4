"""The GRPO step is TRL's (issue: "is batchfit's GRPO step TRL's?"): the log-probs through TRL's fused LM head
(``zoo/fused_logprobs.py``), by hand and against a REAL ``trl.GRPOTrainer`` step where trl is installed.

By hand: TRL's head projects into one ``min(tokens, 4096) x 32768`` buffer whatever the vocabulary, so 8 tokens
of a 16-token vocabulary still take 8 x 32,768 x 4 B = 1,048,576 B, with seven [tokens] fp32 running statistics
(7 x 32 B) beside it, the log of the sum (32 B) and log Z (32 B) at the forward's peak; the values are the
log-softmax's."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from batchfit.trace.memory import MemoryTracker
from batchfit.zoo.fused_logprobs import ChunkedLogProb, fused_completion_logprobs


def test_fused_head_buffer_is_32768_wide_whatever_the_vocabulary():
    with FakeTensorMode(), MemoryTracker(round_bytes=1) as tracker:
        hidden, weight, targets = torch.empty(8, 4), torch.empty(16, 4), torch.zeros(8, dtype=torch.long)
        before = tracker.live_bytes
        ChunkedLogProb.apply(hidden, weight, targets, 1.0, False, True)  # the GPU's path: Triton folds in place
        assert tracker.peak_bytes - before == 8 * 32768 * 4 + 7 * 32 + 32 + 32


def test_fused_logprobs_are_the_log_softmax_and_its_gradient():
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 5, requires_grad=True)
    weight = torch.randn(11, 5, requires_grad=True)
    sequences = torch.randint(0, 11, (3, 7))
    logp, entropy = fused_completion_logprobs(hidden, weight, sequences, 4, entropy=True, triton=False)
    logits = hidden[:, -5:-1] @ weight.T
    expected = torch.log_softmax(logits, -1).gather(-1, sequences[:, -4:, None]).squeeze(-1)
    assert torch.allclose(logp, expected, atol=1e-5)
    probs = torch.softmax(logits, -1)
    assert torch.allclose(entropy, -(probs * probs.log()).sum(-1), atol=1e-5)
    logp.sum().backward()
    fused_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    expected.sum().backward()
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(fused_grads, (hidden.grad, weight.grad)))


TRUTH_CASES = ("fp32", "bf16", "bf16-warpers")


@pytest.mark.slow
@pytest.mark.parametrize("which", TRUTH_CASES)
def test_each_phase_against_a_real_trl_grpo_step(tmp_path, which):
    """benchmarks/trl_grpo_truth.py's first case (a reference model, 4 completions per update), with fp32 weights,
    bf16 weights, and bf16 weights sampled through five logits processors more (temperature, top_k, top_p, min_p,
    repetition_penalty): the generation within 1 KB of TRL's, the reference and update within 0.1%, the optimizer
    within 1.5% (trl 1.16.0, generation: -332 B, +84 B, +116 B; what is left is named in docs/run.md). Before
    generation mirrored transformers' logits processors and what generate keeps between tokens
    (``zoo/hf_sampling.py``), the bf16 generation read 12,192 B (3.8%) low: its peak is at a new token, where
    min_new_tokens' processors hold fp32 [rows, vocab] copies the trace did not make."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    from tests.cpu_truth import same_kernels_on_any_x86
    from tests.trl_truth import BF16_CASES, CASES, tiny_llama, traced_phase_peaks, trl_phase_peaks

    case = dict(zip(TRUTH_CASES, (CASES[0], *BF16_CASES)))[which]
    model = tiny_llama(tmp_path)
    with same_kernels_on_any_x86():  # bf16 matmuls: no oneDNN scratch (cpu_truth)
        real = trl_phase_peaks(case, model)
    traced = traced_phase_peaks(case, model)
    assert abs(traced["generate"] - real["generate"]) <= 1024, (traced["generate"], real["generate"])
    for phase, within in (("reference", 0.001), ("forward", 0.001), ("backward", 0.001), ("optimizer", 0.015)):
        assert abs(traced[phase] - real[phase]) <= within * real[phase], (phase, traced[phase], real[phase])


def test_seed_003s_loop_scores_from_the_whole_logits_and_trl_from_the_fused_head():
    """grpo-gpt2-124m is seed 003's own loop (its report: 21.78 GB allocated at batch 96, which the whole
    [rows, 144, 50257] logits explain and the fused head's half would not); an hf: model under a GRPOConfig is
    TRL's (>= 1.15: the fused head). The numbers of the first are pinned in test_depth (72, 64 on 5 GiB)."""
    import torch

    from batchfit.zoo.grpo import GPT2, _logprobs, _zoo_policy
    from batchfit.zoo.transformer import TransformerConfig

    tiny = {**GPT2, "vocab_size": 64, "d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 32}
    policy = _zoo_policy(TransformerConfig(seq_len=12, **tiny))
    model, sequences = policy.build(), torch.randint(0, 64, (3, 12))
    logprobs = _logprobs(policy, model, sequences, 4, entropy=False, triton=False)
    expected = torch.log_softmax(model(sequences)[:, -5:-1], -1).gather(-1, sequences[:, -4:, None]).squeeze(-1)
    assert policy.logits is not None and torch.allclose(logprobs, expected, atol=1e-5)
