"""The plan's picture: memory per GPU against local batch, one line per strategy, the
capacity drawn; and tokens/s per strategy. ``matplotlib.figure.Figure``, no pyplot (see
``plots.py``)."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

from batchfit.devices import GiB


def plan_plot(result, path: Path) -> None:
    plan_figure(result).savefig(path)


def plan_figure(result) -> Figure:
    """Memory per GPU by local batch and throughput by strategy. Memory is what the decision read
    (``result.limit``): under ``reserved``, each replayed size's reserved peak (dots) and the
    micro-batch's (star), with the allocated fit dotted beneath for the sizes not replayed."""
    fig = Figure(figsize=(12, 4.8), dpi=120)
    memory, speed = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    memory.xaxis.set_major_locator(MaxNLocator(integer=True))
    several_counts = len(result.worlds) > 1
    reserved = result.limit == "reserved"
    drawn = [p for p in result.plans if p.points]
    for i, p in enumerate(drawn):
        color = f"C{i % 10}"
        label = f"{p.strategy} x {p.gpus}" if several_counts else p.strategy
        top = max([pt.local_batch for pt in p.points] + [p.max_local_batch, 1])
        xs = list(range(1, int(top * 1.1) + 2))
        if p.curve is not None:
            memory.plot(xs, [p.curve.peak_bytes(x) / GiB for x in xs], color=color, lw=1.2,
                        ls=":" if reserved else "-", label=f"{label} (allocated fit)" if reserved else f"{label} (fit)")
        shown = [(pt.local_batch, pt.peak_reserved_bytes if reserved else pt.peak_bytes) for pt in p.points]
        shown = [(b, y) for b, y in shown if y is not None]
        memory.scatter([b for b, _ in shown], [y / GiB for _, y in shown], color=color, s=14, zorder=3,
                       label=f"{label} (reserved)" if reserved else None)
        at_micro = p.peak_reserved_bytes_at_micro if reserved else p.peak_bytes_at_micro
        if p.micro_batch and at_micro:
            memory.scatter([p.micro_batch], [at_micro / GiB], color=color, marker="*", s=90, zorder=4)
    memory.axhline(result.capacity_bytes / GiB, color="black", lw=1,
                   label=f"usable {result.capacity_bytes / GiB:.1f} GiB")
    memory.axhline(result.target_bytes / GiB, color="tab:orange", ls="--", lw=1,
                   label=f"target {result.target_util:.0%}")
    memory.set_xlabel("local batch (samples per GPU per micro-batch)")
    memory.set_ylabel(f"peak memory per GPU, rank 0, {result.limit} (GiB)")
    memory.set_title(("memory per GPU (dots: reserved, allocator model; stars the micro-batch)" if reserved else
                      "memory per GPU (traced; dots traced, stars the micro-batch)"), fontsize=10)
    memory.set_xlim(left=0)
    memory.set_ylim(bottom=0, top=result.capacity_bytes / GiB * 1.3)
    memory.grid(alpha=0.3)
    memory.legend(fontsize=7, loc="upper right")

    timed = [p for p in result.plans if p.fits and (p.tokens_per_s or p.samples_per_s)]
    names = [f"{p.strategy} x {p.gpus}" if several_counts else p.strategy for p in timed]
    values = [p.tokens_per_s or p.samples_per_s for p in timed]
    unit = "tokens/s" if timed and timed[0].tokens_per_s else "samples/s"
    recommended = {id(p) for p in result.recommended}
    speed.bar(range(len(timed)), values, color=["tab:green" if id(p) in recommended else "tab:gray" for p in timed])
    speed.set_xticks(range(len(timed)), names, rotation=30, ha="right", fontsize=8)
    speed.set_ylabel(f"{unit} (computed)")
    gb = f"global batch {result.global_batch}" if result.global_batch else "max global batch"
    speed.set_title(f"throughput at {gb} (computed; green: recommended)", fontsize=10)
    speed.grid(alpha=0.3, axis="y")
    if not timed:
        speed.text(0.5, 0.5, "no time: the GPU's peak FLOP/s is unknown", ha="center", transform=speed.transAxes)
    fig.suptitle(f"{result.workload} on {result.device.display_name}, {result.options.precision}", fontsize=11)
    fig.tight_layout()
    return fig


FAMILIES = {"data parallel": ("o", "tab:blue"), "tensor parallel": ("s", "tab:purple"), "pipeline": ("D", "tab:brown")}
"""Marker and colour of a combination by what it splits: samples only, the layers' matrices, or the layers."""


def ranking_plot(result, path: Path) -> None:
    ranking_figure(result).savefig(path)


