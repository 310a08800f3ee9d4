"""Rank 0 of a sharded step traced on the fake process group, against real gloo runs on CPU.

Truth without a GPU: real processes (2 and 4) on the CPU over gloo run the same strategy
code (``plan/_parallel.py``) on real tensors; rank 0's peak in a steady step (the third:
DDP rebuilds its buckets in the second) is measured by the torch profiler's memory
timeline, independently of the tracer, and compared with ``trace_sharded`` at the same
world size and local batch, traced with CPU semantics (no CUDA rounding, CPU kernels).
Collective bytes are checked against the closed form, computed from parameter shapes.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from batchfit.devices import get_device
from batchfit.errors import OptionError
from batchfit.plan.sharded import Collective, Strategy, parse_strategies, parse_strategy, trace_sharded
from batchfit.step import TrainingStep
from batchfit.workload import StepOptions, Workload
from batchfit.zoo import language_model_workload
from batchfit.zoo.transformer import Transformer, TransformerConfig

# Llama blocks (RMSNorm, SwiGLU, RoPE, GQA), untied head: every parameter's first dimension
# divides by 4, so FSDP shards are exact (no padding) on 2 and 4 ranks.
CFG = TransformerConfig(vocab_size=512, seq_len=64, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=256,
                        llama=True, tied_embeddings=False)
LOCAL_BATCH = 4
OPTIONS = StepOptions()  # fp32, AdamW
MEASURED = {2: ("ddp", "fsdp"), 4: ("fsdp+tp2", "fsdp")}


def tiny_workload() -> Workload:
    return language_model_workload(name="tiny-llama", build_model=lambda: Transformer(CFG),
                                   vocab_size=CFG.vocab_size, seq_len=CFG.seq_len, description="tiny llama")


# --- the real runs -----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _profiled_peak(step: TrainingStep, path: str) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        step.run(LOCAL_BATCH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        prof.export_memory_timeline(path, device="cpu")
    with open(path) as f:
        _, sizes = json.load(f)
    return max(sum(row) for row in sizes)


def _gloo_main(rank: int, world_size: int, port: int, out_dir: str) -> None:
    from batchfit.plan._parallel import apply_strategy, build_meshes
    from batchfit.plan.tp_plans import tp_plan

    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    peaks = {}
    for name in MEASURED[world_size]:
        strategy = parse_strategy(name, world_size)
        meshes = build_meshes(strategy)
        torch.manual_seed(0)
        step = TrainingStep(tiny_workload(), OPTIONS, torch.device("cpu"),
                            wrap=lambda m: apply_strategy(m, strategy, meshes, precision=OPTIONS.precision,
                                                          fake=False, parallelize=tp_plan(m)))
        step.run(LOCAL_BATCH)
        step.run(LOCAL_BATCH)  # DDP rebuilds its buckets here
        if rank == 0:
            peaks[name] = _profiled_peak(step, os.path.join(out_dir, f"timeline-{name}.json"))
        else:
            step.run(LOCAL_BATCH)
        del step
        dist.barrier()
    if rank == 0:
        with open(os.path.join(out_dir, "peaks.json"), "w") as f:
            json.dump(peaks, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[int, dict[str, int]]:
    """Rank 0's profiled peak of a steady step, by world size and strategy."""
    out = {}
    for world_size in MEASURED:
        path = tmp_path_factory.mktemp(f"gloo{world_size}")
        torch.multiprocessing.spawn(_gloo_main, args=(world_size, _free_port(), str(path)), nprocs=world_size,
                                    join=True)
        out[world_size] = json.loads((path / "peaks.json").read_text())
    return out


@pytest.mark.parametrize("world_size,name", [(w, n) for w, names in MEASURED.items() for n in names])
def test_traced_rank0_peak_matches_a_real_gloo_run(measured, world_size, name):
    real = measured[world_size][name]
    point = trace_sharded(tiny_workload(), OPTIONS, get_device("h100-80gb"), parse_strategy(name, world_size),
                          LOCAL_BATCH, cuda_semantics=False)
    assert point.breakdown["workspace"] == 0
    print("PEAKS", world_size, name, point.peak_bytes, real, (point.peak_bytes - real) / real, point.phase)
    assert abs(point.peak_bytes - real) / real < 0.02, (point.peak_bytes, real)
