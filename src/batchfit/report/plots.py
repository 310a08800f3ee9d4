"""Plots: a result in, a PNG out.

``matplotlib.figure.Figure`` draws straight to a file with no pyplot and no backend switch, so
``import batchfit`` leaves a notebook's backend (and its open figures) alone.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from batchfit.devices import GiB
from batchfit.tiers import TIERS


def _figure(width: float, height: float, panels: int = 1) -> tuple[Figure, list]:
    fig = Figure(figsize=(width, height), dpi=120)
    axes = [fig.add_subplot(1, panels, i + 1) for i in range(panels)]
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # batch sizes are whole samples
    return fig, axes


def _title(result, device: str) -> str:
    return f"{result.workload} on {device}, {result.options.precision}"


def _finish(fig, ax, path: Path, title: str, ylabel: str) -> None:
    """Memory against batch size, both axes from zero; save."""
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("batch size (samples per step)")
    ax.set_ylabel(ylabel)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def memory_plot(result, path: Path) -> None:
    """Peak memory vs batch size: traced points, the fitted curve, capacity and target lines."""
    points = result.points
    top_batch = max([p.batch_size for p in points] + [result.max_batch_size, 1])
    xs = list(range(1, int(top_batch * 1.1) + 2))
    fig, (ax,) = _figure(8, 4.8)
    ax.plot(xs, [result.curve.peak_bytes(x) / GiB for x in xs], color="tab:blue", lw=1.5,
            label="fitted curve (max over phases)")
    reserved = [p for p in points if p.peak_reserved_bytes]
    if reserved:
        ax.scatter([p.batch_size for p in reserved], [p.peak_reserved_bytes / GiB for p in reserved],
                   color="tab:cyan", marker="^", zorder=3, label="reserved (allocator model)")
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
    _finish(fig, ax, path, _title(result, result.device.display_name) + " (traced)", "peak memory (GiB)")


def probe_plot(result, path: Path) -> None:
    """Peaks of the probes, failures at the capacity line, and a zoom on the sizes that
    decided the answer (the largest that ran and the next one up)."""
    capacity = result.capacity_bytes / GiB
    ok = [t for t in result.trials if t.fits and t.peak_allocated_bytes]
    failed = [t for t in result.trials if not t.fits]
    best = result.max_batch_size
    deciding = [t for t in result.trials if best and best / 2 <= t.batch_size <= best * 1.5 + result.multiple_of]
    zoom = len({t.batch_size for t in deciding}) >= 2 and best and max(t.batch_size for t in result.trials) > 3 * best
    fig, axes = _figure(11 if zoom else 8, 4.8, panels=2 if zoom else 1)
    measured = "traced (virtual device)" if result.target.kind == "virtual" else "measured"
    for ax, trials in zip(axes, [result.trials, deciding]):
        ok_here = [t for t in ok if t in trials]
        ax.scatter([t.batch_size for t in ok_here], [t.peak_allocated_bytes / GiB for t in ok_here], color="tab:blue",
                   zorder=3, label=f"ran: peak allocated, {measured}")
        reserved = [t for t in ok_here if t.peak_reserved_bytes]
        if reserved:
            ax.scatter([t.batch_size for t in reserved], [t.peak_reserved_bytes / GiB for t in reserved],
                       color="tab:cyan", marker="^", zorder=3, label="peak reserved")
        failed_here = [t for t in failed if t in trials]
        ax.scatter([t.batch_size for t in failed_here], [capacity] * len(failed_here), color="tab:red", marker="x",
                   s=60, zorder=4, label="out of memory / error")
        ax.axhline(capacity, color="tab:red", lw=1, label=f"usable capacity {capacity:.1f} GiB")
        ax.axhline(result.target_util * capacity, color="tab:orange", ls="--", lw=1,
                   label=f"target {result.target_util:.0%}")
        if best:
            ax.axvline(best, color="tab:green", lw=1, ls=":", label=f"max batch {best}")
        ax.set_xlabel("batch size (samples per step)")
        ax.set_ylabel("GiB")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right", fontsize=7)
    axes[0].set_title(f"{_title(result, result.target.spec)}: {len(result.trials)} probes ({result.policy})",
                      fontsize=10)
    if zoom:
        axes[1].set_title(f"around the answer: {best} ran, {best + result.multiple_of} did not", fontsize=10)
        for t in deciding:  # in the zoom the labels have room
            y = t.peak_allocated_bytes / GiB if t.peak_allocated_bytes else capacity
            axes[1].annotate(str(t.batch_size), (t.batch_size, y), textcoords="offset points", xytext=(4, -12),
                             fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def throughput_plot(result, path: Path) -> None:
    """Memory against batch size as the tiers decide on it (reserved, else allocated), with each
    tier's limit and the batch it took; tokens/s (or samples/s) beside it when anything was timed
    (a virtual device times nothing: then memory alone, no empty panel)."""
    rows = [r for r in result.rows if r.status == "ok"]
    xs = [r.batch_size for r in rows]
    speed = [r.tokens_per_s or r.samples_per_s for r in rows]
    timed = any(v is not None for v in speed)
    fig, axes = _figure(10 if timed else 7, 4.2, panels=2 if timed else 1)
    memory = axes[-1]
    if timed:
        left = axes[0]
        unit = "tokens/s" if rows and rows[0].tokens_per_s else "samples/s"
        left.plot(xs, speed, marker="o", color="tab:green")
        left.set_ylabel(unit)
        left.set_xlabel("batch size")
        left.set_title("throughput")
        left.set_ylim(bottom=0)
        left.grid(alpha=0.3)
    # The tiers (and so the answer) decide on each row's reserved peak, else its allocated one
    # (tiers.py): draw that figure, each tier's limit, and the batch each tier took.
    reserved = any(r.peak_reserved_bytes for r in rows)
    decided = [(r.peak_reserved_bytes or r.peak_allocated_bytes) / GiB
               if (r.peak_reserved_bytes or r.peak_allocated_bytes) else None for r in rows]
    memory.plot(xs, decided, marker="o", color="tab:blue",
                label=f"peak {'reserved' if reserved else 'allocated'} (what the tiers decide on)")
    if reserved:
        memory.plot(xs, [r.peak_allocated_bytes / GiB if r.peak_allocated_bytes else None for r in rows], lw=1,
                    ls=":", color="tab:gray", label="peak allocated")
    if result.target.device:
        capacity = result.target.device.usable_bytes / GiB
        chosen = {t.name: t.batch_size for t in getattr(result, "tiers", [])}
        for (name, util), color in zip(TIERS, ("tab:red", "tab:orange", "tab:green", "tab:purple")):
            taken = f": batch {chosen[name]}" if name in chosen else ": none fits"
            memory.axhline(util * capacity, color=color, lw=1, ls="-" if util == 1.0 else "--",
                           label=f"{name}, {util:.0%} of usable{taken}")
            if name in chosen:
                at = decided[xs.index(chosen[name])]
                memory.plot([chosen[name]], [at], marker="*", ms=11, color=color, ls="none")
    memory.set_xlabel("batch size")
    memory.set_ylabel("GiB")
    memory.set_title("memory" + ("" if result.target.kind == "cuda" else " (traced)") + " and the tiers")
    memory.set_ylim(bottom=0)
    memory.grid(alpha=0.3)
    memory.legend(fontsize=8)
    fig.suptitle(_title(result, result.target.spec), fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