def ranking_figure(result) -> Figure:
    """The ranking as a picture: predicted throughput against memory per GPU, one point per
    combination (named beside it: rank, strategy, micro-batch x accumulation), the best starred;
    one panel per GPU count (at most 4: the first 4); the usable memory and the target drawn; what
    does not fit or was skipped listed under the axes. With one strategy ranked per GPU count
    (seed 001's ``--strategies ddp`` over 1-4 GPUs) one panel of throughput by GPU count instead."""
    rows = result.ranking
    ranked = [row for row in rows if row.rank is not None and (row.tokens_per_s or row.samples_per_s)]
    unit = "tokens/s" if any(row.tokens_per_s for row in ranked) else "samples/s"
    what = "reserved" if result.limit == "reserved" else "allocated"
    if len(ranked) > 1 and all(sum(row.gpus == other.gpus for other in ranked) == 1 for row in ranked):
        return _scaling_figure(result, ranked, unit, what)
    worlds = result.worlds[:4]
    fig = Figure(figsize=(min(6.5 * len(worlds), 20) if len(worlds) > 1 else 10, 6), dpi=120)
    for n, world in enumerate(worlds):
        ax = fig.add_subplot(1, len(worlds), n + 1)
        shown: set[str] = set()
        mine = sorted((row for row in ranked if row.gpus == world.gpus), key=lambda row: row.rank)
        for i, row in enumerate(mine):
            gib = (row.reserved_bytes or row.allocated_bytes or 0) / GiB
            speed = row.tokens_per_s or row.samples_per_s
            family = "pipeline" if row.pp > 1 else "tensor parallel" if row.tp > 1 else "data parallel"
            marker, color = FAMILIES[family]
            ax.scatter([gib], [speed], color=color, marker=marker, s=55, zorder=3, edgecolor="black", linewidth=0.4,
                       label=None if family in shown else family)
            shown.add(family)
            if row.rank == 1:
                ax.scatter([gib], [speed], marker="*", s=260, color="tab:green", zorder=4, edgecolor="black",
                           linewidth=0.4, label="best")
            above = " (above target)" if row.status == "above target" else ""
            ax.annotate(f"{row.rank}. {row.strategy} {row.micro_batch}x{row.accumulation_steps}{above}", (gib, speed),
                        xytext=(6, 3 if i % 2 == 0 else -9), textcoords="offset points", fontsize=7)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))
        ax.axvline(result.capacity_bytes / GiB, color="black", lw=1,
                   label=f"usable {result.capacity_bytes / GiB:.1f} GiB")
        ax.axvline(result.target_bytes / GiB, color="tab:orange", ls="--", lw=1,
                   label=f"target {result.target_util:.0%}")
        ax.set_xlabel(f"memory per GPU at the micro-batch, rank 0, {what} (GiB, traced)", fontsize=8)
        if n == 0:
            ax.set_ylabel(f"{unit} (computed, MFU {result.time_model.mfu:.2f})")
        ax.set_xlim(left=0, right=result.capacity_bytes / GiB * 1.08)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
        ax.set_title(f"{world.gpus} GPU{'s' if world.gpus > 1 else ''}" + (f", {world.nodes} nodes" if world.nodes > 1
                                                                            else ""), fontsize=9)
        if not mine:
            ax.text(0.5, 0.5, "nothing ranked: no fit, or no time\n(the GPU's peak FLOP/s is unknown)", ha="center",
                    transform=ax.transAxes, fontsize=8)
    others = [row for row in rows if row.rank is None and any(row.gpus == w.gpus for w in worlds)]
    if others:
        text = "; ".join(f"{row.strategy}{f' x {row.gpus}' if len(worlds) > 1 else ''}: {row.status}"
                         for row in others[:12]) + ("; ..." if len(others) > 12 else "")
        fig.text(0.01, 0.01, "not ranked (report.md says why): " + text, fontsize=7, wrap=True)
    gb = f"global batch {result.global_batch}" if result.global_batch else "max global batch"
    fig.suptitle(f"{result.workload} on {result.device.display_name}, {result.options.precision}: every combination "
                 f"ranked, {unit} at {gb} against memory per GPU (labels: rank. strategy micro x accumulation)",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.05 if others else 0, 1, 1))
    return fig


def _scaling_figure(result, ranked: list, unit: str, what: str) -> Figure:
    """One combination per GPU count: its throughput by GPU count, each point labelled with its
    strategy, micro-batch x accumulation and memory per GPU, beside perfect scaling from the fewest GPUs."""
    fig = Figure(figsize=(8, 5), dpi=120)
    ax = fig.add_subplot(1, 1, 1)
    ranked = sorted(ranked, key=lambda row: row.gpus)
    gpus = [row.gpus for row in ranked]
    speeds = [row.tokens_per_s or row.samples_per_s for row in ranked]
    ax.plot(gpus, speeds, color="tab:blue", marker="o", lw=1.5, zorder=3, label=f"{unit} (computed)")
    if len(ranked) > 1:
        ax.plot(gpus, [speeds[0] * g / gpus[0] for g in gpus], color="gray", ls="--", lw=1,
                label=f"perfect scaling from {gpus[0]} GPU{'s' if gpus[0] > 1 else ''}")
    for row, speed in zip(ranked, speeds):
        gib = (row.reserved_bytes or row.allocated_bytes or 0) / GiB
        above = ", above target" if row.status == "above target" else ""
        ax.annotate(f"{row.strategy} {row.micro_batch}x{row.accumulation_steps}, {gib:.1f} GiB{above}",
                    (row.gpus, speed), xytext=(6, -12), textcoords="offset points", fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))
    ax.set_xlabel("GPUs")
    ax.set_ylabel(f"{unit} (computed, MFU {result.time_model.mfu:.2f})")
    ax.set_xlim(left=0, right=max(gpus) * 1.25)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    gb = f"global batch {result.global_batch}" if result.global_batch else "max global batch"
    # the figure's title, on three lines: centred on the axes, which wide tick labels ('1,200,000,000') push
    # right, one line with an H100's display name ended past the figure ('GPU coun')
    fig.suptitle(f"{result.workload} on {result.device.display_name}, {result.options.precision}\n{unit} at {gb} "
                 f"by GPU count\n(labels: strategy micro x accumulation, {what} GiB per GPU at the micro-batch, "
                 f"target {result.target_util:.0%} of {result.capacity_bytes / GiB:.1f} GiB)", fontsize=9)
    fig.tight_layout()
    return fig
