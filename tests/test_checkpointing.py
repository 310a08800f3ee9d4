"""Activation checkpointing policies (--checkpointing full | selective | every:N, and a user's own
SAC policy): traced against the torch profiler on a real CPU step, and kept bytes by hand.

The model is the zoo's Llama-style Transformer, small: 4 blocks, d_model 128, 4 heads of 32,
SwiGLU width 384, no biases, seq 64, batch 8. Per block, in fp32 (B x T = 512 rows):
qkv matmul 512 x 384, attention output 8 x 4 x 64 x 32 and its logsumexp 8 x 4 x 64,
out-projection 512 x 128, up matmul 512 x 768, down matmul 512 x 128, block output 512 x 128.

Checked against torch's own code running for real (torch.utils.checkpoint and its SAC policies, the profiler on a
CPU step) and bytes by hand.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections import defaultdict

import pytest
import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from batchfit.errors import OptionError
from batchfit.options import Checkpointing
from batchfit.trace.memory import MemoryTracker, rounded
from batchfit.trace.session import TraceSession
from batchfit.train.checkpointing import checkpointed_blocks, save_ops
from batchfit.train.step import TrainingStep
from batchfit.workload import StepOptions, Workload
from batchfit.zoo import language_model_workload
from batchfit.zoo.transformer import Transformer, TransformerConfig
from cpu_truth import profiled_step_peak

B, T, D, H, HD, FF = 8, 64, 128, 4, 32, 384
CONFIG = TransformerConfig(vocab_size=512, seq_len=T, d_model=D, n_layers=4, n_heads=H, d_ff=FF, llama=True)
F32 = 4
QKV, PROJ, UP, DOWN = B * T * 3 * D * F32, B * T * D * F32, B * T * 2 * FF * F32, B * T * D * F32
ATTN_OUT, LSE, BLOCK_OUT = B * H * T * HD * F32, B * H * T * F32, B * T * D * F32


def tiny(n_layers: int = 4) -> Workload:
    cfg = dataclasses.replace(CONFIG, n_layers=n_layers)
    return language_model_workload(name="tiny-llama", build_model=lambda: Transformer(cfg), vocab_size=cfg.vocab_size,
                                   seq_len=T, description="tiny llama")


def with_user_policy(workload: Workload) -> Workload:
    """The user's model applies SAC itself (keep every mm's output, recompute the rest);
    batchfit's own --checkpointing stays none."""
    def build_model():
        model = workload.build_model()
        context_fn = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
        for block in model.blocks:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False, context_fn=context_fn)
        return model

    return dataclasses.replace(workload, name="tiny-llama-user-sac", build_model=build_model)


class KeptTracker(MemoryTracker):
    """Also notes what the forward left alive when backward starts (what it saved), by block."""

    def phase(self, name: str) -> None:
        if name == "forward":
            self.forward_clock = self.clock
        if name == "backward":
            self.kept = self.alive_since(self.forward_clock)
        super().phase(name)

    def kept_by_block(self) -> dict[int, list[tuple[str, tuple[int, ...], int]]]:
        """Block index -> [(op, shape, bytes)] of what that block's forward left alive."""
        out = defaultdict(list)
        for record in self.kept:
            parts = (record.module or "").split(".")
            if parts[0] == "blocks":
                out[int(parts[1])].append((record.op, record.shape, record.nbytes))
        return dict(out)


