"""``batchfit recommend``'s report: report.md, recommend.json, branches.png (validation loss
against tokens, per branch) and sources.png (the recommendation beside the priors and the
noise scale). Reads the result's JSON only: no torch here."""

from __future__ import annotations

from pathlib import Path

from batchfit.report import write_report
from batchfit.report.write import StagedFiles, staged_files


def _fmt(x, spec: str = ",.0f") -> str:
    return "—" if x is None else format(x, spec)


def recommend_markdown(data: dict) -> str:
    unit = data["unit"]
    cost = data.get("cost_tokens", data.get("cost_samples"))
    sweep = data.get("sweep_tokens_equivalent", data.get("sweep_samples_equivalent"))
    low, high = data["recommended_interval"]
    lines = [f"# Recommended batch size: {data['workload']}", "",
             f"- **Batch size {data['recommended_batch_size']}** (interval {low}-{high}), learning rate "
             f"{data['lr']:.3g}, for {data['budget']:,} {unit} (branched training, measured and extrapolated).",
             f"- Critical batch size (largest batch within {data['epsilon']:.0%} of the smallest batch's loss, "
             f"Merrill et al. 2025): **{data['critical_batch_size']}**.",
             f"- Cost: {cost:,} {unit} ({data.get(f'cost_val_{unit}', 0):,} of them validated, forward only, counted "
             f"alike), {data['cost_share_of_sweep']:.1%} of the {sweep:,} a sweep of the same "
             f"{len(data['batch_sizes'])} batch sizes at the same budget would train and validate (counted by the "
             f"same rule, {data.get(f'sweep_val_{unit}', 0):,} validated).",
             *[f"- Weight decay {p['weight_decay']:.3g} at this batch and rate: {p['source']} (a formula's answer, "
               "not measured)." for p in data["sources"]["priors"] if p.get("weight_decay") is not None],
             f"- Parent at batch {data['batch_sizes'][0]}; branches at "
             f"{', '.join(f'{p:,}' for p in data['branch_points'])} {unit}, each {data['window']:,} {unit} long, the "
             f"last {data.get('cooldown', 0):.0%} of it a linear decay to the schedule's final rate; learning rate "
             f"scaled by {data['lr_scaling']} of the "
             "batch ratio; the last point repeated on "
             f"{data['seeds']} data window(s).", "", "## Evidence", "",
             "| source | batch size | learning rate | kind | note |", "|---|---:|---:|---|---|"]
    for row in data["evidence"]:
        lines.append(f"| {row['source']} | {_fmt(row['batch_size'])} | {_fmt(row['lr'], '.3g')} | {row['kind']} | "
                     f"{row['note']} |")
    lines += ["", "## Branches", "", f"| branch point ({unit}) | window | batch | lr | val at window end | "
              "extrapolated to budget |", "|---:|---:|---:|---:|---:|---:|"]
    for r in data["branches"]:
        lines.append(f"| {r['point']:,} | {r['seed']} | {r['batch_size']} | {r['lr']:.3g} | {r['window_val']:.4f} | "
                     f"{r['extrapolated_val']:.4f} |")
    lines += ["", "## How", "",
              "- Branched training (Merrill, Arora, Groeneveld, Hajishirzi 2025): each branch restores the parent's "
              "exact model, optimizer state, RNG state and data position, then trains at k x the batch.",
              "- Cooldown: each window ends with the rate decaying linearly to the schedule's final rate, so the "
              "branches are compared as the sweep's runs end, decayed; at peak rate a larger batch's lower gradient "
              "noise shows as a loss it keeps only while the rate is high.",
              "- Extrapolation: the parent's validation losses at the branch points give a power law in tokens "
              "(loss = a tokens^p); each branch's window-end validation loss is carried to the budget along it "
              "(one factor for all: the ranking at the window's end is kept).",
              "- Priors are formulas with their published constants, shown beside the measurements, never mixed in."]
    lines += ["", "## Notes", ""] + [f"- {n}" for n in data["notes"]]
    return "\n".join(lines) + "\n"


def branches_plot(data: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.5), dpi=120)
    ax = fig.add_subplot(1, 1, 1)
    parent = data["parent"]
    ax.plot([p for p, _ in parent["val"]], [v for _, v in parent["val"]], color="black", lw=1.5, marker="o",
            label=f"parent, batch {parent['batch_size']}")
    sizes = data["batch_sizes"]
    for curve in data["curves"]:
        color = f"C{sizes.index(curve['batch_size']) % 10}"
        xs = [curve["start"]] + [p for p, _ in curve["val"]]
        start_val = next((v for p, v in parent["val"] if p == curve["start"]), None)
        ys = ([start_val] if start_val is not None else []) + [v for _, v in curve["val"]]
        ax.plot(xs[-len(ys):], ys, color=color, lw=1, alpha=0.9 if curve["seed"] == 0 else 0.5,
                label=(f"batch {curve['batch_size']}"
                       if curve["seed"] == 0 and curve["point"] == data["branch_points"][0] else None))
    ax.set_xlabel(f"{data['unit']} trained on")
    ax.set_ylabel("validation loss")
    ax.set_title(f"{data['workload']}: branches from the parent run", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)


def sources_plot(data: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 3.5), dpi=120)
    ax = fig.add_subplot(1, 1, 1)
    rows = [r for r in data["evidence"] if r["batch_size"]]
    for i, row in enumerate(rows):
        ax.scatter(row["batch_size"], i, color="tab:green" if row["kind"] == "measured" else "tab:gray", s=40)
    low, high = data["recommended_interval"]
    ax.hlines(0, low, high, color="tab:green", lw=3, alpha=0.5)
    ax.set_yticks(range(len(rows)), [r["source"][:48] + f" ({r['kind']})" for r in rows], fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (samples, log scale)")
    ax.set_title("recommended (measured) vs priors (formulas)", fontsize=10)
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path)


def write_recommend_report(data: dict, out_dir: Path, files: StagedFiles | None = None) -> dict[str, Path]:
    """report.md, recommend.json, branches.png and sources.png, all or none."""
    if files is None:
        with staged_files() as files:
            return write_recommend_report(data, out_dir, files)
    paths = write_report(out_dir, "recommend.json", data, lambda: recommend_markdown(data),
                         lambda path: branches_plot(data, path), plot_name="branches.png", files=files)
    paths["sources"] = files.write(out_dir / "sources.png", lambda path: sources_plot(data, path))
    return paths
