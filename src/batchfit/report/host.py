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
