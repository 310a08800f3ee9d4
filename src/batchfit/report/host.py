"""The host-memory line of ``--offload`` (terminal and report.md): a result in, text out."""

from __future__ import annotations

from batchfit.devices import GiB


def host_line(point, host_limit_bytes: int | None) -> str:
    """One line: the pinned host memory a traced point holds, and whether it fits --host-memory."""
    limit = ("not checked (give --host-memory, e.g. 512GiB)" if host_limit_bytes is None
             else f"{host_limit_bytes / GiB:.2f} GiB (--host-memory): "
                  f"{'fits' if point.host_reserved_bytes <= host_limit_bytes else 'DOES NOT FIT'}")
    return (f"pinned host memory (offload) at batch {point.batch_size}: {point.host_reserved_bytes / GiB:.2f} GiB held "
            f"by the host allocator ({point.host_peak_bytes / GiB:.2f} GiB in tensors at once, traced); limit {limit}")


def plan_host_line(plan, host_limit_bytes: int | None) -> str:
    """One line for a plan row: rank 0's pinned host memory at its micro-batch, and the limit."""
    point = plan.point(plan.micro_batch)
    held = point.host_reserved_bytes if point else 0
    limit = ("not checked (give --host-memory, e.g. 512GiB)" if host_limit_bytes is None
             else f"{host_limit_bytes / GiB:.2f} GiB (--host-memory)")
    return (f"{plan.strategy} on {plan.gpus} GPUs: pinned host memory (offload) {held / GiB:.2f} GiB per rank at "
            f"micro-batch {plan.micro_batch} (traced), {held * plan.gpus / GiB:.2f} GiB for all {plan.gpus}; "
            f"limit {limit}")
