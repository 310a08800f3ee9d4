"""The strategies asked together do not change one strategy's answer: a pipeline's local batch is
whole micro-batches, the others' are not (stand-in tracer, numbers by hand).

On the test GPU with 101 GiB usable, ddp on 4 GPUs peaks at 16 + b GiB (``standin.py``): its
largest local batch is 85, odd. pp2+fsdp (2 micro-batches) takes even local batches only; asked
beside it, ddp searched multiples of 2 too and answered 84.
"""

from __future__ import annotations

import pytest

from batchfit.errors import OptionError
from batchfit.plan.engine import plan
from batchfit.plan.world import World
from batchfit.report.plan_markdown import plan_markdown
from batchfit.workload import StepOptions
from standin import gpu, workload

BF16 = StepOptions(precision="bf16-mixed")


def _plan(strategies: str, tracer: dict, **fields):
    return plan(workload(), device=gpu(101), worlds=[World(4)], options=BF16, strategies=strategies,
                target_util=1.0, limit="allocated", **fields, **tracer)


def _max_local(strategies: str, tracer: dict, **fields) -> dict[str, int]:
    return {p.strategy: p.max_local_batch for p in _plan(strategies, tracer, **fields).plans}


def test_a_pipeline_beside_does_not_make_ddp_search_even_sizes(standin):
    alone = _max_local("ddp", standin.tracer)
    result = _plan("ddp,pp2+fsdp", standin.tracer)
    together = {p.strategy: p.max_local_batch for p in result.plans}
    assert alone == {"ddp": 85}
    assert together["ddp"] == 85
    assert together["pp2+fsdp"] % 2 == 0
    assert "| Local batch sizes | multiples of 1; a pipeline (pp<N>) also whole micro-batches |" in \
        plan_markdown(result)


def test_global_batch_is_checked_with_each_strategys_own_step(standin):
    # fsdp+tp2: 2 data-parallel ranks x 1 sample, so 6 splits; pp2+fsdp: 2 ranks x 2 micro-batches, 6 does not
    assert _max_local("fsdp+tp2", standin.tracer, global_batch=6) == {"fsdp+tp2": 194}
    with pytest.raises(OptionError, match="pp2\\+fsdp's 2 data-parallel ranks on 4 GPUs in multiples of 2: "
                                          "use a multiple of 4"):
        _max_local("fsdp+tp2,pp2+fsdp", standin.tracer, global_batch=6)
