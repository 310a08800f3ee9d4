"""The probe report: a ProbeResult in, Markdown out."""

from __future__ import annotations

from batchfit.devices import format_bytes
from batchfit.report.markdown import attention_rows, gib


def _source(result) -> str:
    if result.target.kind == "virtual":
        return ("**traced** (virtual device: the step runs on fake tensors with the GPU's usable capacity; "
                "no GPU was used)")
    if result.target.kind == "cuda":
        return "**measured** on the GPU (`torch.cuda.max_memory_allocated` / `max_memory_reserved`, reset per probe)"
    if r_device := result.target.device:
        return (f"**CPU time, traced memory**: each probe's memory is traced for the {r_device.display_name} "
                "(fake tensors with its usable capacity), then the step runs on the CPU for its time and loss")
    return "**measured** on the CPU (step times only: no memory figures)"


def probe_markdown(result, plot_name: str = "memory.png") -> str:
    r = result
    best = r.max_batch_size
    best_trial = r.trial(best)
    capacity = r.capacity_bytes
    device_name = r.target.device.display_name if r.target.device else "CPU"
    lines = [f"# Largest batch: {r.workload} on {device_name}, {r.options.precision}", "", "## Summary", ""]
    if r.stopped_by:
        t = r.stopped_by
        lines += [(f"- **The search stopped at batch {t.batch_size} with an error that is not out of memory:** "
                   f"`{t.error}`. Fix it and run again; the probes before it are kept below.") if r.search is None else
                  (f"- **The probe that checks a tier, batch {t.batch_size}, failed with an error that is not out "
                   f"of memory:** `{t.error}`. The maximum below ran; the tiers are predicted from the probes "
                   "before it. Fix it and run again."), ""]
    if best:
        if r.search and r.search.capped:
            verdict = "capped: the largest size allowed, --max; larger sizes were not tried"
        elif r.search and r.search.exact:
            verdict = f"exact: {r.search.next_size} did not fit"
        else:
            verdict = ("not shown to be "
                       "the largest: " + (f"{r.search.next_size} failed" if r.search and r.search.next_size
                                                          else "nothing above was probed"))
        lines += [f"- **Maximum batch size: {best}** ({verdict})"]
        if best_trial and best_trial.peak_allocated_bytes and capacity:
            # Headroom of the figure that must fit: reserved where it is known (a GPU runs out when it
            # cannot reserve a segment; --limit reserved), else allocated (--limit allocated).
            figure = "reserved" if best_trial.peak_reserved_bytes else "allocated"
            peak = best_trial.peak_reserved_bytes or best_trial.peak_allocated_bytes
            rule = "what a GPU runs out of" if r.target.kind == "cuda" else f"`--limit {r.limit}`"
            lines += [f"- Peak memory at {best}: {gib(best_trial.peak_allocated_bytes)} GiB allocated"
                      + (f", {gib(best_trial.peak_reserved_bytes)} "
                         "GiB reserved" if best_trial.peak_reserved_bytes else "")
                      + f", of {gib(capacity)} GiB usable; {figure} must fit ({rule}): {peak / capacity:.1%} used, "
                      f"headroom {gib(capacity - peak)} GiB"]
    elif not r.stopped_by:
        lines += [f"- **Not even batch {r.smallest} fits** on this device."]
    lines += [f"- Policy `{r.policy}`: {len(r.search.trials) if r.search else len(r.trials)} search probes, "
              f"{len(r.trials)} in all, {r.seconds:.1f} s" + (f", {r.world_size} "
                                                              "ranks agreeing" if r.world_size > 1 else ""),
              f"- Source: {_source(r)}", ""]
    if r.target.device:
        lines += [f"![memory vs batch size]({plot_name})", ""]
    lines += ["## Configuration", "", "| | |", "|---|---|",
              f"| Model | `{r.workload}`: {r.description} |",
              f"| Device | `{r.target.spec}`" + (f": {device_name}, {gib(r.target.device.total_bytes)} GiB total, "
                                                   f"{gib(capacity)} GiB usable |" if r.target.device else " |"),
              f"| Precision / checkpointing | {r.options.precision} / {r.options.checkpointing} |",
              *attention_rows(r.options),
              f"| Batch sizes | {r.smallest} to {r.largest}, multiples of {r.multiple_of} |",
              f"| Torch | {r.torch_version} |", "",
              "## Search", "",
              "| # | batch | status | peak allocated GiB | peak reserved GiB | predicted GiB | loss | step s | error |",
              "|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    search_count = len(r.search.trials) if r.search else len(r.trials)
    for i, t in enumerate(r.trials, 1):
        label = str(i) if i <= search_count else f"{i} (confirm)"
        loss = f"{t.loss:.4f}" if t.loss is not None else "—"
        step = f"{t.step_time_s:.3f}" if t.step_time_s is not None else "—"
        lines.append(f"| {label} | {t.batch_size} | {t.status} | {gib(t.peak_allocated_bytes)} | "
                     f"{gib(t.peak_reserved_bytes)} | {gib(t.predicted_bytes)} | {loss} | {step} | {t.error or ''} |")
    line = r.measured_line()
    if line:
        peaks = {"virtual": "traced peaks (virtual device)", "cuda": "measured peaks"}.get(
            r.target.kind, "traced peaks (for that GPU, the steps timed on the CPU)")
        figure = "reserved" if any(t.fits and t.peak_reserved_bytes for t in r.trials) else "allocated"
        how = ("per sample = (peak(b2) - peak(b1)) / (b2 - b1) through the two largest batches that fit, b1 < b2, "
               "and fixed = peak(b2) - per sample x b2" if line.phase == "measured" else
               "per sample = the traced slope (fake-tensor trace) through the one batch b that fit, "
               "and fixed = peak(b) - per sample x b")
        lines += ["", "## Memory per sample", "",
                  f"**{format_bytes(line.bytes_per_sample)} per sample** on top of {format_bytes(line.fixed_bytes)} "
                  f"fixed: {how}; peak = the {figure} bytes (the figure that must fit) of the {peaks}. "
                  "The predicted tiers below come from this line."]
    predicted = [t for t in r.trials if t.predicted_bytes and t.peak_allocated_bytes and r.target.kind == "cuda"]
    if predicted:
        lines += ["", "## Predicted (traced) vs measured", "", "| batch | traced GiB | measured GiB | error |",
                  "|---:|---:|---:|---:|"]
        for t in predicted:
            error = (t.predicted_bytes - t.peak_allocated_bytes) / t.peak_allocated_bytes
            lines.append(f"| {t.batch_size} | {gib(t.predicted_bytes)} | {gib(t.peak_allocated_bytes)} | "
                         f"{error:+.1%} |")
    if best_trial and r.tokens_per_sample:
        tokens = best * r.tokens_per_sample
        lines += ["", "## Throughput implication", "", f"- Tokens per batch at {best}: {tokens:,}"]
        if best_trial.step_time_s:
            lines += [f"- Time per batch (last probe step, measured): {best_trial.step_time_s:.3f} s",
                      f"- Tokens per second: {tokens / best_trial.step_time_s:,.0f}"]
        else:
            lines += ["- Time per batch: not measured on a virtual device (use `--device cuda`, or `batchfit bench`)"]
    if r.recommendations:
        lines += ["", "## Recommendations", "", "| setting | batch size | accumulation | peak GiB | source | why |",
                  "|---|---:|---:|---:|---|---|"]
        for rec in r.recommendations:
            lines.append(f"| {rec.name} | {rec.batch_size} | {rec.accumulation_steps} | "
                         f"{gib(rec.peak_allocated_bytes)} | {getattr(rec, 'source', 'probed')} | {rec.why} |")
        if any(rec.source == "predicted" for rec in r.recommendations):
            lines += ["", "Peak GiB: allocated where probed; where predicted, the memory-per-sample line's value "
                      "(the figure that must fit) at that batch."]
    return "\n".join(lines) + "\n"
