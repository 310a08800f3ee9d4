"""Plots: a result in, a PNG out. matplotlib's Agg backend, nothing shown on screen."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from batchfit.devices import GiB  # noqa: E402


def _finish(fig, ax, path: Path, title: str, ylabel: str) -> None:
    """Memory against batch size, both axes from zero; save and close."""
    ax.set_title(title)
    ax.set_xlabel("batch size (samples per step)")
    ax.set_ylabel(ylabel)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def memory_plot(result, path: Path) -> None:
    """Peak memory vs batch size: traced points, the fitted curve, capacity and target lines."""
    points = result.points
    top_batch = max([p.batch_size for p in points] + [result.max_batch_size, 1])
    xs = list(range(1, int(top_batch * 1.1) + 2))
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=120)
    ax.plot(xs, [result.curve.peak_bytes(x) / GiB for x in xs], color="tab:blue", lw=1.5,
            label="fitted curve (max over phases)")
    ax.scatter([p.batch_size for p in points], [p.peak_bytes / GiB for p in points],
               color="tab:blue", zorder=3, label="traced peak")
    ax.axhline(result.capacity_bytes / GiB, color="tab:red", ls="-", lw=1,
               label=f"usable capacity {result.capacity_bytes / GiB:.1f} GiB")
    ax.axhline(result.target_bytes / GiB, color="tab:orange", ls="--", lw=1,
               label=f"target {result.target_util:.0%}")
    if result.max_batch_size:
        best = result.point(result.max_batch_size)
        ax.annotate(f"max batch {result.max_batch_size}", (best.batch_size, best.peak_bytes / GiB),
                    textcoords="offset points", xytext=(-90, 12), arrowprops={"arrowstyle": "->"})
    _finish(fig, ax, path, f"{result.workload} on {result.device.display_name} (traced)",
            "peak memory allocated (GiB)")


def probe_plot(result, path: Path) -> None:
    """Measured (or virtual) peaks of the probes, failures at the top, capacity and target."""
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=120)
    capacity = result.capacity_bytes / GiB
    ok = [t for t in result.trials if t.fits and t.peak_allocated_bytes]
    failed = [t for t in result.trials if not t.fits]
    predicted = sorted((t.batch_size, t.predicted_bytes) for t in result.trials if t.predicted_bytes)
    if predicted and result.target.kind == "cuda":
        ax.plot([b for b, _ in predicted], [p / GiB for _, p in predicted], color="tab:gray", ls=":",
                label="traced prediction")
    ax.scatter([t.batch_size for t in ok], [t.peak_allocated_bytes / GiB for t in ok], color="tab:blue",
               zorder=3, label="fit (peak allocated)")
    reserved = [t for t in ok if t.peak_reserved_bytes]
    if reserved:
        ax.scatter([t.batch_size for t in reserved], [t.peak_reserved_bytes / GiB for t in reserved],
                   color="tab:cyan", marker="^", zorder=3, label="peak reserved")
    ax.scatter([t.batch_size for t in failed], [capacity] * len(failed), color="tab:red", marker="x", s=60,
               zorder=4, label="out of memory / error")
    ax.axhline(capacity, color="tab:red", lw=1, label=f"usable capacity {capacity:.1f} GiB")
    ax.axhline(result.target_util * capacity, color="tab:orange", ls="--", lw=1,
               label=f"target {result.target_util:.0%}")
    for i, t in enumerate(result.trials, 1):
        y = t.peak_allocated_bytes / GiB if t.peak_allocated_bytes else capacity
        ax.annotate(str(i), (t.batch_size, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    source = "virtual, traced" if result.target.kind == "virtual" else "measured"
    _finish(fig, ax, path, f"{result.workload}: probes ({result.policy}, {source})", "GiB")


def throughput_plot(result, path: Path) -> None:
    """Tokens/s (or samples/s) and memory against batch size, side by side."""
    rows = [r for r in result.rows if r.status == "ok"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2), dpi=120)
    xs = [r.batch_size for r in rows]
    speed = [r.tokens_per_s or r.samples_per_s for r in rows]
    if any(s is not None for s in speed):
        unit = "tokens/s" if rows and rows[0].tokens_per_s else "samples/s"
        left.plot(xs, speed, marker="o", color="tab:green")
        left.set_ylabel(unit)
    else:
        left.text(0.5, 0.5, "not timed (virtual device)", ha="center", va="center", transform=left.transAxes)
    left.set_xlabel("batch size")
    left.set_title("throughput")
    left.grid(alpha=0.3)
    right.plot(xs, [r.peak_allocated_bytes / GiB if r.peak_allocated_bytes else None for r in rows], marker="o",
               label="peak allocated")
    if any(r.peak_reserved_bytes for r in rows):
        right.plot(xs, [r.peak_reserved_bytes / GiB if r.peak_reserved_bytes else None for r in rows], marker="^",
                   label="peak reserved")
    if result.target.device:
        right.axhline(result.target.device.usable_bytes / GiB, color="tab:red", lw=1, label="usable capacity")
    right.set_xlabel("batch size")
    right.set_ylabel("GiB")
    right.set_title("memory")
    right.set_ylim(bottom=0)
    right.grid(alpha=0.3)
    right.legend(fontsize=8)
    fig.suptitle(f"{result.workload} on {result.target.spec}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
