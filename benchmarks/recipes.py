"""The recipes people train with, traced against a real CPU step: the traced peak (CPU semantics:
no 512 B rounding, CPU kernels) against the torch profiler's memory timeline of the same step.

One row per recipe: (recipe, traced bytes, CPU truth bytes, error). The model is the zoo's
gpt-tinystories-22m (Llama-style: 4 blocks, d 512, 16 heads, SwiGLU 1344, no biases, vocab
10000), fp32 AdamW, batch 4 x 256 tokens. Writes benchmarks/results/recipes-<date>.json.

    python benchmarks/recipes.py [--model gpt-tinystories-22m] [--batch-size 4] [--seq-len 256]
        [--recipes NAME,NAME] [--result-name recipes-BRANCH]

Checkpointing recipes: none, full, every:2 (torchtitan's layer AC: blocks 1 and 3 of 4),
selective (torchtitan's per-op SAC), and a user's own ``create_selective_checkpoint_contexts``
policy that keeps every mm output (the model applies it; --checkpointing stays none). That one
calls checkpoint() with its default preserve_rng_state=True, so the real CPU step also keeps the
CPU generator's state (5,056 bytes) per block: host memory on a GPU, not counted by the trace.

``optimizer muon`` (``train/muon.py``): torch.optim.Muon for the hidden matrices, AdamW for the
embeddings, head and norms. zero1 / zero2 need several processes: benchmarks/zero_gloo.py.

Loss recipes (``train/losses.py``): chunked:8 (torchtune's chunked cross-entropy) and
fused-linear (a torch-native mirror of Liger's fused linear cross-entropy), in fp32 and under
bf16-mixed autocast (CPU autocast on both sides: the trace runs with CPU semantics); the
"checkpointing none" row is the fp32 plain loss.

float8 recipes (``train/float8.py``, torchao's convert_to_float8_training): fp8-tensorwise and
fp8-rowwise, the rest bf16-mixed; "bf16-mixed loss plain" is their baseline. torch._scaled_mm runs
on this CPU as an fp32 emulation whose scratch the CPU-semantics trace runs op by op
(``trace/cuda_float8.py``). The "fsdp2 x2" rows (in ``DISTRIBUTED``) are rank 0 of a real 2-process gloo run (FSDP2,
float8 all-gather for tensorwise) against ``trace_sharded`` on the fake process group.

    python benchmarks/recipes.py --recipes "bf16-mixed loss plain,fp8-tensorwise,fp8-rowwise,fsdp2 x2 fp8-tensorwise,fsdp2 x2 fp8-rowwise" --name recipes-fp8

Offload recipes (``train/offload.py``, ``--offload activations``): torchtune's / TRL's saved-tensor
hooks; a CPU holds host and device alike, so the traced figure is the most device + host bytes
alive at once (``Snapshot.total_peak_bytes``) against the profiler's total. ``offload params``
(FSDP2's CPUOffloadPolicy) is a real 2-process gloo run of tests/test_offload_fsdp.py's tiny
Llama (fsdp on 2 ranks, rank 0 profiled) against rank 0's traced device + host total.

    python benchmarks/recipes.py --only offload --name recipes-offload   # these rows only

Multi-GPU recipes (``DISTRIBUTED``): rank 0 of 2 traced on the fake process group against a
real 2-process gloo run on this CPU (rank 0's profiled third step, or fourth with the
timeline's data-flow checks relaxed where they trip: ``_lenient_data_flow_checks``): tp2 with the vocabulary-
sharded loss (loss_parallel, the default) and with the gathered logits, FSDP2 with chunked:8,
DDP with fused-linear; fsdp+cp2 (context parallelism, torch's ring attention with the CPU flash kernel
added to its table: ``distributed/context_parallel.py``), fp32 and bf16-mixed.

torch.compile recipes (``trace/compiled.py``): --compile model in fp32, under bf16-mixed, and
with --memory-budget 0.5; the truth is the same step compiled with inductor on this CPU (the
third step: inductor compiles in the first).

plan's compiled ranks (``DISTRIBUTED``, "compile-plan ..."): fsdp-noreshard, hsdp2, ddp, zero1, zero2
under --compile blocks, ddp under --compile model (dynamo's DDPOptimizer cuts the graph at DDP's
buckets: a 1 MiB first bucket, then 25 MiB), tp2 under --compile model; rank 0 traced on the fake
process group against rank 0 of a real 2-process gloo run compiled with inductor.

    python benchmarks/recipes.py --only compile-plan --name recipes-cddp
"""  # noqa: E501 - a command line to copy whole

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from _common import write_result
from batchfit.trace.session import TraceSession
from batchfit.train.model import block_list
from batchfit.train.step import TrainingStep
from batchfit.workload import StepOptions, Workload
from batchfit.zoo import ZOO


