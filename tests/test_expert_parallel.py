"""ep<N>+fsdp: expert parallelism (distributed/expert_parallel.py), parsed (distributed/strategy_name.py) and
traced on the fake process group, held to a real 2-process gloo run of a tiny Qwen3-MoE.

Truth: two real processes on the CPU over gloo (whose ProcessGroupGloo runs ``alltoall_base``, so
the real all-to-all dispatch and combine run) train the same EP module on real tensors, the
router forced as tests/test_routing.py forces it (worst: every token to experts 0 .. top_k-1, all
on rank 0; benchmarks/ep_gloo.py also runs balanced: token t to experts (t x top_k + j) mod
experts). Rank 0's peak in a steady step (torch profiler memory timeline) against the trace of
rank 0 at the same routing with CPU semantics: within 3%. The EP module's loss equals the plain
model's on the same batch.

With tensor parallelism (ep2+fsdp+tp2 on 4 real gloo ranks: torch's DTensor TP plan of the HF model,
distributed/tp_plans_moe.py, and the experts under EP in torchtitan's etp=1 layout): every rank is
profiled, and the hot rank and a cold one are each held to the trace of that rank (``trace_sharded(rank=r)``,
gloo's reduce-scatter copy counted: ``gloo_scratch``), within 3%.

Checked against batchfit's own EP module (distributed/expert_parallel.py) running for real over gloo's real
all-to-all (checks the counting, not the fidelity to torchtitan's EP); with tp2, torch's own DTensor TP of the HF model.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from batchfit.devices import get_device
from batchfit.errors import OptionError
from batchfit.plan.sharded import parse_strategies, parse_strategy, trace_sharded
from batchfit.train.step import TrainingStep
from batchfit.workload import StepOptions
from cpu_truth import join_gloo, spawn_profiled_gloo

transformers = pytest.importorskip("transformers")

from tiny import B, tiny_moe  # noqa: E402 - after the importorskip

WORLD = 2
OPTIONS = dict(optimizer="sgd")


@functools.lru_cache(maxsize=None)
def traced(routing: str, name: str = "ep2+fsdp", precision: str = "fp32", world: int = WORLD, rank: int = 0):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trace_sharded(tiny_moe(routing), _options(routing, precision), get_device("h100-80gb"),
                             parse_strategy(name, world), B, cuda_semantics=False, rank=rank, gloo_scratch=True)


PROFILED = (("ep2+fsdp", "worst", "fp32"),)
TP_CASE = ("ep2+fsdp+tp2", "worst", "fp32")
"""ep x tp on 4 real gloo ranks (torchtitan's etp=1 layout: ranks 0-1 and 2-3 are both the tp and the ep
groups, experts FSDP-sharded over 0-2 and 1-3), every rank profiled: under worst ranks 0 and 2 hold the
experts every token goes to, ranks 1 and 3 get no tokens (their peak falls on FSDP2's reduce-scatter)."""
"""(strategy, routing, precision) run for real in the test: worst, the uneven one (rank 0 gets every row,
rank 1 none); benchmarks/ep_gloo.py runs the rest (balanced, bf16-mixed, 4 ranks with the experts
FSDP-sharded over dp / ep = 2, ep4)."""


def _options(routing: str = "balanced", precision: str = "fp32") -> StepOptions:
    return StepOptions(routing=routing, precision=precision, **OPTIONS)


BEST_OF = 2
"""Profiled steps per case and rank: the least peak is kept."""


def _gloo_main(rank: int, port: int, out_dir: str, world: int, cases: tuple, check_losses: bool,
               tries: int = 3, lenient: bool = False, every_rank: bool = False) -> None:
    """Each case's real step on this rank (rank 0, or with ``every_rank`` each rank, profiled in a steady
    step, each into its own folder); with ``check_losses``, the EP model's loss and the plain model's on
    this rank's batch under each forced routing (the ranks of a tensor-parallel group share a batch)."""
    from batchfit.distributed import apply_strategy, build_meshes
    from batchfit.distributed.tp_plans import tp_plan
    from batchfit.train.losses import loss_context
    from cpu_truth import profiled_step_peak

    join_gloo(rank, world, port, timeout_s=300)
    peaks, losses, peaks_relaxed = {}, {}, []
    profiles = every_rank or rank == 0
    folder = Path(out_dir) / f"rank{rank}"
    folder.mkdir(exist_ok=True)
    for name, routing, precision in cases:
        strategy = parse_strategy(name, world)
        meshes = build_meshes(strategy)
        workload = tiny_moe(routing)
        torch.manual_seed(0)  # the same weights on every rank: each keeps its slice of the experts
        plain = workload.build_model() if check_losses else None
        torch.manual_seed(0)
        step = TrainingStep(workload, _options(routing, precision), torch.device("cpu"), wrap=lambda m: apply_strategy(
            m, strategy, meshes, precision=precision, fake=False, parallelize=tp_plan(m) if strategy.tp > 1 else None))
        data_rank = rank // strategy.tp  # tp is innermost: a tensor-parallel group's ranks read the same samples
        if plain is not None:
            torch.manual_seed(10 + data_rank)
            batch = workload.make_batch(B, torch.device("cpu"))
            with torch.no_grad(), loss_context(step.model)():  # the EP module computes what HF's expert loop computes
                losses["/".join((name, routing, precision))] = (float(workload.loss_fn(step.model, batch)),
                                                                 float(workload.loss_fn(plain, batch)))
            del plain
        torch.manual_seed(20 + data_rank)
        step.run(B)
        step.run(B)  # the profiled step is the third, as in the other gloo truths
        # The timeline's data-flow checks sometimes trip ("version mismatch"): that step is skipped; a
        # benchmark may then relax them (benchmarks/recipes.py: _lenient_data_flow_checks) in a last try.
        # Each profiling rank keeps the least of two timelines (a collective that completes late on a
        # loaded machine keeps a buffer alive longer in one step: test_context_parallel read +7% so once);
        # the others run plain steps beside it.
        got: list[int] = []
        for attempt in range(tries + BEST_OF - 1 + lenient):
            if profiles and len(got) < BEST_OF:
                relaxed = attempt == tries + BEST_OF - 1
                if relaxed:
                    from recipes import _lenient_data_flow_checks as checks
                else:
                    import contextlib as _c
                    checks = _c.nullcontext
                try:
                    with checks():
                        got.append(profiled_step_peak(step, B, folder, warmup=0))
                    if relaxed:
                        peaks_relaxed.append("/".join((name, routing, precision)))
                except AssertionError:
                    pass
            else:
                step.run(B)
            done = torch.tensor([len(got) >= BEST_OF or not profiles], dtype=torch.int32)
            dist.all_reduce(done, op=dist.ReduceOp.MIN)  # every profiling rank got its timelines
            if done.item():
                break
        if profiles:
            peaks["/".join((name, routing, precision))] = min(got, default=None)
        del step
        gc.collect()
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"peaks": peaks, "losses": losses, "relaxed": peaks_relaxed}, f)
    dist.barrier()
    dist.destroy_process_group()


