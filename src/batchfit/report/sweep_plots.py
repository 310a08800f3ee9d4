"""Sweep plots: best validation loss vs batch size, and validation curves vs tokens.

``matplotlib.figure.Figure`` with no pyplot, as ``plots.py``: the user's backend is left alone.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure


def loss_vs_batch_plot(result, path: Path) -> None:
    """Per batch size, the best validation loss over its learning rates (log x); every
    rate's loss faint behind it; batch sizes that failed marked at the bottom."""
    fig = Figure(figsize=(7.5, 4.5), dpi=120)
    ax = fig.add_subplot(1, 1, 1)
    best = result.best_runs()
    done = [r for r in result.runs if r["status"] == "done" and r["best_val_loss"] is not None]
    lrs = sorted({r["lr"] for r in done})
    if len(lrs) > 1:
        for r in done:
            ax.scatter(r["batch_size"], r["best_val_loss"], color="tab:gray", alpha=0.35, s=14, zorder=2)
        ax.scatter([], [], color="tab:gray", alpha=0.35, s=14, label="each learning rate")
    xs = list(best)
    ax.plot(xs, [best[b]["best_val_loss"] for b in xs], marker="o", color="tab:blue", zorder=3,
            label="best over learning rates")
    for b in xs:
        ax.annotate(f"lr {best[b]['lr']:.2g}", (b, best[b]["best_val_loss"]), textcoords="offset points",
                    xytext=(4, 6), fontsize=7)
    failed = sorted({r["batch_size"] for r in result.runs if r["status"] in ("oom", "error")} - set(best))
    if failed and xs:
        low = min(best[b]["best_val_loss"] for b in xs)
        ax.scatter(failed, [low] * len(failed), marker="x", color="tab:red", s=50, zorder=4, label="oom / error")
    choice = result.best_batch_size()
    if choice is not None:
        ax.axvline(choice, color="tab:green", ls=":", lw=1, label=f"best: batch {choice}")
    if result.noise and result.noise.get("b_simple"):
        ax.axvline(result.noise["b_simple"], color="tab:purple", ls="--", lw=1,
                   label=f"noise scale B_simple {result.noise['b_simple']:.3g} (predicted)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (samples per step, log scale)")
    ax.set_ylabel("best validation loss")
    budget = result.budget
    ax.set_title(f"{result.workload}: {budget.get('total', 0):,} {budget.get('unit', 'tokens')} per run", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    if ax.get_legend_handles_labels()[0]:  # no finished run: no line to name
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def curves_plot(result, path: Path) -> None:
    """Validation loss against tokens (or samples) trained on, one line per batch size at
    its best learning rate: at one budget the lines end at the same x."""
    fig = Figure(figsize=(7.5, 4.5), dpi=120)
    ax = fig.add_subplot(1, 1, 1)
    unit = result.unit
    best = result.best_runs()
    colors = [f"C{i % 10}" for i in range(len(best))]
    for color, (b, run) in zip(colors, best.items()):
        points = run["curve"]["val"]
        xs = [(p["tokens"] if unit == "tokens" else p["samples"]) for p in points]
        ax.plot(xs, [p["loss"] for p in points], marker=".", color=color, label=f"batch {b} (lr {run['lr']:.2g})")
    target = result.target()
    if target is not None:
        ax.axhline(target, color="tab:gray", ls="--", lw=1, label=f"target {target:.3f}")
    ax.set_xlabel(f"{unit} trained on")
    ax.set_ylabel("validation loss")
    ax.set_title(f"{result.workload}: validation loss per batch size", fontsize=10)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