def user_sac(workload: Workload) -> Workload:
    """The user's model wraps each block in checkpoint() with its own SAC policy: save mm outputs."""
    def build_model():
        model = workload.build_model()
        context_fn = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
        for block in block_list(model):
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False, context_fn=context_fn)
        return model

    return dataclasses.replace(workload, build_model=build_model)


def hf_llama(workload: Workload) -> Workload:
    """A small HF Llama (LlamaConfig: 2 layers, hidden 256, vocab 2048) at the base's sequence
    length: the QLoRA rows' model, built with transformers as a QLoRA user's is."""
    seq = workload.tokens_per_sample or 256

    def build_model():
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                            max_position_embeddings=seq, attn_implementation="sdpa"))

    return Workload(name="hf-llama-2x256", build_model=build_model,
                    make_batch=lambda b, d: torch.randint(0, 2048, (b, seq), device=d),
                    loss_fn=lambda m, x: m(input_ids=x, labels=x).loss, tokens_per_sample=seq)


# recipe -> (how the workload changes, the step options)
RECIPES: dict[str, tuple[Callable[[Workload], Workload], StepOptions]] = {
    "checkpointing none": (lambda w: w, StepOptions(checkpointing="none")),
    "checkpointing full": (lambda w: w, StepOptions(checkpointing="full")),
    "checkpointing every:2": (lambda w: w, StepOptions(checkpointing="every:2")),
    "checkpointing selective": (lambda w: w, StepOptions(checkpointing="selective")),
    "user SAC policy (save mm)": (user_sac, StepOptions(checkpointing="none")),
    "loss chunked:8": (lambda w: w, StepOptions(loss="chunked:8")),
    "loss fused-linear": (lambda w: w, StepOptions(loss="fused-linear")),
    "bf16-mixed loss plain": (lambda w: w, StepOptions(precision="bf16-mixed")),
    "bf16-mixed loss chunked:8": (lambda w: w, StepOptions(precision="bf16-mixed", loss="chunked:8")),
    "bf16-mixed loss fused-linear": (lambda w: w, StepOptions(precision="bf16-mixed", loss="fused-linear")),
    "optimizer muon": (lambda w: w, StepOptions(optimizer="muon")),
    "fp8-tensorwise": (lambda w: w, StepOptions(precision="fp8-tensorwise")),
    "fp8-rowwise": (lambda w: w, StepOptions(precision="fp8-rowwise")),
    "offload activations": (lambda w: w, StepOptions(offload="activations")),
    "offload activations + checkpointing full": (lambda w: w, StepOptions(offload="activations", checkpointing="full")),
    "bf16-mixed offload activations": (lambda w: w, StepOptions(precision="bf16-mixed", offload="activations")),
    # QLoRA (--quantize, --lora, bitsandbytes' optimizers: the [quant] extra) on a small HF Llama;
    # bitsandbytes' paged optimizers run unpaged on the CPU (its own fallback), so the paged row's
    # truth is the unpaged step (on CUDA the paged state is reported apart: paged_bytes).
    "qlora nf4 r16 paged-adamw-8bit": (hf_llama, StepOptions(quantize="nf4", lora="r=16",
                                                             optimizer="paged-adamw-8bit")),
    "qlora nf4-dq r16 bf16-mixed": (hf_llama, StepOptions(quantize="nf4-dq", lora="r=16", optimizer="paged-adamw-8bit",
                                                          precision="bf16-mixed")),
    "full fine-tune adamw-8bit": (hf_llama, StepOptions(optimizer="adamw-8bit")),
    "compile model": (lambda w: w, StepOptions(compile="model")),
    "bf16-mixed compile model": (lambda w: w, StepOptions(precision="bf16-mixed", compile="model")),
    "compile model memory-budget 0.5": (lambda w: w, StepOptions(compile="model", memory_budget=0.5)),
    "compile model memory-budget 0.1": (lambda w: w, StepOptions(compile="model", memory_budget=0.1)),
    "fp8-tensorwise compile model": (lambda w: w, StepOptions(precision="fp8-tensorwise", compile="model")),
}
GLOO = {"offload params (fsdp on 2 gloo ranks)", "torchtitan debugmodel fsdp (2 gloo ranks)",
        "torchtitan debugmodel tp2 (2 gloo ranks)"}