def run_gloo(path: Path, world: int, cases: tuple, check_losses: bool = False, tries: int = 3,
             lenient: bool = False, every_rank: bool = False) -> dict:
    spawn_profiled_gloo(_gloo_main, lambda port: (port, str(path), world, cases, check_losses, tries, lenient,
                                                  every_rank), nprocs=world)
    return {r: json.loads((path / f"rank{r}.json").read_text()) for r in range(world)}


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    return run_gloo(tmp_path_factory.mktemp("ep-gloo"), WORLD, PROFILED, check_losses=True)


@pytest.mark.parametrize(("name", "routing", "precision"), PROFILED)
def test_traced_rank0_peak_matches_a_real_gloo_run(measured, name, routing, precision):
    real = measured[0]["peaks"]["/".join((name, routing, precision))]
    point = traced(routing, name, precision)
    assert abs(point.peak_bytes - real) <= 0.03 * real, (point.peak_bytes, real)
    a2a = [c for c in point.collectives if c.op == "all_to_all"]
    assert a2a and {c.group for c in a2a} == {"ep"}


@pytest.fixture(scope="module")
def measured_tp(tmp_path_factory) -> dict:
    # 6 tries: with 4 ranks profiled, one rank's timeline failing its data-flow check takes another step
    return run_gloo(tmp_path_factory.mktemp("ep-tp-gloo"), 4, (TP_CASE,), check_losses=True, every_rank=True, tries=6)


