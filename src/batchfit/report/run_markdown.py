"""The run over the data (``estimate --data --batching``): lines for the terminal, a section
for report.md, the length histogram. A result in, text and a PNG out; no torch."""

from __future__ import annotations

from pathlib import Path

from batchfit.devices import GiB
from batchfit.phases import RL_PHASES, deciding_rl_phase


def _gib(n: int | None) -> str:
    return "—" if n is None else f"{n / GiB:.2f} GiB"


def _step(run) -> str:
    shape = run.peak_shape
    samples = ""
    if run.peak_samples:
        first, last = run.peak_samples.start, run.peak_samples.stop - 1
        samples = (f"; samples {first}-{last}, the longest is sample {run.longest_sample}" if last > first
                   else f"; sample {first}")
    return f"step {run.peak_step} of {run.steps} ({shape.rows} x {shape.length:,} tokens{samples})"


def distribution_line(summary) -> str:
    s = summary.lengths
    return (f"data {summary.data}: {summary.samples:,} samples, tokens per sample min {s['min']:,}, median "
            f"{s['median']:,}, p90 {s['p90']:,}, p99 {s['p99']:,}, max {s['max']:,}; --batching {summary.batching}")


def _oom(run) -> str:
    if run.first_oom_step is None:
        return "does not fit"
    return (f"does not fit, first at step {run.first_oom_step} ({run.first_oom_shape.rows} x "
            f"{run.first_oom_shape.length:,} tokens)")


def rl_lines(result) -> list[str]:
    """An RL step's phases, each one's allocated peak, and the one that sets the step's (``phases.RL_PHASES``)."""
    found = getattr(result, "rl_phases", None)
    if found is None:
        return []
    batch_size, peaks = found
    deciding = deciding_rl_phase(peaks)
    # MiB under a GiB: the phases of a small model differ in the third decimal of a GiB
    shown = ", ".join(f"{RL_PHASES[name]} " + (_gib(nbytes) if nbytes >= GiB else f"{nbytes / 2**20:,.1f} MiB")
                      for name, nbytes in peaks.items())
    return [f"RL step at batch {batch_size}, each phase's allocated peak: {shown}; the {RL_PHASES[deciding]} "
            "sets the step's peak"]


def rl_markdown(result) -> str:
    lines = rl_lines(result)
    if not lines:
        return ""
    return "\n".join(["", "## The phases of the RL step", "",
                      ("Generation (the completions, sampled, with a KV cache), the reference log-probs (no gradients, "
                       "before the update) and the train update (forward, backward, optimizer step) run one after "
                       "another in each step; each one's allocated peak (traced), the largest decides."), "",
                      *[f"- {line}" for line in lines]]) + "\n"


def run_lines(result) -> list[str]:
    """What the terminal prints under the estimate's table: the answer in the batching's terms,
    the step that sets the peak, and the first step that does not fit at the next size up."""
    summary = result.run
    lines = [distribution_line(summary)]
    if summary.token_budget is not None:
        run = summary.runs[1]
        head = f"tokens:{summary.token_budget:,} " + ("fits" if run.verdict == "fits" else _oom(run))
        lines.append(f"{head}: the worst row is {_step(run)}, {_gib(run.peak_bytes)} allocated, "
                     f"{_gib(run.peak_reserved_bytes)} reserved")
        if summary.largest_budget is not None:
            lines.append(f"largest budget that fits: tokens:{summary.largest_budget:,} (every row at most "
                         f"{summary.fits_up_to:,} tokens, traced to fit)")
        else:
            lines.append(f"no budget fits: a row of the longest sample ({summary.lengths['max']:,} tokens) alone "
                         "does not")
        return lines + _churn_lines(summary)
    best = summary.max_batch_size
    if best:
        run = summary.runs[best]
        lines.append(f"the run: batch {best} fits every step of the data; its peak is {_step(run)}, "
                     f"{_gib(run.peak_bytes)} allocated, {_gib(run.peak_reserved_bytes)} reserved")
        if best == summary.rows:
            lines.append(f"batch {best} is the whole data in one step: no batch is larger (not --max-batch's cap)")
    above = [b for b in sorted(summary.runs) if b > best and summary.runs[b].verdict != "fits"]
    if above:
        lines.append(f"the run at batch {above[0]}: {_oom(summary.runs[above[0]])}")
    return lines + _churn_lines(summary)


