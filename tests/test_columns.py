"""At 80 columns the decisive columns show whole (issue 19, item 20): the strategy in plan's
table, tokens/s in bench's. They were cut to 'fsdp-…' and '1,234,…'."""

from __future__ import annotations

import io
from types import SimpleNamespace as NS

from rich.console import Console

from batchfit.cli.bench import _print_summary as bench_summary
from batchfit.cli.plan import _print_summary as plan_summary

GiB = 2**30


def printed(summary, result) -> str:
    console = Console(file=io.StringIO(), width=80, force_terminal=False)
    summary(result, console, "reports/x/report.md", *([[]] if summary is plan_summary else []))
    text = console.file.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80
    return text


def test_plan_strategies_and_tokens_per_s_are_whole_at_80_columns():
    def row(gpus, strategy, fits=True):
        # the widest a real plan prints: 64 GPUs, the longest strategy name, 128 accumulation steps
        return NS(gpus=gpus, strategy=strategy, skipped=False, fits=fits, max_local_batch=6553,
                  max_global_batch=104848, micro_batch=512, accumulation_steps=128, peak_bytes_at_micro=79.9 * GiB,
                  step_time_s=12.34, tokens_per_s=12345678.0, days=123.4, peak_reserved_bytes_at_micro=79.99 * GiB,
                  tp_loss=None)

    plans = [row(64, "fsdp-noreshard+tp4"), row(16, "hsdp2+tp4", fits=False)]
    result = NS(workload="llama-1b", device=NS(display_name="NVIDIA H100 80GB HBM3"),
                options=NS(precision="bf16-mixed", offload="none"), plans=plans, recommended=[], limit="reserved",
                host_limit_bytes=None)
    text = printed(plan_summary, result)
    for whole in ("fsdp-noreshard+tp4", "hsdp2+tp4", "12,345,678", "512 x 128", "104848", "123.4"):
        assert whole in text, text


def test_bench_tokens_per_s_is_whole_at_80_columns():
    row = NS(batch_size=65536, status="ok", step_time_s=12.345, tokens_per_s=123456789.0, mfu=0.453,
             peak_allocated_bytes=79.5 * GiB, peak_reserved_bytes=79.9 * GiB, source="cpu time, traced memory",
             error=None)
    result = NS(workload="gpt2-124m", target=NS(spec="cuda"), options=NS(precision="bf16-mixed"), rows=[row],
                tiers=[], leak=None, hints=[])
    text = printed(bench_summary, result)
    for whole in ("65536", "12.345", "123,456,789", "45.3%", "79.50", "79.90"):
        assert whole in text, text
