"""The real pipeline that tests/test_pipeline.py and tests/test_pipeline_hf.py hold the trace to: torch's own
pipelining (``PipelineStage`` and its schedule classes) run by real processes on the CPU over gloo, on the
stages batchfit cuts (``distributed/pipeline.py``) and places (``pp_schedules.rank_stages``); each rank's
peak over a steady step is the torch profiler's memory timeline (``cpu_truth.agreed_profiled_peak``), and
the compute order the one torch's runtime ran (``pipeline_order_with_comms``)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from batchfit.options import Checkpointing
from batchfit.train.step import TrainingStep
from batchfit.workload import StepOptions, Workload
from batchfit.zoo.transformer import TransformerConfig
from cpu_truth import join_gloo, spawn_profiled_gloo, tiny_llama_workload

CFG = TransformerConfig(vocab_size=256, seq_len=32, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=128,
                        llama=True, tied_embeddings=False)
MICRO = 2
MICROBATCHES = 4
WORLD = 2


def pipeline_workload(n_layers: int = CFG.n_layers) -> Workload:
    """The 4-block Llama of the pipeline truths (``n_layers`` blocks)."""
    return tiny_llama_workload(dataclasses.replace(CFG, n_layers=n_layers))


def real_schedule(name: str, stages: list, microbatches: int, **kw):
    """torch's schedule object for ``--pp-schedule name`` over this rank's ``PipelineStage``s."""
    from torch.distributed.pipelining import schedules as S

    from batchfit.distributed.pp_schedules import KINDS, parse_schedule

    kind = KINDS[parse_schedule(name).kind]
    cls = getattr(S, kind.torch_class)
    return cls(stages[0] if kind.stages_per_rank == 1 else stages, microbatches, **kw)


def compute_order(schedule, rank: int) -> list[tuple[str, int, int]]:
    """The compute actions torch's runtime runs on ``rank`` (its ``pipeline_order_with_comms``,
    OVERLAP_F_B's forward then backward), as ``rank_actions`` writes them."""
    from torch.distributed.pipelining import schedules as S

    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W",
             "REDUCE_GRAD": "R"}
    out = []
    for action in schedule.pipeline_order_with_comms[rank]:
        for a in action.sub_actions if action.computation_type == S.OVERLAP_F_B else (action,):
            kind = kinds.get(a.computation_type.name)
            if kind is not None:
                out.append((kind, a.stage_index, -1 if kind == "R" else a.microbatch_index))
    return out


def run_key(name: str, checkpointing: str) -> str:
    return name if checkpointing == "none" else f"{name} --checkpointing {checkpointing}"


def pipeline_gloo_main(rank: int, port: int, out_dir: str, world: int = WORLD, microbatches: int = MICROBATCHES,
               runs: tuple[tuple[str, str], ...] = (), n_layers: int = CFG.n_layers,
               hf_config: str | None = None) -> None:
    """Rank ``rank`` of a real ``world``-rank pipeline: its peak per (schedule, checkpointing) in
    peaks<rank>.json, and the compute order torch's runtime ran (multi-stage schedules). With
    ``hf_config`` (a config.json path) the model is that HF causal LM (``tests/test_pipeline_hf.py``),
    its loss the causal LM's own."""
    from torch.distributed.pipelining import PipelineStage

    from batchfit.distributed.pipeline import build_rank
    from batchfit.distributed.pipeline_hf import hf_stage_loss
    from batchfit.distributed.pipeline_run import stage_batch
    from batchfit.distributed.pp_schedules import parse_schedule, rank_stages
    from batchfit.zoo.hf import hf_workload
    from cpu_truth import agreed_profiled_peak

    join_gloo(rank, world, port, timeout_s=120)
    peaks, orders = {}, {}
    for name, checkpointing in runs:
        schedule = parse_schedule(name, microbatches)
        n_stages = world * schedule.virtual
        indices = rank_stages(schedule, world, rank)
        base = pipeline_workload(n_layers) if hf_config is None else hf_workload(hf_config, seq_len=CFG.seq_len)
        workload = dataclasses.replace(base, build_model=lambda: build_rank(base.build_model, n_stages, indices,
                                                                            Checkpointing.parse(checkpointing)))
        torch.manual_seed(0)
        step = TrainingStep(workload, StepOptions(), torch.device("cpu"))
        stages = [PipelineStage(module, s, n_stages, torch.device("cpu"))
                  for module, s in zip(step.model.stages, step.model.stage_indices)]

        def loss_fn(logits, y, _stage=step.model.stages[0]):
            if hf_config is not None:  # the causal LM's own loss (each stage module is the causal LM, cut)
                return hf_stage_loss(_stage, logits, y)
            return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

        runtime = real_schedule(name, stages, microbatches, loss_fn=loss_fn)
        x, y = stage_batch(workload.make_batch(MICRO * microbatches, torch.device("cpu")))
        x = x if 0 in indices else None
        y = y if n_stages - 1 in indices else None

        def run(batch_size, hooks=None, _schedule=runtime, _step=step, _x=x, _y=y):
            _schedule.step(*(() if _x is None else (_x,)), target=_y, return_outputs=False)
            _step.optimizer.step()
            _step.optimizer.zero_grad(set_to_none=True)

        step.run = run
        run(MICRO)  # builds the stage's buffers and the optimizer state
        # two profiled steps: the V-shaped ranks' local buffers, made by one step and replaced in the next
        peaks[run_key(name, checkpointing)] = agreed_profiled_peak(step, MICRO, Path(out_dir) / str(rank), warmup=0,
                                                                steps=2)
        if hasattr(runtime, "pipeline_order_with_comms"):
            orders[name] = compute_order(runtime, rank)
        dist.barrier()
    with open(os.path.join(out_dir, f"peaks{rank}.json"), "w") as f:
        json.dump({"peaks": peaks, "orders": orders}, f)
    dist.barrier()
    dist.destroy_process_group()


def measure_pipeline(tmp_path_factory, runs: tuple[tuple[str, str], ...], *, n_layers: int = CFG.n_layers,
             hf_config: str | None = None) -> dict:
    path = tmp_path_factory.mktemp("pp-gloo")
    for rank in range(WORLD):
        (path / str(rank)).mkdir()
    spawn_profiled_gloo(pipeline_gloo_main,
                        lambda port: (port, str(path), WORLD, MICROBATCHES, runs, n_layers, hf_config), nprocs=WORLD)
    return {rank: json.loads((path / f"peaks{rank}.json").read_text()) for rank in range(WORLD)}
