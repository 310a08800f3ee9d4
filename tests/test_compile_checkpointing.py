"""torch.compile with activation checkpointing (torchtune's and torchtitan's default recipe: bf16,
compile, full checkpointing): dynamo traces ``torch.utils.checkpoint`` into the graph, AOTAutograd's
partitioner recomputes the region in backward and wraps each random op of it (every SDPA kernel
counts as one: it takes a dropout) in ``run_and_save_rng_state`` / ``run_with_rng_state``. The trace
counts those as the op they wrap, and runs each graph that recomputes as inductor's own wrapper code
(``trace/compiled.py: recomputes``): the bytes against the same step compiled by inductor on this CPU.

Checked against torch's own code running for real (inductor's compiled step with checkpointing on this CPU, the
profiler's timeline)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state
from torch._subclasses.fake_tensor import FakeTensorMode

from batchfit.specs import load_workload
from batchfit.trace.compiled import CHECKPOINTED_TRACED, COMPILED_TRACED
from batchfit.trace.memory import MemoryTracker
from batchfit.trace.session import TraceSession
from batchfit.train.step import TrainingStep
from batchfit.workload import StepOptions
from cpu_truth import profiled_step_peak, same_kernels_on_any_x86

ATTENTION_FILE = """\
import torch
from torch import nn
import torch.nn.functional as F
from batchfit import Workload

DROPOUT = 0.0

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(64, 192), nn.Linear(64, 64)
        self.up, self.down = nn.Linear(64, 128), nn.Linear(128, 64)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 4, 16).permute(2, 0, 3, 1, 4)
        x = x + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, 64))
        return x + self.down(F.dropout(F.gelu(self.up(x)), DROPOUT, self.training))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x

def blocks_compiled():
    net = Net()
    for block in net.blocks:
        block.compile()
    return net

def workload():
    return Workload(name='attention', build_model=Net, make_batch=lambda b, d: torch.randn(b, 32, 64, device=d),
                    loss_fn=lambda m, x: m(x).square().mean())

def dropout_workload():
    global DROPOUT
    DROPOUT = 0.1
    return workload()

def compiled_workload():
    return Workload(name='attention', build_model=blocks_compiled,
                    make_batch=lambda b, d: torch.randn(b, 32, 64, device=d), loss_fn=lambda m, x: m(x).square().mean())
"""


def attention_workload(tmp_path: Path, name: str = "workload"):
    (tmp_path / "attention.py").write_text(ATTENTION_FILE)
    return load_workload(f"{tmp_path}/attention.py:{name}")


@pytest.mark.parametrize("cuda, state_bytes, out_bytes", [(False, 5056, 4000 + 1000), (True, 0, 4096 + 1024)])
def test_a_random_op_wrapped_for_recomputation_is_counted_as_the_op(cuda, state_bytes, out_bytes):
    """native_dropout of 1,000 floats: its output (4,000 B) and mask (1,000 B), and the generator's
    state saved for backward (torch.get_rng_state(): 5,056 B on a CPU; a host tensor, or the generator
    itself, on a GPU). The tracker refused every higher-order operator before (NotImplementedError:
    no rule registered for HigherOrderOperator run_and_save_rng_state and mode MemoryTracker)."""
    dropout = torch.ops.aten.native_dropout.default
    with FakeTensorMode(allow_non_fake_inputs=True), MemoryTracker(round_bytes=512 if cuda else 1) as tracker:
        x = torch.empty(1000)
        before = tracker.live_bytes
        state, (out, mask) = run_and_save_rng_state(dropout, x, 0.5, True)
        assert tracker.live_bytes - before == state_bytes + out_bytes and state.numel() == 5056
        again = run_with_rng_state(state, dropout, x, 0.5, True)  # backward's recomputation
        assert tracker.live_bytes - before == state_bytes + 2 * out_bytes
        del out, mask, again
        assert tracker.live_bytes - before == state_bytes


@pytest.mark.parametrize("compile_, checkpointing", [
    pytest.param("model", "full", marks=pytest.mark.slow), ("blocks", "selective")])
def test_bf16_compile_and_checkpointing_trace_for_a_gpu_and_say_so(tmp_path, compile_, checkpointing):
    """The issue's crash: SDPA inside a checkpointed block of a compiled model, traced for a GPU
    (NotImplementedError: no rule registered for HigherOrderOperator run_and_save_rng_state)."""
    from batchfit.trace.compiled import checkpointed_approximations, recomputing_graphs

    options = StepOptions(compile=compile_, checkpointing=checkpointing, precision="bf16-mixed")
    with TraceSession(attention_workload(tmp_path), options) as session:
        assert session.compiled and session.trace(64).snapshot.peak_bytes > 0
    assert recomputing_graphs() == (2 if compile_ == "model" else 4)  # forward and backward of each graph
    [said] = checkpointed_approximations(f"--compile {compile_}", checkpointing=checkpointing)
    assert said.what == CHECKPOINTED_TRACED.what
    assert said.detail == f"--compile {compile_} --checkpointing {checkpointing}"


@pytest.mark.slow
def test_estimate_says_the_checkpointed_graphs_ran_inductors_code(tmp_path):
    from batchfit import get_device
    from batchfit.estimator.engine import estimate

    options = StepOptions(compile="model", checkpointing="full", precision="bf16-mixed")
    result = estimate(attention_workload(tmp_path), device=get_device("a100-80gb"), options=options,
                      batch_sizes=[64], suggest=False, limit="allocated").to_json()
    assert [a["what"] for a in result["approximations"]] == [COMPILED_TRACED.what, CHECKPOINTED_TRACED.what]
    assert result["approximations"][1]["detail"] == "--compile model --checkpointing full"


def test_the_checkpointed_compiled_trace_matches_inductor_on_cpu(tmp_path):
    """The truth: the same step compiled by inductor on this CPU, measured by the profiler. Op by op,
    with batchfit's fusion model, the trace was -17.7% on a 2-layer Llama (--checkpointing full)."""
    workload = attention_workload(tmp_path)
    options = StepOptions(compile="model", checkpointing="full")
    with TraceSession(workload, options, cuda_semantics=False) as session:
        traced = session.trace(64).snapshot.peak_bytes
    with same_kernels_on_any_x86():
        truth = profiled_step_peak(TrainingStep(workload, options, torch.device("cpu")), 64, tmp_path, warmup=2)
    assert abs(traced - truth) / truth < 0.02, (traced, truth)