"""Rows measured by a real multi-process run, not one CPU step."""


def gloo_offload_params() -> tuple[int, int]:
    """(rank 0's traced device + host total, its profiled peak in a real 2-process gloo run)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from cpu_truth import spawn_profiled_gloo
    from test_offload_fsdp import OFFLOAD, _gloo_main, _trace

    with tempfile.TemporaryDirectory() as folder:
        spawn_profiled_gloo(_gloo_main, lambda port: (port, folder), nprocs=2)
        measured = json.loads((Path(folder) / "peak.json").read_text())
    return _trace(OFFLOAD).total_peak_bytes, measured


def gloo_torchtitan(strategy_name: str = "fsdp") -> tuple[int, int]:
    """torchtitan's own debug_model.toml (seq 64, local batch 2) with its parallelize_llama (``strategy_name``
    fsdp: FSDP2 with its bf16 policy; tp2: its apply_tp with loss_parallel; both with its selective AC every
    2nd block) on 2 gloo ranks: (rank 0 traced on the fake process group, the smallest of its three profiled
    steps), as tests/test_torchtitan.py measures fsdp."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from batchfit.devices import get_device
    from batchfit.plan.sharded import parse_strategy, trace_sharded
    from batchfit.specs import load_workload
    from cpu_truth import spawn_profiled_gloo
    from test_torchtitan import DEBUG, LOCAL_BATCH, SEQ, _gloo_main, _options

    with tempfile.TemporaryDirectory() as folder:
        spawn_profiled_gloo(_gloo_main, lambda port: (2, port, folder, strategy_name), nprocs=2)
        measured = json.loads((Path(folder) / "peak.json").read_text())
    workload = load_workload(f"torchtitan:{DEBUG}", seq_len=SEQ, for_plan=True)
    point = trace_sharded(workload, _options(), get_device("h100-80gb"), parse_strategy(strategy_name, 2), LOCAL_BATCH,
                          cuda_semantics=False)
    return point.peak_bytes, measured
# Expert parallelism (ep branch): recipe -> (strategy, routing, precision), on tests/test_expert_parallel.py's
# tiny Qwen3-MoE (not --model: ep needs experts), 2 gloo ranks, the router forced as the routing says;
# benchmarks/ep_gloo.py runs 4 ranks too.
EP_GLOO: dict[str, tuple[str, str, str]] = {
    f"{name} x2 tiny qwen3-moe {routing} {precision}": (name, routing, precision)
    for name in ("ep2+fsdp",) for precision in ("fp32", "bf16-mixed") for routing in ("balanced", "worst")}