@pytest.mark.slow
def test_ep_with_tp_matches_a_real_4_rank_gloo_run_rank_by_rank(measured_tp):
    """The hot rank (0) and a cold one (1: no tokens, a different tp rank) each against its own trace,
    within 3%; the model's loss is the plain model's on every rank; all-to-alls are ep's, TP's
    collectives tp's, FSDP2's dp's."""
    name, routing, precision = TP_CASE
    for rank in (0, 1):
        real, point = measured_tp[rank]["peaks"]["/".join(TP_CASE)], traced(routing, name, precision, 4, rank)
        assert abs(point.peak_bytes - real) <= 0.03 * real, (rank, point.peak_bytes, real)
    for rank in range(4):
        (ep_loss, plain_loss), = measured_tp[rank]["losses"].values()
        assert abs(ep_loss - plain_loss) < 1e-5, (rank, ep_loss, plain_loss)
    groups = {(c.op, c.group, c.group_size) for c in traced(routing, name, precision, 4).collectives}
    assert {g for g in groups if g[0] == "all_to_all"} == {("all_to_all", "ep", 2)}
    assert {("all_gather", "tp", 2), ("reduce_scatter", "tp", 2), ("all_reduce", "tp", 2)} <= groups
    assert {("all_gather", "dp", 2), ("reduce_scatter", "dp", 2)} <= groups


def test_the_ep_module_computes_what_the_plain_model_computes(measured):
    for rank in range(WORLD):
        for case, (ep_loss, plain_loss) in measured[rank]["losses"].items():
            assert abs(ep_loss - plain_loss) < 1e-5, (rank, case, ep_loss, plain_loss)


def test_dispatch_buffers_follow_the_routing_by_hand():
    """Rank 0's all-to-all payloads (the input each sends): 2 x 32 tokens x top-2 = 128 rows of 64
    fp32 per layer dispatched under any routing; balanced: 64 of them stay, 64 go, and as many come
    in, so the combine sends 128 back; worst: rank 0's experts 0-1 get every row of both ranks, and
    its combine sends 256 rows back."""
    row = 64 * 4
    for routing, sent, back in (("balanced", 128, 128), ("worst", 128, 256)):
        a2a = [c for c in traced(routing).collectives if c.op == "all_to_all" and c.phase == "forward"]
        counts, dispatch, combine = a2a[0::3], a2a[1::3], a2a[2::3]  # per layer: counts, dispatch, combine
        assert len(dispatch) == 2 and {c.bytes for c in counts} == {8 * 8}
        assert {c.bytes for c in dispatch} == {sent * row} and {c.bytes for c in combine} == {back * row}, routing
        # ep2 on 2 ranks: the ep group is the dp group; FSDP's calls stay dp, the all-to-alls are ep
        groups = {(c.op == "all_to_all", c.group) for c in traced(routing).collectives}
        assert groups == {(True, "ep"), (False, "dp")}, groups


def test_grammar_and_fields():
    s = parse_strategy("ep8+fsdp", 64)
    assert (s.ep, s.dp, s.tp, s.shard, s.world_size) == (8, 64, 1, "fsdp", 64)
    s = parse_strategy("ep2+fsdp+tp2", 8)
    assert (s.ep, s.dp, s.tp, s.shard) == (2, 4, 2, "fsdp")
    s = parse_strategy("ep8+fsdp+tp2", 64)  # torchtitan's etp=1: ep borrows from dp x tp
    assert (s.ep, s.dp, s.tp, s.shard, s.world_size) == (8, 32, 2, "fsdp", 64)
    s = parse_strategy("ep4+fsdp+tp4", 8)  # 2 data-parallel x 4 tensor-parallel ranks to borrow from
    assert (s.ep, s.dp, s.tp) == (4, 2, 4)
    s = parse_strategy("ep2+tp2", 2)  # no data-parallel ranks: FSDP2 over one rank, as torchtitan wraps MoE models
    assert (s.ep, s.dp, s.tp, s.shard, s.name) == (2, 1, 2, "fsdp", "ep2+tp2")
    assert parse_strategy("fsdp+ep2", 4).ep == 2
    assert parse_strategy("pp2+ep2+fsdp", 8).ep == 2
    assert [s.ep for s in parse_strategies("fsdp,ep4+fsdp", 8)] == [1, 4]