def _churn_lines(summary) -> list[str]:
    """The allocator replays' verdicts (--replay-steps), under any batching."""
    return [churn.line() for churn in (summary.churn, getattr(summary, "churn_worst", None)) if churn is not None]


def _reserved(point) -> str:
    return "cannot reserve" if point.oom is not None else f"{_gib(point.peak_reserved_bytes)} reserved"


def _why(point) -> str:
    """Why an eval loop whose blocks the allocator model cannot place does not fit."""
    if point.oom is None:
        return ""
    if point.expandable_reserved_bytes is None:
        return " (the allocator model cannot place a block, nor with expandable segments)"
    return (f" (the allocator model cannot place a block, {_gib(point.peak_bytes)} allocated: fragmentation; with "
            f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True it reserves {_gib(point.expandable_reserved_bytes)}, "
            "at the cost that such memory cannot be shared over CUDA IPC nor used by CUDA graphs' private pools)")


def _held(phase) -> str:
    return (f", the logits of {phase.held_steps} eval steps held (eval_accumulation_steps {phase.held_steps})"
            if phase.held_steps > 1 else "")


def eval_lines(phase) -> list[str]:
    """The eval loop beside the train step: each phase's peak, the one that decides, and the eval batch to use."""
    asked, train = phase.asked, phase.train_shape
    lines = [f"train step at batch {phase.train_batch_size} ({train.rows} x {train.length:,} tokens): "
             f"{_gib(phase.train_peak_bytes)} allocated, {_gib(phase.train_peak_reserved_bytes)} reserved; "
             f"eval step at eval batch {phase.batch_size} ({asked.peak_shape.rows} x {asked.peak_shape.length:,} "
             f"tokens, no gradients, the whole logits{_held(phase)}): {_gib(asked.peak_bytes)} allocated, "
             f"{_reserved(asked)}; the {phase.deciding_phase} step sets the run's peak"]
    if phase.fits:
        lines.append(f"eval batch {phase.batch_size} fits after the training step")
    elif phase.max_batch_size:
        lines.append(f"eval batch {phase.batch_size} does not fit: the training step fits, its first evaluation "
                     f"runs out of memory{_why(asked)}; the largest eval batch that fits is {phase.max_batch_size} "
                     f"(per_device_eval_batch_size={phase.max_batch_size})")
    else:
        lines.append(f"eval batch {phase.batch_size} does not fit, nor does eval batch 1: the training step fits, "
                     "its first evaluation runs out of memory")
    return lines


def eval_markdown(phase) -> str:
    lines = ["", "## The eval loop", "",
             ("The training step at the answer, then HF Trainer's evaluation loop (model.eval(), no gradients, the "
              "model's whole output kept through the step; with eval_accumulation_steps K the logits of K steps held "
              "together) in the same process: the optimizer state and the allocator's cache are the training "
              "step's (traced; reserved by the allocator model)."), ""]
    lines += [f"- {line}" for line in eval_lines(phase)]
    lines += ["", "| eval batch | rows x tokens | peak allocated | peak reserved |", "|---:|---|---:|---:|"]
    lines += [f"| {p.batch_size} | {p.peak_shape.rows} x {p.peak_shape.length:,} | {_gib(p.peak_bytes)} | "
              f"{_reserved(p).removesuffix(' reserved')} |" for p in phase.traced or []]
    return "\n".join(lines) + "\n"


