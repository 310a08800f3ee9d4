"""The sweep report and the noise-scale report: a result in, Markdown out (no torch)."""

from __future__ import annotations

from pathlib import Path

from batchfit.report import write_report
from batchfit.report.sweep_plots import curves_plot, loss_vs_batch_plot
from batchfit.report.write import StagedFiles, staged_files


def _loss(x: float | None) -> str:
    return "—" if x is None else f"{x:.4f}"


def _time(seconds: float | None) -> str:
    if not seconds:
        return "—"
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.1f} s"


STATUS = {"done": "✓ done", "oom": "✗ oom", "error": "✗ error", "running": "… running", "pending": "… pending"}


def noise_line(noise: dict) -> str:
    low, high = noise.get("b_simple_interval") or [None, None]
    if low is not None and high is not None:
        interval = f" (90% interval {low:,.1f} to {high:,.1f})"
    else:
        unbounded = noise.get("b_simple") is not None
        interval = " (90% interval unbounded: |G|^2 is not clearly above 0)" if unbounded else ""
    where = (f"at the initial parameters, {noise['repeats']} measurements" if noise["steps"] == 0 else
             f"tracked over {noise['steps']} training steps (figure and interval from the EMA's window, "
             f"EMA {noise['ema_beta']})")
    value = f"{noise['b_simple']:,.1f}" if noise.get("b_simple") is not None else "not positive (buried in noise)"
    return (f"gradient noise scale B_simple = {value} samples{interval}, from batch sizes "
            f"{noise['batch_sizes'][0]} and {noise['batch_sizes'][1]} {where}, {noise['seconds']:.0f} s")