def gloo_expert_parallel(name: str) -> tuple[int, int, StepOptions, bool]:
    """(rank 0's traced peak, its profiled peak in a real 2-process gloo run, the options, timeline relaxed)."""
    import sys

    sys.path[:0] = [str(Path(__file__).parents[1] / "tests"), str(Path(__file__).parent)]
    import test_expert_parallel as t

    case = EP_GLOO[name]
    with tempfile.TemporaryDirectory() as folder:
        real = t.run_gloo(Path(folder), 2, (case,), tries=6, lenient=True)
    key = "/".join(case)
    return (t.traced(case[1], case[0], case[2]).peak_bytes, real[0]["peaks"][key], t._options(case[1], case[2]),
            key in real[0]["relaxed"])


# Multi-GPU recipes: recipe -> (strategy on 2 ranks, the step options). Truth is a real 2-process
# gloo run on this CPU (rank 0's profiled step), the trace is rank 0 on the fake process group.
DISTRIBUTED: dict[str, tuple[str, StepOptions]] = {
    "tp2 loss sharded (loss_parallel)": ("tp2", StepOptions(tp_loss="sharded")),
    "tp2 loss gathered": ("tp2", StepOptions(tp_loss="gathered")),
    "fsdp loss chunked:8": ("fsdp", StepOptions(loss="chunked:8")),
    "ddp loss fused-linear": ("ddp", StepOptions(loss="fused-linear")),
    "fsdp2 x2 bf16-mixed": ("fsdp", StepOptions(precision="bf16-mixed")),
    "fsdp2 x2 fp8-tensorwise": ("fsdp", StepOptions(precision="fp8-tensorwise")),
    "fsdp2 x2 fp8-rowwise": ("fsdp", StepOptions(precision="fp8-rowwise")),
    # context parallelism: torch's ring (the CPU flash kernel added to its table), sequence/2 per rank
    "fsdp+cp2 ring attention": ("fsdp+cp2", StepOptions()),
    "fsdp+cp2 ring attention bf16-mixed": ("fsdp+cp2", StepOptions(precision="bf16-mixed")),
    # plan's compiled ranks (trace/compiled.py: sharded_traces_compiled), inductor on both gloo ranks
    "compile-plan blocks fsdp-noreshard": ("fsdp-noreshard", StepOptions(compile="blocks")),
    "compile-plan blocks hsdp2": ("hsdp2", StepOptions(compile="blocks")),
    "compile-plan blocks ddp": ("ddp", StepOptions(compile="blocks")),
    "compile-plan model ddp (cut at its buckets)": ("ddp", StepOptions(compile="model")),
    "compile-plan blocks zero1": ("zero1", StepOptions(compile="blocks")),
    "compile-plan blocks zero2": ("zero2", StepOptions(compile="blocks")),
    "compile-plan model tp2": ("tp2", StepOptions(compile="model")),
}


@contextlib.contextmanager
def _lenient_data_flow_checks():
    """The memory timeline without its data-flow graph's two consistency checks, which trip
    ("version mismatch", "duplicate outputs") in most profiled steps of a 2-rank run here, on
    the functional collectives (an op that allocates its output and writes it in place). The
    checks guard the graph the timeline sorts tensors into categories with, and the versions it
    reads pre-existing tensors from: relaxed, a storage reused within one op can be counted
    twice (seen: tp2 sharded +8.4 MB, 2.5% over the strict timeline's 329,507,960 B; gathered,
    FSDP and DDP rows the same to the byte). Used only after 6 strict tries failed."""
    from torch.profiler import _memory_profiler as memory_profiler

    node_init, validate = memory_profiler.DataFlowNode.__init__, memory_profiler.DataFlowGraph.validate

    def lenient_init(self, event, graph):  # DataFlowNode.__init__ less its final assertion
        self._event, self._graph = event, graph
        self._edges = self._determine_edges()
        for key, edge in self._edges.items():
            if edge.mutated and not edge.is_allocation:
                self._graph.bump(key)

    memory_profiler.DataFlowNode.__init__ = lenient_init
    memory_profiler.DataFlowGraph.validate = lambda self: None
    try:
        yield
    finally:
        memory_profiler.DataFlowNode.__init__, memory_profiler.DataFlowGraph.validate = node_init, validate


