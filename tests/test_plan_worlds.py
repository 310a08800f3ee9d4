"""plan over many GPU counts (issue 35): what it refuses before any trace, what it derives instead
of tracing again, its progress, and the pictures of what it decided.

Numbers by hand: the stand-in (``standin.py``) gives DDP's rank 0 16 GiB + 1 GiB per
sample on any world above 1, and two all-reduces of 2e9 bytes over the dp ranks; the tiny Llama's
largest parameter is its 512-row embedding (and untied head).
"""

from __future__ import annotations

import pytest

from batchfit.devices import GiB
from batchfit.errors import OptionError
from batchfit.plan.engine import plan
from batchfit.plan.time_model import TimeModel
from batchfit.plan.world import World
from batchfit.workload import StepOptions
from batchfit.zoo.transformer import TransformerConfig
from cpu_truth import tiny_llama_workload
from standin import gpu, trace_sharded, workload

HALF = TimeModel(mfu=0.5, mfu_source="test")
TINY = TransformerConfig(vocab_size=512, seq_len=16, d_model=32, n_layers=2, n_heads=4, d_ff=64, llama=True,
                         tied_embeddings=False)


def never(*args):
    raise AssertionError("traced, though the plan should stop before any trace")


def test_fsdp_wider_than_the_largest_parameter_stops_before_any_trace():
    """FSDP2 on 1024 ranks of a model whose largest first dimension is 512: one line, no trace
    (before, FSDP2's setup alone grew with the ranks: 40 s at 100,000, past 5 minutes at 1,000,000)."""
    with pytest.raises(OptionError, match="FSDP2 can use at most 512 ranks per shard group") as error:
        plan(tiny_llama_workload(TINY), device=gpu(), worlds=[World(1024, 128)], strategies="fsdp", trace=never)
    assert "hsdp<R> with R of 2 or more" in str(error.value)
    with pytest.raises(OptionError, match="hsdp2 on 2,048 GPUs shards each parameter's first dimension over 1,024"):
        plan(tiny_llama_workload(TINY), device=gpu(), worlds=[World(2048, 256)], strategies="hsdp2", trace=never)


def test_fsdp_within_the_largest_parameter_is_not_refused():
    from batchfit.plan.shard_limit import too_wide
    from batchfit.plan.sharded import parse_strategies

    chosen = parse_strategies("ddp,fsdp,hsdp2,zero1", 1024)
    why = too_wide(tiny_llama_workload(TINY), chosen)
    assert [why(s) is None for s in chosen] == [True, False, True, True]  # hsdp2: groups of 512
    assert all(why(s) is None for s in parse_strategies("fsdp", 512))


def test_the_default_strategies_keep_ddp_and_skip_a_too_wide_fsdp(standin):
    """The user chose no strategy (ddp,fsdp by default): ddp answers, fsdp is a skipped row saying why
    (it refused the whole plan, ddp's answer too)."""
    traced = []

    def counting(*args):
        traced.append(args[3].name)
        return trace_sharded(*args)

    result = plan(tiny_llama_workload(TINY), device=gpu(), worlds=[World(1024, 128)], time_model=HALF,
                  trace=counting, parse=standin.parse_strategies, limit="allocated")
    rows = {p.strategy: p for p in result.plans}
    assert set(traced) == {"ddp"} and rows["ddp"].max_local_batch > 0
    assert "FSDP2 can use at most 512 ranks per shard group" in rows["fsdp"].skipped


def test_the_cli_refuses_a_million_gpus_in_one_line():
    from typer.testing import CliRunner

    from batchfit.cli.app import app

    result = CliRunner().invoke(app, ["plan", "gpt-tinystories-22m", "--gpu", "h100", "--gpus", "1000000",
                                      "--strategies", "fsdp"])
    assert result.exit_code == 2, result.output
    assert "largest has 10,000 rows" in result.output and "Traceback" not in result.output


