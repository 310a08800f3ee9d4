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
    def row(rank, gpus, strategy, status="fits", bound=None):
        # the widest a real plan prints: two GPU counts, the longest strategy name auto makes, 128 accumulation
        # steps, tokens/s in the millions, days; auto's bound on a row it did not trace
        return NS(rank=rank, gpus=gpus, strategy=strategy, status=status, why=None if rank else "needs 91.2 GiB",
                  max_local_batch=6553, micro_batch=512, accumulation_steps=128, allocated_bytes=79.9 * GiB,
                  reserved_bytes=79.99 * GiB, exposed_comm_s=1.23, bubble_s=10.5, step_time_s=12.34,
                  tokens_per_s=12345678.0, samples_per_s=None, days=123.4, bound_tokens_per_s=bound)

    ranking = [row(1, 64, "fsdp-noreshard+tp4"), row(2, 64, "pp8+fsdp+cp2+tp4", "above target"),
               row(None, 16, "hsdp2", "does not fit"), row(None, 64, "pp4+fsdp+cp2+tp4", "not traced", 12345677.0)]
    result = NS(workload="llama-1b", device=NS(display_name="NVIDIA H100 80GB HBM3"),
                options=NS(precision="bf16-mixed", offload="none", attention="sdpa"), plans=[], recommended=[],
                limit="reserved",
                host_limit_bytes=None, ranking=ranking, worlds=[NS(gpus=16), NS(gpus=64)], time_model=NS(mfu=0.4),
                tokens_per_sample=8192)
    text = printed(plan_summary, result)
    for whole in ("fsdp-noreshard+tp4", "pp8+fsdp+cp2+tp4", "hsdp2", "12,345,678", "512 x 128", "12,345,678  123",
                  "12.3", "1.23", "pp4+fsdp+cp2+tp4", "not traced", "<=12,345,677"):
        assert whole in text, text


def test_bench_tokens_per_s_is_whole_at_80_columns():
    row = NS(batch_size=65536, status="ok", step_time_s=12.345, tokens_per_s=123456789.0, mfu=0.453,
             peak_allocated_bytes=79.5 * GiB, peak_reserved_bytes=79.9 * GiB, source="cpu time, traced memory",
             error=None)
    result = NS(workload="gpt2-124m", target=NS(spec="cuda", kind="cuda"),
                options=NS(precision="bf16-mixed", attention="sdpa"), rows=[row], tiers=[], leak=None, hints=[],
                tokens_per_sample=1024)
    text = printed(bench_summary, result)
    for whole in ("65536", "12.345", "123,456,789", "45.3%", "79.50", "79.90"):
        assert whole in text, text