def churn_markdown(churn, shown: int = 60) -> list[str]:
    """Reserved memory step by step in both allocator replays (every step up to ``shown``, then evenly spaced)."""
    default, expandable = churn.default, {s.step: s for s in churn.expandable.steps}
    every = max(1, -(-len(default.steps) // shown))
    order = "the data's order" if churn.order == "data" else f"{churn.order} order (the worst of those tried)"
    lines = ["", f"### Allocator replay at batch {churn.batch_size}, {order}: {churn.verdict}", "",
             (f"The run's first steps, in {order}, one after another in one process (step 0 makes the "
             "optimizer state), their allocation stream replayed through the caching allocator model "
             "(traced; the allocator is a model, see Known limits)."), "",
             ("| step | rows x tokens | peak allocated | peak reserved | reserved after | cached, not allocated | "
             "reserved after (expandable segments) |"), "|---:|---|---:|---:|---:|---:|---:|"]
    for s in default.steps[::every]:
        other = expandable.get(s.step)
        routing = f" (--routing {s.routing})" if s.routing else ""
        lines.append(f"| {s.step} | {s.rows} x {s.length:,}{routing} | {_gib(s.peak_allocated_bytes)} | "
                     f"{_gib(s.peak_reserved_bytes)} | {_gib(s.reserved_bytes)} | {_gib(s.fragmentation_bytes)} | "
                     f"{_gib(other.reserved_bytes) if other else 'out of memory'} |")
    for replay in (churn.default, churn.expandable):
        if replay.first_oom_step is not None:
            lines.append(f"\n- {replay.config}: cannot place a block at step {replay.first_oom_step}: {replay.oom}")
    return lines


def run_markdown(result, plot_name: str = "lengths.png") -> str:
    summary = result.run
    lines = ["", "## The run over the data", "", f"- {distribution_line(summary)}"]
    lines += [f"- {line}" for line in run_lines(result)[1:]]
    lines += [(f"- The estimate above was traced at {summary.traced_length:,} tokens per row, the longest a step "
               "of this run makes; the peak only grows with the rows and the tokens per row, so the steps no "
               "other step covers decide the run (traced; the others are not). Steps count from 0 in the "
               "data's order."),
              "", f"![tokens per sample]({plot_name})", "",
              "| batch | steps | verdict | peak step | rows x tokens | peak allocated | peak reserved | first step "
              "that does not fit |",
              "|---:|---:|---|---:|---|---:|---:|---|"]
    for b, run in sorted(summary.runs.items()):
        first = "—" if run.first_oom_step is None else (f"{run.first_oom_step} ({run.first_oom_shape.rows} x "
                                                        f"{run.first_oom_shape.length:,})")
        lines.append(f"| {b} | {run.steps} | {run.verdict} | {run.peak_step} | {run.peak_shape.rows} x "
                     f"{run.peak_shape.length:,} | {_gib(run.peak_bytes)} | "
                     f"{_gib(run.peak_reserved_bytes)} | {first} |")
    for churn in (summary.churn, getattr(summary, "churn_worst", None)):
        if churn is not None:
            lines += churn_markdown(churn)
    lines += ["", "| tokens per sample | samples |", "|---|---:|"]
    lines += [f"| {low:,}–{high:,} | {count:,} |" for low, high, count in summary.histogram]
    return "\n".join(lines) + "\n"


def lengths_plot(summary, path: Path) -> None:
    """The histogram of tokens per sample, with the length the estimate was traced at."""
    from batchfit.report.plots import (
        _figure,  # matplotlib: only when a report is written
    )

    fig, (ax,) = _figure(7, 3.6)
    lows = [low for low, _, _ in summary.histogram]
    widths = [high - low + 1 for low, high, _ in summary.histogram]
    ax.bar(lows, [count for _, _, count in summary.histogram], width=widths, align="edge", color="tab:blue")
    ax.axvline(summary.traced_length, color="tab:red", lw=1,
               label=f"traced at {summary.traced_length:,} tokens per row")
    ax.set_title(f"{summary.data}: {summary.samples:,} samples, --batching {summary.batching}", fontsize=10)
    ax.set_xlabel("tokens per sample")
    ax.set_ylabel("samples")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