def _gloo_rank(rank: int, port: int, model: str, seq_len: int, strategy_name: str, options: StepOptions,
               batch_size: int, out: str) -> None:
    """One rank of a real 2-process gloo run; rank 0 writes its profiled peak to ``out``."""
    import datetime
    import os

    import torch.distributed as dist

    from batchfit.distributed import apply_strategy, build_meshes
    from batchfit.distributed.tp_plans import tp_plan
    from batchfit.distributed.zero import with_sharded_optimizer
    from batchfit.plan.sharded import parse_strategy

    os.environ.update(WORLD_SIZE="2", RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    torch.set_num_threads(1)
    strategy = parse_strategy(strategy_name, 2)
    meshes = build_meshes(strategy)
    workload, options = with_sharded_optimizer(ZOO[model](seq_len=seq_len), options, strategy)  # zero1 / zero2
    torch.manual_seed(0)
    ring = contextlib.nullcontext()

    def wrap(m):
        return apply_strategy(m, strategy, meshes, precision=options.precision, fake=False,
                              parallelize=tp_plan(m, options.tp_loss))

    if strategy.cp > 1:  # cp<N>: the batch and RoPE tables sharded, SDPA through torch's ring (CPU flash op)
        from batchfit.distributed.context_parallel import ring_attention, shard_position_tables, sharded_make_batch

        workload = dataclasses.replace(workload, make_batch=sharded_make_batch(workload.make_batch, meshes.cp, seq_len))
        ring, plain = ring_attention(meshes.cp, cpu=True), wrap

        def wrap(m):
            shard_position_tables(m, meshes.cp, seq_len)
            return plain(m)

    ring.__enter__()
    step = TrainingStep(workload, options, torch.device("cpu"), wrap=wrap)
    step.run(batch_size)
    step.run(batch_size)  # DDP rebuilds its buckets in the second step
    # The strict timeline trips ("version mismatch", "duplicate outputs") on the functional
    # collectives in many profiled steps here: up to 6 steps are profiled, then one more with the
    # data-flow checks relaxed (flagged in the row: not byte-exact, see _lenient_data_flow_checks).
    found: dict = {}
    for attempt in range(7):
        if rank == 0:
            try:
                with _lenient_data_flow_checks() if attempt == 6 else contextlib.nullcontext():
                    found = {"peak": profiled_peak(None, options, batch_size, step=step),
                             "timeline": "lenient" if attempt == 6 else "strict"}
            except AssertionError:
                pass
        else:
            step.run(batch_size)
        done = torch.tensor([int(bool(found))])
        dist.broadcast(done, src=0)
        if done.item():
            break
    ring.__exit__(None, None, None)
    if rank == 0:
        Path(out).write_text(json.dumps(found))
    dist.barrier()
    dist.destroy_process_group()


def gloo_peak(model: str, seq_len: int, strategy_name: str, options: StepOptions, batch_size: int) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "peak.json")
        torch.multiprocessing.spawn(_gloo_rank, args=(port, model, seq_len, strategy_name, options, batch_size, out),
                                    nprocs=2, join=True)
        return json.loads(Path(out).read_text())


def traced_peak(workload: Workload, options: StepOptions, batch_size: int) -> int:
    """The traced peak; with --offload the device + host total (one CPU holds both)."""
    with TraceSession(workload, options, cuda_semantics=False) as session:
        snapshot = session.trace(batch_size).snapshot
        return snapshot.total_peak_bytes if options.offload != "none" else snapshot.peak_bytes