LLAMA_FILE = """\
import torch
from batchfit import Workload

def build():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                        attn_implementation="{attention}", use_cache=False))

def workload():
    return Workload(name="llama-2l", build_model=build,
                    make_batch=lambda b, d: torch.randint(0, 512, (b, 128), device=d),
                    loss_fn=lambda m, x: m(input_ids=x, labels=x).loss, tokens_per_sample=128)
"""


def _traced_and_truth(workload, options: StepOptions, batch_size: int, tmp_path: Path) -> tuple[int, int]:
    # Each cell from dynamo's fresh state, as a command runs: in a full slow-tier run (2026-11-28, one
    # xdist worker after many compiled tests) the dropout cell's trace failed in dynamo with
    # "lift_tracked_freevar_to_input should not be called on root SubgraphTracer", and passed alone.
    # Cause not traced down: a batchfit command compiles one model per process.
    torch._dynamo.reset()
    with TraceSession(workload, options, cuda_semantics=False) as session:
        traced = session.trace(batch_size).snapshot.peak_bytes
    with same_kernels_on_any_x86():
        truth = profiled_step_peak(TrainingStep(workload, options, torch.device("cpu")), batch_size, tmp_path, warmup=2)
    return traced, truth


@pytest.mark.slow
@pytest.mark.parametrize("attention, compile_, checkpointing, precision", [
    ("sdpa", "model", "full", "bf16-mixed"),  # torchtune's and torchtitan's recipe: -18.8% op by op
    ("eager", "blocks", "every:2", "fp32"),  # graphs that recompute beside one that does not: +6.3% mixed
    ("eager", "model", "selective", "bf16-mixed"),  # -8.1% op by op
])
def test_a_checkpointed_compiled_llama_matches_inductor_on_cpu(tmp_path, attention, compile_, checkpointing, precision):
    """benchmarks/compiled_checkpointing.py's model (HF Llama, 2 layers), a few of its cells."""
    (tmp_path / "llama.py").write_text(LLAMA_FILE.format(attention=attention))
    workload = load_workload(f"{tmp_path}/llama.py:workload")
    options = StepOptions(compile=compile_, checkpointing=checkpointing, precision=precision)
    traced, truth = _traced_and_truth(workload, options, 4, tmp_path)
    assert abs(traced - truth) / truth < 0.02, (traced, truth)


@pytest.mark.slow
def test_dropout_in_a_checkpointed_compiled_block(tmp_path):
    """A random op of its own in the region (GPT-2's dropout): inductor's joint-graph passes replace it
    with its seeded random, and read V.fake_mode, which the trace sets around them (TypeError:
    'NullHandler' object does not support the context manager protocol, before)."""
    workload = attention_workload(tmp_path, "dropout_workload")
    options = StepOptions(compile="model", checkpointing="full")
    traced, truth = _traced_and_truth(workload, options, 64, tmp_path)
    assert abs(traced - truth) / truth < 0.02, (traced, truth)


@pytest.mark.slow
def test_a_workload_that_compiles_its_own_blocks_is_traced_checkpointed(tmp_path):
    """block.compile() in the workload, --checkpointing full from batchfit: the checkpoint is traced into
    each block's graph, as with --compile blocks."""
    workload = attention_workload(tmp_path, "compiled_workload")
    options = StepOptions(checkpointing="full")
    traced, truth = _traced_and_truth(workload, options, 64, tmp_path)
    assert abs(traced - truth) / truth < 0.02, (traced, truth)


def test_the_stated_range_is_the_measured_one():
    """CHECKPOINTED_TRACED's range: benchmarks/compiled_checkpointing.py's rows, rounded; each within 2%."""
    rows = json.loads((Path(__file__).parent.parent / CHECKPOINTED_TRACED.source.split("; ")[1]).read_text())["rows"]
    errors = [row["error"] for row in rows]
    assert CHECKPOINTED_TRACED.may_differ_by.startswith(f"{min(errors):+.2%} to {max(errors):+.2%} ")
    assert all(abs(error) < 0.02 for error in errors)
    assert {(row["attention"], row["compile"]) for row in rows} == {(a, c) for a in ("sdpa", "eager")
                                                                    for c in ("model", "blocks")}