def kept(workload: Workload, checkpointing: str, *, cuda_semantics: bool = False) -> KeptTracker:
    tracker = KeptTracker(round_bytes=512 if cuda_semantics else 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        TraceSession(workload, StepOptions(checkpointing=checkpointing), cuda_semantics=cuda_semantics,
                     tracker=tracker).trace(B)
    return tracker


def block_bytes(tracker: KeptTracker) -> list[int]:
    return [sum(nbytes for *_, nbytes in records) for _, records in sorted(tracker.kept_by_block().items())]


def profiled_peak(workload: Workload, options: StepOptions, batch_size: int, tmp_path) -> int:
    return profiled_step_peak(TrainingStep(workload, options, torch.device("cpu")), batch_size, tmp_path)


@pytest.mark.parametrize("value", ["none", "full", "selective", "every:1", "every:2", "every:12"])
def test_valid_checkpointing_values(value):
    assert StepOptions(checkpointing=value).checkpointing == value


@pytest.mark.parametrize("value", ["x", "Full", "op", "every:0", "every:-2", "every:", "every:two", "every:2.5",
                                   " every:2", "every:٣"])
def test_an_unknown_checkpointing_value_lists_the_valid_ones(value):
    with pytest.raises(OptionError) as error:
        StepOptions(checkpointing=value)
    assert str(error.value) == (f"unknown checkpointing '{value}': use none, full, selective or every:N "
                                "(e.g. every:2), N a positive integer")


def test_a_policy_needs_a_stack_of_blocks(mlp):
    with pytest.raises(OptionError, match="`checkpointing` every:2 needs a model with an nn.ModuleList"):
        TrainingStep(mlp, StepOptions(checkpointing="every:2"), torch.device("cpu"))


def test_every_n_checkpoints_blocks_as_torchtitan_counts_them():
    """torchtitan's layer SAC counts blocks from 1 and wraps those where count % N == 0."""
    def blocks(policy: str, count: int) -> list[int]:
        return checkpointed_blocks(Checkpointing.parse(policy), count)

    assert blocks("every:2", 4) == [1, 3]
    assert blocks("every:3", 7) == [2, 5]
    assert blocks("every:1", 3) == blocks("full", 3) == [0, 1, 2]
    assert blocks("every:5", 4) == []


def test_selective_saves_the_attention_kernels_whichever_the_trace_runs():
    aten = torch.ops.aten
    assert {aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default, aten.mm.default, aten.max.default} <= save_ops()


@pytest.mark.parametrize("command", ["estimate", "plan"])
def test_the_cli_says_what_to_type_for_a_bad_value(command):
    """estimate and plan share the option (cli/common.py): one line, exit code 2, no traceback."""
    from typer.testing import CliRunner

    from batchfit.cli.app import app

    result = CliRunner().invoke(app, [command, "gpt-tinystories-22m", "--gpu", "h100-80gb", "--checkpointing",
                                      "every:0"])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "use none, full, selective or every:N (e.g. every:2)" in errors[0]
    assert "Traceback" not in result.output


# -- kept bytes by hand -----------------------------------------------------------------------

def test_kept_bytes_by_hand_for_each_policy():
    """What each block's forward leaves alive for backward, in bytes worked out above."""
    workload = tiny()
    none, full, every2, selective = (kept(workload, c) for c in ("none", "full", "every:2", "selective"))
    # full: only the block's output (the next block's, or the final norm's, saved input).
    assert block_bytes(full) == [BLOCK_OUT] * 4
    # every:2 on 4 blocks checkpoints blocks 1 and 3: blocks 0 and 2 keep exactly what they keep
    # without checkpointing, op for op; blocks 1 and 3 what full keeps.
    assert [every2.kept_by_block()[i] for i in (0, 2)] == [none.kept_by_block()[i] for i in (0, 2)]
    assert [every2.kept_by_block()[i] for i in (1, 3)] == [full.kept_by_block()[i] for i in (1, 3)]
    assert block_bytes(every2)[1] < block_bytes(every2)[0] == block_bytes(none)[0]
    # selective (torchtitan): the 1st and 3rd matmul (qkv, up), the attention output and its
    # logsumexp, and the block output; the 2nd and 4th matmul (out-projection, down) are recomputed.
    assert block_bytes(selective) == [QKV + ATTN_OUT + LSE + UP + BLOCK_OUT] * 4 == [2_891_776] * 4
    assert sorted(op for op, *_ in selective.kept_by_block()[0]) == sorted(
        ["mm", "mm", "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu",
         "add"])


def test_a_users_own_sac_policy_keeps_what_it_names():
    """The user's policy saves every mm: all four matmuls of each block, plus its output."""
    tracker = kept(with_user_policy(tiny()), "none")
    assert block_bytes(tracker) == [QKV + PROJ + UP + DOWN + BLOCK_OUT] * 4 == [3_145_728] * 4


# -- against the CPU profiler -----------------------------------------------------------------

@pytest.mark.parametrize("checkpointing", ["full", "every:2", "selective", "user-policy"])
def test_traced_peak_matches_the_profiler_on_a_real_cpu_step(checkpointing, tmp_path):
    """An independent measurement: the torch profiler's memory timeline of the same real CPU
    step, within 1% (byte-exact but for a few bytes of scalars today)."""
    workload = with_user_policy(tiny()) if checkpointing == "user-policy" else tiny()
    options = StepOptions(checkpointing="none" if checkpointing == "user-policy" else checkpointing)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = TraceSession(workload, options, cuda_semantics=False).trace(B).snapshot.peak_bytes
    measured = profiled_peak(workload, options, B, tmp_path)
    assert abs(traced - measured) / measured < 0.01


# -- the CUDA trace ---------------------------------------------------------------------------

def _cuda_flash(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return torch.ops.aten._scaled_dot_product_flash_attention.default(q, k, v, dropout_p, is_causal, False,
                                                                      scale=scale)[0]


def _cuda_efficient(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return torch.ops.aten._scaled_dot_product_efficient_attention.default(q, k, v, attn_mask, True, dropout_p,
                                                                          is_causal, scale=scale)[0]


@pytest.mark.parametrize("mirror", ["cpu-flash", "cuda-flash", "cuda-efficient"])
def test_the_cuda_trace_of_selective_keeps_the_attention_output(mirror, monkeypatch):
    """Traced for a GPU, selective keeps each block's attention output and fp32 logsumexp,
    whichever op the trace's attention mirror runs (today PyTorch's CPU flash kernel; the
    CUDA flash or memory-efficient op on fake tensors, as a GPU does)."""
    from batchfit.trace import cuda_attention

    if mirror != "cpu-flash":
        monkeypatch.setattr(cuda_attention, "_sdpa_as_on_cuda", _cuda_flash if mirror == "cuda-flash"
                            else _cuda_efficient)
    tracker = kept(tiny(), "selective", cuda_semantics=True)
    for block, records in tracker.kept_by_block().items():
        attention = {(shape, nbytes) for op, shape, nbytes in records
                     if op.startswith("_scaled_dot_product") or op == "cuda_efficient_attention"}
        assert {((B, H, T, HD), rounded(ATTN_OUT)), ((B, H, T), rounded(LSE))} <= attention, block
        matmuls = sorted(nbytes for op, _, nbytes in records if op == "mm")
        assert matmuls == [QKV, UP]  # multiples of 512 already


# -- deep models: tracing by depth ------------------------------------------------------------

@pytest.mark.parametrize("checkpointing", [pytest.param("every:5", marks=pytest.mark.slow), "selective"])
def test_a_deep_model_is_traced_whole_where_blocks_differ_by_position(checkpointing):
    """every:5 on 12 blocks checkpoints blocks 4 and 9: the stack cut to 2, 3 and 4 blocks has
    none of them and extrapolated as if nothing were checkpointed (12% high). Selective treats
    every block alike, so the extrapolation stays exact."""
    from batchfit import get_device
    from batchfit.trace.point import TracedCurve

    workload, options, device = tiny(12), StepOptions(checkpointing=checkpointing), get_device("h100-80gb")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with TracedCurve(workload, options, device, parallel=False) as curve:
            point = curve.point(B)
            assert curve.by_depth == (checkpointing == "selective")
        whole = TraceSession(workload, options).trace(B).snapshot.peak_bytes
    assert point.peak_bytes - device.workspace_bytes == whole


def test_plan_traces_every_n_whole_on_each_rank():
    """The same for plan's rank 0 under FSDP on 2 GPUs: extrapolated from depths 2-4, every:5
    said 165,942,784 B (the peak without checkpointing) where the whole model holds 153,335,296 B
    (when this was written)."""
    from batchfit import get_device
    from batchfit.plan.deep import DeepSession
    from batchfit.plan.sharded import parse_strategy, trace_sharded

    workload, options, device = tiny(12), StepOptions(checkpointing="every:5"), get_device("h100-80gb")
    strategy = parse_strategy("fsdp", 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with DeepSession(workload, options, device, strategy) as deep:
            point = deep.trace(B)
            assert deep.blocks is None  # not cut
        whole = trace_sharded(workload, options, device, strategy, B)
    assert point.peak_bytes == whole.peak_bytes