def profiled_peak(workload: Workload, options: StepOptions, batch_size: int, step: TrainingStep | None = None) -> int:
    """The profiler's memory timeline over the second real CPU step (the first made the
    optimizer state, as in the trace): the largest total of live bytes. ``step``: one already
    warmed up (a gloo rank's), profiled as it is."""
    if step is None:
        torch.manual_seed(0)
        step = TrainingStep(workload, options, torch.device("cpu"))
        for _ in range(2 if options.compile != "none" else 1):  # compiled: inductor compiles in the first
            step.run(batch_size)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        step.run(batch_size)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "timeline.json"
        prof.export_memory_timeline(str(path), device="cpu")
        _, sizes = json.loads(path.read_text())
    return max(sum(row) for row in sizes)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt-tinystories-22m")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--recipes", default=",".join([*RECIPES, *DISTRIBUTED, *GLOO, *EP_GLOO]),
                        help="comma-separated names of RECIPES, DISTRIBUTED, GLOO or EP_GLOO")
    parser.add_argument("--only", default=None, help="only the recipes whose name holds this, e.g. offload")
    parser.add_argument("--name", "--result-name", dest="name", default="recipes",
                        help="results file name: benchmarks/results/<name>-<date>.json")
    parser.add_argument("--tag", default="", help="results/<name>-<tag>-<date>.json (e.g. a branch's rows alone)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # the profiler's FutureWarning on export_memory_timeline
    base = ZOO[args.model](seq_len=args.seq_len)
    rows = []
    print(f"{args.model}, batch {args.batch_size} x {args.seq_len} tokens, fp32 AdamW, on this CPU")
    print(f"{'recipe':<40} {'traced B':>13} {'CPU truth B':>13} {'error':>9} {'seconds':>8}")
    for name in [n for n in args.recipes.split(",") if args.only is None or args.only in n]:
        started = time.perf_counter()
        timeline = "strict"
        if name in DISTRIBUTED:  # rank 0 of 2: the fake process group against a real gloo run
            from batchfit.devices import get_device
            from batchfit.plan.sharded import parse_strategy, trace_sharded

            strategy_name, options = DISTRIBUTED[name]
            traced = trace_sharded(base, options, get_device("h100-80gb"), parse_strategy(strategy_name, 2),
                                   args.batch_size, cuda_semantics=False).peak_bytes
            truth = gloo_peak(args.model, args.seq_len, strategy_name, options, args.batch_size)
            measured, timeline = truth["peak"], truth["timeline"]
        elif name in EP_GLOO:
            traced, measured, options, relaxed = gloo_expert_parallel(name)
            timeline = "relaxed" if relaxed else "strict"
        elif name in GLOO:
            options = (StepOptions(precision="bf16-mixed") if name.startswith("torchtitan")
                       else StepOptions(offload="params"))
            traced, measured = (gloo_torchtitan(name.split()[2]) if name.startswith("torchtitan")
                                else gloo_offload_params())
        else:
            change, options = RECIPES[name]
            workload = change(base)
            traced = traced_peak(workload, options, args.batch_size)
            measured = profiled_peak(workload, options, args.batch_size)
        seconds = time.perf_counter() - started
        error = (traced - measured) / measured
        rows.append({"recipe": name, "options": options.to_json(), "traced_bytes": traced,
                     "cpu_truth_bytes": measured, "error": error, "seconds": round(seconds, 1),
                     **({"timeline": timeline} if timeline != "strict" else {})})
        print(f"{name:<40} {traced:>13,} {measured:>13,} {error:>+9.4%} {seconds:>8.1f}"
              + (" (timeline checks relaxed)" if timeline != "strict" else ""), flush=True)
    path = write_result(f"{args.name}-{args.tag}" if args.tag else args.name, {
        "model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len,
        "precision": "per row (options.precision)",
        "truth": "torch.profiler export_memory_timeline peak of the same real CPU step (the second one)",
        "traced": "TraceSession(cuda_semantics=False) peak", "rows": rows,
        "notes": "user SAC policy: the real step also keeps torch.get_rng_state() (5,056 B) per checkpointed "
                 "block (preserve_rng_state=True); on a GPU that is host memory, so the trace leaves it out. "
                 "bf16-mixed loss fused-linear: the real step holds 149 KB (0.03%) more than the trace, "
                 "not explained yet (the same loss on tests/test_losses.py's model is within 48 B)"})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
