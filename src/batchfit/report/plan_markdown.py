"""The plan report: a PlanResult in, report.md, plan.png and plan.json out (no torch)."""

from __future__ import annotations

from pathlib import Path

from batchfit.devices import GiB
from batchfit.plan.time_model import OVERLAP_RULE  # pure Python, no torch
from batchfit.report import write_report
from batchfit.report.write import StagedFiles
from batchfit.report.markdown import approximation_lines, gib
from batchfit.report.plan_plots import plan_plot

KNOWN_LIMITS = """\
- Memory is rank 0's, traced on a fake process group: every rank of DDP, FSDP and TP holds the
  same shapes, so rank 0 stands for all (uneven shards differ by at most one row per tensor).
- What must fit is **allocated** memory (tensors, collective buffers, the cuBLAS workspace), with
  CUDA's 512-byte rounding; the caching allocator's fragmentation (reserved memory) is not
  replayed for sharded steps. Keep headroom with --target-util.
- Not counted: NCCL's own communication buffers and streams (outside PyTorch's allocator; a few
  hundred MiB per process group), and the CUDA context beyond the assumed 512 MiB.
- Time is **computed**, not measured: FLOPs counted on the traced step over an assumed (or
  calibrated) MFU, and ring-collective bytes over datasheet link bandwidths. Kernel launch
  overheads, stragglers and network contention are not modelled.
"""