def test_ddp_on_more_gpus_is_derived_from_its_smallest_trace(standin):
    traced = []

    def counting(*args):
        traced.append((args[3].world_size, args[4]))
        return trace_sharded(*args)

    result = plan(workload(), device=gpu(), worlds=[World(g) for g in (1, 2, 3, 4)], strategies="ddp",
                  options=StepOptions(precision="bf16-mixed"), time_model=HALF, trace=counting,
                  parse=standin.parse_strategies, limit="allocated", global_batch=96)
    assert {world for world, _ in traced} == {1, 2}  # 3 and 4 never traced
    rows = {p.gpus: p for p in result.plans}
    assert [rows[g].derived_from_gpus for g in (1, 2, 3, 4)] == [0, 0, 2, 2]
    assert [rows[g].max_local_batch for g in (2, 3, 4)] == [84, 84, 84]  # 16 + b GiB <= 100 GiB
    assert [rows[g].micro_batch for g in (2, 3, 4)] == [48, 32, 24]  # 96 / dp, under the 90 GiB target
    assert {c.group_size for c in rows[4].points[0].collectives} == {4}  # its all-reduces over its 4 ranks
    assert result.traces == len({(w, b) for w, b in traced})
    assert "memory derived from the 2-GPU trace" in rows[3].to_json()["source"]
    from batchfit.report.plan_markdown import plan_markdown

    assert "| 4 | ddp (derived from the 2-GPU trace) | 4 | 1 | 84 |" in plan_markdown(result)


def test_progress_says_sessions_done_and_time_left(standin):
    said = []
    plan(workload(), device=gpu(), worlds=[World(2), World(4)], strategies="fsdp,fsdp+tp2", time_model=HALF,
         parse=standin.parse_strategies, trace=trace_sharded, limit="allocated", progress=said.append)
    assert "[0/4 sessions done]" in said[0]
    assert any("[3/4 sessions done, about" in line and " s left" in line for line in said)


def test_plan_png_draws_the_reserved_memory_the_decision_used(standin):
    from batchfit.report.plan_plots import plan_figure

    result = plan(workload(), device=gpu(), worlds=[World(4)], strategies="ddp", global_batch=64, time_model=HALF,
                  options=StepOptions(precision="bf16-mixed"), **standin.tracer)
    row = result.plans[0]
    assert row.limit == "reserved"
    row.peak_reserved_bytes_at_micro += 7 * GiB  # the stand-in reserves what it allocates: tell them apart
    star = plan_figure(result).axes[0].collections[-1].get_offsets()[0]
    assert (star[0], star[1] * GiB) == (row.micro_batch, row.peak_reserved_bytes_at_micro)
    assert "reserved" in plan_figure(result).axes[0].get_ylabel()


def test_ranking_png_of_one_strategy_is_one_panel_by_gpu_count(standin):
    from batchfit.report.plan_plots import ranking_figure

    result = plan(workload(), device=gpu(), worlds=[World(g) for g in (1, 2, 4)], strategies="ddp",
                  time_model=HALF, options=StepOptions(precision="bf16-mixed"), limit="allocated", **standin.tracer)
    fig = ranking_figure(result)
    assert len(fig.axes) == 1 and fig.axes[0].get_xlabel() == "GPUs"
    assert list(fig.axes[0].lines[0].get_xdata()) == [1, 2, 4]


def test_ranking_png_title_fits_its_figure(standin):
    from batchfit.devices import get_device
    from batchfit.report.plan_plots import ranking_figure

    # seed 001's GPU: 'NVIDIA H100 80GB HBM3 (SXM)' made a one-line title end past the figure ('GPU coun')
    result = plan(workload(), device=get_device("h100-80gb"), worlds=[World(g) for g in (1, 2, 4)],
                  strategies="ddp", time_model=HALF, options=StepOptions(precision="bf16-mixed"), limit="allocated",
                  **standin.tracer)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    result.workload = "frozen-pair-tiny"  # the seed's name: the stand-in's is shorter
    fig = ranking_figure(result)
    renderer = FigureCanvasAgg(fig).get_renderer()
    title = fig.get_suptitle()  # the figure's, centred on it: an axes title moves right with wide tick labels
    assert title.startswith("frozen-pair-tiny on NVIDIA H100 80GB HBM3 (SXM), bf16-mixed\ntokens/s at max global")
    box = fig._suptitle.get_window_extent(renderer)
    assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and not fig.axes[0].get_title()