@pytest.mark.parametrize(("name", "gpus", "says"), [
    ("ep3+fsdp", 8, "must divide their 8: use ep<N> with N in 2, 4, 8"),
    ("ep16+fsdp+tp4", 8, "ep16 borrows its ranks from the 2 data-parallel x 4 tensor-parallel ranks (etp=1, "
                         "torchtitan's default) and is larger than their 8"),
    ("ep3+fsdp+tp2", 8, "must divide their 8: use ep<N> with N in 2, 4, 8"),
    ("ep2+hsdp2", 8, "composes with fsdp"),
    ("ep2", 8, "use ep2+fsdp"),
    ("ep2+ddp", 8, "composes with fsdp"),
    ("ep2+ep2+fsdp", 8, "comes once"),
])
def test_bad_ep_names_are_one_line(name, gpus, says):
    with pytest.raises(OptionError, match=re.escape(says)) as info:
        parse_strategy(name, gpus)
    assert "\n" not in str(info.value)


def test_experts_not_divisible_and_no_experts_are_one_line():
    from batchfit.zoo import language_model_workload
    from batchfit.zoo.transformer import Transformer, TransformerConfig

    dense = language_model_workload(name="tiny", build_model=lambda: Transformer(TransformerConfig(
        vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2, d_ff=64, llama=True)), vocab_size=64, seq_len=16,
        description="dense")
    with pytest.raises(OptionError, match="no mixture-of-experts layers") as info:
        trace_sharded(dense, StepOptions(), get_device("h100-80gb"), parse_strategy("ep2+fsdp", 2), 1)
    assert "\n" not in str(info.value)
    with pytest.raises(OptionError, match="8 experts per layer do not split over ep16") as info:
        trace_sharded(tiny_moe(), StepOptions(), get_device("h100-80gb"), parse_strategy("ep16+fsdp", 16), 1)
    assert "\n" not in str(info.value)


def test_emit_says_ep_where_the_config_can_and_refuses_where_it_cannot():
    from types import SimpleNamespace

    from batchfit.plan.emit import accelerate_yaml, config_yaml

    row = SimpleNamespace(strategy="ep8+fsdp", ep=8, gpus=64, nodes=8, micro_batch=6, accumulation_steps=1,
                          global_batch=384, dp=64, tp=1, pp=1, cp=1, shard="fsdp", replicas=1,
                          peak_bytes_at_micro=2**30)
    result = SimpleNamespace(recommended=[row], device=get_device("h100-80gb"), target_util=0.9, workload="moe",
                             options=StepOptions())
    assert "expert_parallel: 8" in config_yaml(result)
    with pytest.raises(OptionError, match="expert-parallel, which Accelerate's config cannot say"):
        accelerate_yaml(result)


def test_ep_plans_name_the_routing_and_what_ep_traced():
    from batchfit.distributed.expert_parallel import ep_approximations
    from batchfit.trace.routing import workload_routing_approximation

    (line,) = workload_routing_approximation(tiny_moe(), _options("worst"), expert_parallel=True)
    assert "MoE routing assumed: worst" in line.what and "grouped GEMM" in line.detail and "loop" not in line.line()
    (ep,) = ep_approximations([parse_strategy("ep2+fsdp", 2), parse_strategy("fsdp", 2)], "worst")
    assert "ep2+fsdp" in ep.what and "--routing worst" in ep.what
    assert ep_approximations([parse_strategy("fsdp", 2)], "worst") == []


def test_ep_is_traced_eager_under_compile_and_says_so():
    from batchfit.trace.compiled import sharded_traces_compiled

    compiled = StepOptions(compile="model")
    assert sharded_traces_compiled(parse_strategy("fsdp", 8), compiled)
    assert not sharded_traces_compiled(parse_strategy("ep2+fsdp", 8), compiled)


def test_ep_with_tp_meshes_are_torchtitans():
    """ep4+fsdp+tp2 on 8 GPUs as torchtitan's ParallelDims unflattens the world (etp=1): tp innermost in the
    dense mesh (dp 4 x tp 2), ep innermost in the sparse one (efsdp 2 x ep 4); rank 0's groups by hand."""
    import torch.distributed as dist

    from batchfit.distributed import build_meshes
    from batchfit.plan.fake_world import fake_world

    with fake_world(8):
        meshes = build_meshes(parse_strategy("ep4+fsdp+tp2", 8))
        ranks = {name: dist.get_process_group_ranks(getattr(meshes, name).get_group())
                 for name in ("tp", "ep", "dp", "dp_mod_ep")}
    assert ranks == {"tp": [0, 1], "ep": [0, 1, 2, 3], "dp": [0, 2, 4, 6], "dp_mod_ep": [0, 4]}