def _s(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _n(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


def _days(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def plan_markdown(result, plot_name: str = "plan.png") -> str:
    r = result
    d = r.device
    lines = [f"# Multi-GPU plan: {r.workload} on {d.display_name}, {r.options.precision}", ""]
    lines += approximation_lines(r)
    gb = f"global batch {r.global_batch}" if r.global_batch else "global batch = max local batch x dp"
    tokens = (f"{r.tokens:,.0f} tokens" + (" (chinchilla: 20 x parameters)" if r.tokens_asked == "chinchilla" else "")
              if r.tokens else "no --tokens given")
    lines += ["## Recommended configuration", "",
              f"Per GPU count, the strategy with the most tokens/s at {gb}, micro-batch under "
              f"{r.target_util:.0%} of usable memory; days for {tokens}.", "",
              "| GPUs | nodes | strategy | per-GPU micro-batch | accumulation steps | global batch | GiB per GPU "
              "(traced) | step s (computed) | tokens/s | days |",
              "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for p in r.recommended:
        lines.append(f"| {p.gpus} | {p.nodes} | {p.strategy} | {p.micro_batch} | {p.accumulation_steps} | "
                     f"{p.global_batch} | {gib(p.peak_bytes_at_micro)} | {_s(p.step_time_s)} | "
                     f"{_n(p.tokens_per_s)} | {_days(p.days)} |")
    if not r.recommended:
        lines.append("| — | — | nothing fits | | | | | | | |")
    lines += ["",
              f"- Parameters: {r.params:,}",
              "- Source: memory **traced** (rank 0 of each strategy on a fake process group, PyTorch's own "
              "DDP / FSDP2 / DTensor code, fake tensors; no GPU was used); time **computed** (see below).",
              "", f"![memory per GPU and tokens/s by strategy]({plot_name})", "",
              "## Configuration", "", "| | |", "|---|---|",
              f"| Model | `{r.workload}`: {r.description} |",
              f"| Tokens per sample | {r.tokens_per_sample or '—'} |",
              f"| Precision | {r.options.precision} |",
              f"| Optimizer | {r.options.optimizer or 'the workload’s (AdamW by default)'} |",
              f"| Activation checkpointing | {r.options.checkpointing} |",
              f"| Frozen / train-only | {', '.join(r.options.frozen) or '—'} / {', '.join(r.options.trainable) or '—'} |",
              f"| GPU | {d.display_name}: {gib(d.total_bytes)} GiB total, {gib(d.context_bytes)} GiB CUDA context "
              f"(assumed), {gib(d.usable_bytes)} GiB usable; target {r.target_util:.0%} = {gib(r.target_bytes)} GiB |",
              f"| GPUs | " + ", ".join(f"{w.gpus} ({w.nodes} node{'s' if w.nodes > 1 else ''} of {w.gpus_per_node})"
                                      for w in r.worlds) + " |",
              f"| Strategies | {r.strategies_asked} |",
              f"| Local batch sizes | multiples of {r.multiple_of} |",
              f"| Traced | {r.traces} sharded steps in {r.trace_seconds:.1f} s |",
              "", "## Max batch by strategy", "",
              "Max global batch = max local batch x data-parallel degree (the ranks of one tensor-parallel group "
              "share their samples). At the max local batch, one step, no accumulation; then at the micro-batch "
              f"that reaches {gb}.", "",
              "| GPUs | strategy | dp | tp | max local | max global | step s at max | tokens/s at max | "
              "micro x accum | GiB at micro | step s | tokens/s | days |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for p in r.plans:
        if p.skipped:
            lines.append(f"| {p.gpus} | {p.strategy} | {p.dp} | {p.tp} | skipped: {p.skipped} | | | | | | | | |")
            continue
        micro = (f"{p.micro_batch} x {p.accumulation_steps}" + (" (above target)" if p.above_target else "")
                 if p.fits else "does not fit")
        lines.append(f"| {p.gpus} | {p.strategy} | {p.dp} | {p.tp} | {p.max_local_batch}"
                     f"{' (cap)' if p.capped else ''} | {p.max_global_batch} | "
                     f"{_s(p.time_at_max.step_time_s if p.time_at_max else None)} | {_n(p.tokens_per_s_at_max)} | "
                     f"{micro} | {gib(p.peak_bytes_at_micro)} | {_s(p.step_time_s)} | {_n(p.tokens_per_s)} | "
                     f"{_days(p.days)} |")
    lines += _time_section(r)
    lines += ["", "## Peak memory per GPU by local batch (traced, rank 0)", ""]
    order = ["parameters", "gradients", "optimizer", "optimizer_state", "activations", "collective", "temporaries",
             "inputs", "other", "workspace"]
    held = {k for p in r.plans for pt in p.points for k, v in pt.breakdown.items() if v}
    kinds = [k for k in order if k in held] + sorted(held - set(order))
    lines += ["| GPUs | strategy | local batch | peak GiB | fits | " + " | ".join(k.replace("_", " ") for k in kinds)
              + " |", "|---:|---|---:|---:|:-:|" + "---:|" * len(kinds)]
    for p in r.plans:
        for pt in p.points:
            lines.append(f"| {p.gpus} | {p.strategy} | {pt.local_batch} | {gib(pt.peak_bytes)} | "
                         f"{'yes' if pt.peak_bytes <= r.capacity_bytes else 'no'} | "
                         + " | ".join(gib(pt.breakdown.get(k, 0)) for k in kinds) + " |")
    misfits = [p for p in r.plans if not p.fits and not p.skipped]
    if misfits:
        lines += ["", "## What would make it fit", ""]
        for p in misfits:
            lines.append(f"- **{p.strategy} on {p.gpus} GPUs**: " + "; ".join(p.fix[:1]) + ". Computed options:")
            lines += [f"  - {fix}" for fix in p.fix[1:]]
    lines += ["", "## Known limits", "", KNOWN_LIMITS]
    return "\n".join(lines)


def _time_section(r) -> list[str]:
    tm, links = r.time_model, r.links
    lines = ["", "## Time (computed)", "",
             "compute = FLOPs rank 0 runs in the traced step / (GPU peak for the precision x MFU); a collective = "
             "bytes one rank sends in a ring (all-gather, reduce-scatter (n-1)/n x the tensor, all-reduce "
             "2(n-1)/n x) / link bandwidth.", "",
             f"- MFU: {tm.mfu:.2f}, {tm.mfu_source}",
             f"- Peak: {_s(r.device.peak_tflops(r.options.precision), 0)} TFLOP/s dense ({r.options.precision})",
             f"- Within a node: {links['intra_node_gb_per_s']:g} GB/s per GPU and direction: "
             f"{links['intra_node_source']}",
             f"- Between nodes: {links['inter_node_gb_per_s']:g} GB/s per GPU and direction: "
             f"{links['inter_node_source']}",
             f"- Overlap rule: {OVERLAP_RULE}", "",
             "Per micro-batch step (at the micro-batch), seconds:", "",
             "| GPUs | strategy | micro | TFLOP per GPU | compute | dp comm | tp comm | overlapped | exposed | "
             "micro step | x accum | step |",
             "|---:|---|---:|---:|---:|---|---|---:|---:|---:|---:|---:|"]
    for p in r.plans:
        t = p.time
        if t is None:
            continue

        def comm(group: str) -> str:
            if group not in t.communication_s:
                return "—"
            return f"{t.communication_s[group]:.3f} ({t.links[group]}, {t.bytes_sent[group] / GiB:.2f} GiB sent)"

        lines.append(f"| {p.gpus} | {p.strategy} | {p.micro_batch} | {t.flops / 1e12:,.1f} | {t.compute_s:.3f} | "
                     f"{comm('dp')} | {comm('tp')} | {t.overlapped_s:.3f} | {t.exposed_s:.3f} | {t.micro_step_s:.3f} | "
                     f"{t.accumulation_steps} | {t.step_time_s:.2f} |")
    return lines


def write_plan_report(result, out_dir: Path, files: StagedFiles | None = None,
                      trainer: dict | None = None) -> dict[str, Path]:
    """``trainer``: the ``--trainer`` section (``cli/trainer.py``), added to the JSON and the report."""
    from batchfit.report.trainer_markdown import trainer_markdown

    data = result.to_json() if trainer is None else {**result.to_json(), "trainer": trainer}
    return write_report(out_dir, "plan.json", data,
                        lambda: plan_markdown(result) + ("\n" + trainer_markdown(trainer) if trainer else ""),
                        lambda path: plan_plot(result, path), plot_name="plan.png", files=files)
