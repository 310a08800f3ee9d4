"""The bench report: a BenchResult in, Markdown out."""

from __future__ import annotations

from batchfit.phases import PHASES
from batchfit.report.markdown import gib
from batchfit.tiers import TIERS
from batchfit.workload import attention_words


def _num(x: float | None, fmt: str = ",.0f") -> str:
    return "—" if x is None else format(x, fmt)


def bench_markdown(result, plot_name: str = "throughput.png") -> str:
    r = result
    device = r.target.device.display_name if r.target.device else "CPU"
    kind = r.target.kind
    source = {"cuda": "**measured** on the GPU: times with the device synchronised around each step, memory from "
                      "`max_memory_allocated` / `max_memory_reserved`",
              "virtual": "**traced**: memory from fake-tensor steps, reserved memory from the caching-allocator "
                         "model; no times (nothing ran on a GPU)",
              "cpu": "**CPU times** of real steps (no memory figures on a CPU)"}[kind]
    lines = [f"# Throughput and memory: {r.workload} on {device}", "",
             f"- Source: {source}. FLOPs are counted on the traced step (PyTorch's FlopCounterMode).",
             f"- {r.warmup} burn-in and {r.steps} timed steps per batch size" if kind != "virtual" else
             "- Each batch size traced in a fresh session (two steps, the second measured)",
             f"- Model: {r.description}; precision {r.options.precision}, checkpointing {r.options.checkpointing}"
             + (f"; attention {attention_words(r.options.attention)}" if r.options.attention is not None else ""), "",
             f"![{'memory' if kind == 'virtual' else 'throughput and memory'} vs batch size, with the tiers' limits]"
             f"({plot_name})", "",
             "## By batch size", "",
             "| batch | status | step s (min–max) | samples/s | samples/min | tokens/s | TFLOP/step | MFU | "
             "allocated GiB | reserved GiB | reserved, expandable GiB | source |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in r.rows:
        spread = (f"{row.step_time_s:.3f} ({row.step_time_min_s:.3f}–{row.step_time_max_s:.3f})"
                  if row.step_time_s else "—")
        lines.append(
            f"| {row.batch_size} | {row.status} | {spread} | {_num(row.samples_per_s, ',.1f')} | "
            f"{_num(row.samples_per_min, ',.0f')} | {_num(row.tokens_per_s)} | "
            f"{_num(row.flops_per_step / 1e12 if row.flops_per_step else None, ',.2f')} | "
            f"{_num(row.mfu * 100 if row.mfu is not None else None, '.1f')}{'%' if row.mfu is not None else ''} | "
            f"{gib(row.peak_allocated_bytes)} | {gib(row.peak_reserved_bytes)} | "
            f"{gib(row.reserved_expandable_bytes)} | {row.source}{': ' + row.error if row.error else ''} |")
    if r.options.offload != "none":
        lines += ["", f"Offload ({r.options.offload}), traced host bytes and the computed transfer (bytes / the GPU's "
                      "host link, each way per micro-batch; a measured GPU step already holds the real copies):", ""]
        lines += [f"- batch {row.batch_size}: pinned host memory {gib(row.host_reserved_bytes)} GiB; "
                  f"{gib(row.offloaded_bytes)} GiB copied out and back"
                  + (f", {row.offload_transfer_s:.3f} s each way" if row.offload_transfer_s is not None else "")
                  for row in r.rows if row.host_reserved_bytes is not None]
    seen = {p for row in r.rows for p in (*row.phase_peak_bytes, *row.phase_time_s)}
    phases = [p for p in PHASES if p in seen]  # in the order the step runs them
    if phases:
        lines += ["", "## By phase", "", "Peak memory (GiB) in each phase of the step" +
                  (", and mean time (s) per step" if any(row.phase_time_s for row in r.rows) else "") + ":", "",
                  "| batch | " + " | ".join(phases) + " |", "|---:|" + "---:|" * len(phases)]
        for row in r.rows:
            cells = []
            for p in phases:
                mem = gib(row.phase_peak_bytes.get(p)) if p in row.phase_peak_bytes else "—"
                t = f" / {row.phase_time_s[p]:.3f} s" if p in row.phase_time_s else ""
                cells.append(mem + t)
            lines.append(f"| {row.batch_size} | " + " | ".join(cells) + " |")
    if r.breakpoints:
        lines += ["", "## Where memory stops growing linearly", ""]
        for point in r.breakpoints:
            lines.append(f"- Between batch {point['between'][0]} and {point['between'][1]}: "
                         f"{point['bytes_per_sample_before'] / 2**20:.1f} → "
                         f"{point['bytes_per_sample_after'] / 2**20:.1f} MiB per sample; the peak moves from the "
                         f"{point['phase_before']} phase to the {point['phase_after']} phase. Largest "
                         "tensors after it: " +
                         ", ".join(f"{t['op']} {tuple(t['shape'])} {t['dtype']} ({t['category']})"
                                   for t in point["largest_after"]))
    if r.leak:
        leak = r.leak
        verdict = "**leaking**" if leak.leaking else "no leak"
        lines += ["", "## Leak check", "",
                  f"{leak.steps} steps: {verdict}, {leak.bytes_per_step:,.0f} bytes per step "
                  f"(allocated after each step: {', '.join(gib(a) for a in leak.allocated_bytes)} GiB)."]
        for w in leak.where:
            lines.append(f"- grows in `{w['op']}` ({w['phase']}{', ' + w['module'] if w['module'] else ''}): "
                         f"{w['bytes']:,} bytes still alive")
    if r.target.device is not None:
        lines += ["", "## Tiers", "", "From the benched batch sizes only (reserved memory where known):", "",
                  "| tier | memory used ≤ | batch | headroom GiB | tokens/s | samples/s |",
                  "|---|---:|---:|---:|---:|---:|"]
        found = {t.name: t for t in r.tiers}
        for name, util in TIERS:
            t = found.get(name)
            if t is None:  # say so, rather than drop the row
                lines.append(f"| {name} | {util:.0%} | — | — | — | no benched size fits under {util:.0%} of "
                             "usable memory |")
            else:
                lines.append(f"| {t.name} | {t.util:.0%} | {t.batch_size} | {gib(t.headroom_bytes)} | "
                             f"{_num(t.tokens_per_s)} | {_num(t.samples_per_s, ',.1f')} |")
    if r.hints:
        lines += ["", "## Troubleshooting", ""] + [f"- {h}" for h in r.hints]
    return "\n".join(lines) + "\n"
