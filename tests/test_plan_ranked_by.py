"""What plan says its ranking rests on, and pp's refusal as a sentence.

With a memory size only (``--gpu-memory``: no FLOP/s) no row has a step time, so the footer
cannot say "ranked by samples/s": the rows are ordered by global batch, then TP degree, then
memory (``plan/ranking.py``). Stand-in tracer (``standin.py``) on 4 GPUs of 101 GiB.
"""

from __future__ import annotations

import pytest

from batchfit.devices import GiB, custom_device
from batchfit.distributed.pp_schedules import check_pipeline, parse_schedule
from batchfit.errors import OptionError
from batchfit.plan.engine import plan
from batchfit.plan.ranking import ranked_by
from batchfit.plan.world import World
from batchfit.report.plan_markdown import plan_markdown
from standin import gpu, workload


def _ranking(device, standin):
    return plan(workload(), device=device, worlds=[World(4)], strategies="ddp,fsdp", target_util=1.0,
                limit="allocated", **standin.tracer)


def test_a_memory_size_alone_ranks_by_global_batch_and_says_so(standin):
    result = _ranking(custom_device(101 * GiB + 512 * 2**20), standin)
    assert all(row.tokens_per_s is None and row.samples_per_s is None for row in result.ranking)
    assert [row.strategy for row in result.ranking] == ["fsdp", "ddp"]  # max global 4 x 97 before 4 x 85
    said = ranked_by(result.ranking)
    assert said.startswith("the largest global batch, then fewer tensor-parallel ranks, then the least memory")
    assert "samples/s" not in said and "name a GPU with --gpu" in said
    assert f"by {said} at " in plan_markdown(result)


def test_a_named_gpu_ranks_by_speed(standin):
    assert ranked_by(_ranking(gpu(101), standin).ranking) == "tokens/s"


@pytest.mark.parametrize(("schedule", "pp", "layers", "advice"), [
    ("1f1b", 4, 2, "2 layers do not split into 4 equal stages: use pp2"),
    ("1f1b", 2, 21, "21 layers do not split into 2 equal stages: use pp3, pp7 or pp21"),
    ("1f1b", 2, 1, "1 layer does not split into 2 equal stages: one layer cannot be split into stages: drop pp"),
    ("interleaved-1f1b:2", 8, 8, "8 layers do not split into 16 equal stages (2 per rank): use pp2 or pp4 "
                                 "(2 stages per rank)"),
])
def test_a_layer_count_the_stages_do_not_divide_says_which_pp_does(schedule, pp, layers, advice):
    with pytest.raises(OptionError, match=advice.replace("(", r"\(").replace(")", r"\)")):
        check_pipeline(parse_schedule(schedule), pp, layers)


def test_the_console_footer_says_it_too(standin, tmp_path):
    from typer.testing import CliRunner

    from batchfit.cli.app import app

    result = CliRunner().invoke(app, ["plan", "gpt-tinystories-22m", "--gpu-memory", "80GiB", "--gpus", "4",
                                      "--strategies", "ddp,fsdp", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "ranked by the largest global batch, then fewer tensor-parallel ranks" in said
    assert "ranked by samples/s" not in said and "ranked by tokens/s" not in said
    assert "(memory traced; no time: no FLOP/s for this GPU)" in said and "time computed" not in said