def sweep_markdown(result) -> str:
    data = result.to_json()
    unit = result.unit
    budget = result.budget
    lines = [f"# Batch-size sweep: {result.workload}", "",
             f"- Model: {result.description or result.workload}",
             f"- Budget: exactly {budget['total']:,} {unit} per run"
             + (f" ({budget['total'] // budget['tokens_per_sample']:,} samples of {budget['tokens_per_sample']} tokens)"
                if unit == "tokens" else ""),
             f"- Data: {_data_line(result)}",
             f"- Schedule: {_schedule_line(result)}",
             f"- Store: `{result.store}`", "",
             "![best validation loss vs batch size](loss_vs_batch.png)", "",
             "![validation loss vs tokens](curves.png)", "", "## Answers", ""]
    best, fastest = data["best_batch_size"], data["fastest_batch_size"]
    runs = result.best_runs()
    if best is not None:
        lines.append(f"- **Best for quality: batch size {best}** (validation loss {runs[best]['best_val_loss']:.4f} "
                     f"at learning rate {runs[best]['lr']:.3g}), measured.")
    else:
        lines.append("- No run finished: no answer yet (`--resume` finishes the sweep).")
    if fastest is not None:
        reached = data["time_to_target"][str(fastest)]
        lines.append(f"- **Fastest to validation loss {data['target_loss']:.4f}: batch size {fastest}** "
                     f"({reached['step']:,} steps, {reached[unit]:,} {unit}, {_time(reached['seconds'])} on this "
                     "machine; time read as the run's seconds x the share of its steps).")
    if result.noise:
        lines.append(f"- Predicted critical batch (McCandlish et al. 2018): {noise_line(result.noise)}. "
                     "A prediction from gradient statistics, not a training run.")
    lines += ["", "## Results", "",
              "Per batch size, the learning rate with the best validation loss; every run is in `sweep.json`.", "",
              f"| Batch Size | Status | Steps | {unit.capitalize()} | Training Time | Final Train Loss | "
              "Final Val Loss | Best Val Loss | Learning Rate | Micro-batch |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    shown = dict(runs)
    for r in result.runs:  # a batch size with no finished run: show its failure
        shown.setdefault(r["batch_size"], r)
    for b in sorted(shown):
        r = shown[b]
        amount = r[unit] if r["status"] == "done" else None
        micro = (f"{r['accumulation_steps']} x {r['micro_batch']}" if r["accumulation_steps"] and
                 r["accumulation_steps"] > 1 else "—")
        lines.append(f"| {b} | {STATUS.get(r['status'], r['status'])} | {r['steps']:,} | "
                     f"{f'{amount:,}' if amount else '—'} | {_time(r['seconds'])} | {_loss(r['final_train_loss'])} | "
                     f"{_loss(r['final_val_loss'])} | {_loss(r['best_val_loss'])} | {r['lr']:.3g} | {micro} |")
    failed = [r for r in result.runs if r["status"] in ("oom", "error")]
    if failed:
        lines += ["", "## Failed runs", ""]
        lines += [f"- batch {r['batch_size']}, lr {r['lr']:.3g}: {r['status']}: {r['error']}" for r in failed]
    if len({r["lr"] for r in result.runs}) > 1:
        lines += ["", "## Every learning rate", "", "| batch | lr | status | best val loss |", "|---:|---:|---|---:|"]
        lines += [f"| {r['batch_size']} | {r['lr']:.3g} | {r['status']} | {_loss(r['best_val_loss'])} |"
                  for r in result.runs]
    notes = list(result.notes) + [r["note"] for r in result.runs if r["note"]]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _data_line(result) -> str:
    if result.data_kind == "text" and result.data_info:
        info = result.data_info
        return (f"`{info['source']}`, tokenizer {info['tokenizer']} ({info['vocab_size']:,} tokens), "
                f"{info['train_tokens']:,} train and {info['val_tokens']:,} validation tokens")
    if result.data_kind == "workload":
        return "the workload's own train_batches"
    return "**synthetic** (the workload's make_batch; validation batches drawn with a fixed seed)"


def _schedule_line(result) -> str:
    config = result.config
    return (f"warmup {config.get('warmup')} then cosine to {config.get('min_lr_ratio')} x the peak, in "
            f"{result.unit} (the same at every batch size); lr scaling {config.get('lr_scaling')}; "
            f"seed {config.get('seed')}; gradient clipping {config.get('grad_clip')}")


def write_sweep_report(result, out_dir: Path, files: StagedFiles | None = None) -> dict[str, Path]:
    """report.md, sweep.json and the two plots, all or none (``report.write_report``; with
    ``files``, with the caller's other outputs)."""
    if files is None:
        with staged_files() as files:
            return write_sweep_report(result, out_dir, files)
    paths = write_report(out_dir, "sweep.json", result.to_json(), lambda: sweep_markdown(result),
                         lambda path: loss_vs_batch_plot(result, path), plot_name="loss_vs_batch.png", files=files)
    paths["curves"] = files.write(out_dir / "curves.png", lambda path: curves_plot(result, path))
    return paths


def noise_markdown(noise: dict) -> str:
    lines = [f"# Gradient noise scale: {noise['workload']}", "", f"- {noise_line(noise)}.",
             "- Estimators: McCandlish et al. (2018), appendix A: |G|^2 and tr(Sigma) from squared gradient "
             "norms at the two batch sizes, averaged, then divided.",
             f"- Predicted critical batch: about {noise['critical_batch_prediction']:,.0f} samples"
             + (f" ({noise['b_simple_tokens']:,.0f} tokens)" if noise.get("b_simple_tokens") else "")
             if noise.get("critical_batch_prediction") else "- No prediction: the gradient signal was not positive.",
             f"- Data: {noise['data']}", "", "| measurement | mean abs(G_small)^2 | abs(G_big)^2 | abs(G)^2 est. | "
             "tr(Sigma) est. | B_simple (EMA) |", "|---:|---:|---:|---:|---:|---:|"]
    for m in noise["measurements"][:50]:
        ema = f"{m['b_simple_ema']:,.1f}" if m["b_simple_ema"] is not None else "—"
        lines.append(f"| {m['step']} | {m['g_small_sq']:.4g} | {m['g_big_sq']:.4g} | {m['g2']:.4g} | "
                     f"{m['trace']:.4g} | {ema} |")
    if len(noise["measurements"]) > 50:
        lines.append(f"\n({len(noise['measurements']) - 50} more in noise.json)")
    lines += [f"- {n}" for n in noise.get("notes", [])]
    return "\n".join(lines) + "\n"


def write_noise_report(noise: dict, out_dir: Path, files: StagedFiles | None = None) -> dict[str, Path]:
    """report.md and noise.json, all or none (``report.write_report``)."""
    return write_report(out_dir, "noise.json", noise, lambda: noise_markdown(noise), None, files=files)