def test_each_tp_rank_dispatches_its_share_of_the_tokens_by_hand():
    """ep2+fsdp+tp2 on 4 ranks: the MoE block's 2 x 32 tokens are all-gathered on both tp ranks, each
    dispatches its 32 (x top-2 = 64 rows of 64 fp32 = 16,384 B per layer); the combine sends back what the
    rank's experts got: balanced 64 rows (half its own, half from its ep peer), worst 128 (every row of both)."""
    row = 64 * 4
    for routing, back in (("balanced", 64), ("worst", 128)):
        a2a = [c for c in traced(routing, "ep2+fsdp+tp2", "fp32", 4).collectives
               if c.op == "all_to_all" and c.phase == "forward"]
        counts, dispatch, combine = a2a[0::3], a2a[1::3], a2a[2::3]
        assert {c.bytes for c in counts} == {8 * 8} and len(dispatch) == 2
        assert {c.bytes for c in dispatch} == {64 * row} and {c.bytes for c in combine} == {back * row}, routing


def test_tp_on_an_moe_model_without_ep_is_one_line():
    with pytest.raises(OptionError, match=r"use ep<N>\+fsdp\+tp2") as info:
        trace_sharded(tiny_moe(), StepOptions(), get_device("h100-80gb"), parse_strategy("fsdp+tp2", 4), 1)
    assert "\n" not in str(info.value)


def test_ep_with_tp_is_emitted_for_torchtitan_and_its_layout_said():
    from types import SimpleNamespace

    from batchfit.distributed.expert_parallel import ep_approximations
    from batchfit.plan.emit_torchtitan import degrees, torchtitan_toml

    assert degrees(parse_strategy("ep8+fsdp+tp2", 64)) == {"data_parallel_replicate_degree": 1,
                                                           "data_parallel_shard_degree": 32,
                                           "tensor_parallel_degree": 2, "pipeline_parallel_degree": 1,
                                           "context_parallel_degree": 1, "expert_parallel_degree": 8}
    row = SimpleNamespace(strategy="ep8+fsdp+tp2", gpus=64, dp=32, tp=2, pp=1, cp=1, ep=8, shard="fsdp", replicas=1,
                          micro_batch=2, accumulation_steps=1, global_batch=64)
    toml = torchtitan_toml(SimpleNamespace(recommended=[row], options=StepOptions(), workload="moe",
                                           device=get_device("h100-80gb")))
    assert "expert_parallel_degree = 8" in toml and "tensor_parallel_degree = 2" in toml
    layout, _ = ep_approximations([parse_strategy("ep8+fsdp+tp2", 64), parse_strategy("ep8+fsdp", 64)], "balanced")
    assert "ep8+fsdp+tp2" in layout.what and "etp=1" in layout.what and "ep8+fsdp," not in layout.what


def test_auto_lists_ep_beside_tp_on_a_mixture_of_experts():
    """plan --strategies auto on a Qwen3-MoE-30B-shaped model with a TP plan: ep8 (the largest within a node
    dividing 128 experts and dp x tp) beside every TP degree its 4 key/value heads allow, named as the grammar
    parses them; TP alone is listed skipped, with the reason."""
    from batchfit.plan.candidates import ModelFacts, candidates
    from batchfit.plan.world import World

    facts = ModelFacts(name="qwen3-moe", heads=32, kv_heads=4, experts=128, tp_plan=True)
    listed = {c.name: c for c in candidates(World(64, nodes=8), facts)}
    ep = {n for n, c in listed.items() if c.degrees.get("ep") and c.skipped is None}
    assert ep == {"ep8+fsdp", "ep8+fsdp+tp2", "ep8+fsdp+tp4"}
    assert (listed["ep8+fsdp+tp2"].dp, listed["ep8+fsdp+tp2"].tp) == (32, 2)
    assert "ep<N>+fsdp+tp<M>" in listed["fsdp+tp2"].skipped
    for name in ep:
        assert parse_strategy(name, 64).ep == 8
    one_node = {c.name for c in candidates(World(8), ModelFacts(**{**facts.__dict__, "kv_heads": 8}))
                if c.skipped is None}
    assert {"ep8+fsdp", "ep8+fsdp+tp2", "ep8+fsdp+tp4", "ep8+tp8"} <= one_node and "tp8" not in one_node
