"""The plan report: a PlanResult in, report.md, plan.png and plan.json out (no torch)."""

from __future__ import annotations

from pathlib import Path

from batchfit.devices import GiB
from batchfit.plan.ranking import ranked_by  # pure Python, no torch
from batchfit.plan.time_model import OVERLAP_RULE  # pure Python, no torch
from batchfit.report import write_report
from batchfit.report.host import plan_host_line as host_line_for_plan
from batchfit.report.markdown import approximation_lines, attention_rows, gib
from batchfit.report.plan_plots import plan_plot, ranking_plot
from batchfit.report.write import StagedFiles, staged_files

KNOWN_LIMITS = """\
- Memory is rank 0's, traced on a fake process group: every rank of DDP, FSDP and TP holds the
  same shapes, so rank 0 stands for all (uneven shards differ by at most one row per tensor).
{limit}
- Not counted: NCCL's own communication buffers and streams (outside PyTorch's allocator; a few
  hundred MiB per process group), and the CUDA context beyond the assumed 512 MiB.
- Time is **computed**, not measured: FLOPs counted on the traced step over an assumed (or
  calibrated) MFU, and ring-collective bytes over datasheet link bandwidths. Kernel launch
  overheads, stragglers and network contention are not modelled.
"""


LIMITS = {
    "reserved": """\
- What must fit is **reserved** memory (`--limit reserved`, the default): rank 0's allocations of a
  fresh process (the model's build, the first step, the second) replayed through batchfit's model
  of the CUDA caching allocator, as `estimate` does. The allocator model is checked against
  PyTorch's on its own streams, not against a GPU run of every strategy; NCCL's own buffers are
  outside it. Keep headroom with --target-util.""",
    "allocated": """\
- What must fit is **allocated** memory (`--limit allocated`: tensors, collective buffers, the cuBLAS
  workspace, with CUDA's 512-byte rounding); the caching allocator's fragmentation (reserved memory)
  is not counted: a size that fits here can still run out on a GPU. `--limit reserved` replays it.""",
}


def _at_micro(p) -> int | None:
    """The figure the limit was checked with at the micro-batch: reserved where replayed."""
    return p.peak_reserved_bytes_at_micro or p.peak_bytes_at_micro


def _s(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _n(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


def _days(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


TP_LOSS_WORDS = {
    "sharded": "sharded: logits split by the vocabulary, cross-entropy under loss_parallel (torchtitan's)",
    "gathered": "gathered: the whole logits all-gathered onto every rank (--tp-loss gathered)",
    "replicated": "replicated: the plan leaves the head whole, every rank computes the whole logits",
}


def _tp_loss_rows(r) -> list[str]:
    """The loss each tensor-parallel strategy traced, when there is one."""
    used = [(p.strategy, p.tp_loss) for p in r.plans if getattr(p, "tp_loss", None)]
    if not used:
        return []
    kinds = dict.fromkeys(kind for _, kind in used)
    text = "; ".join(f"{', '.join(dict.fromkeys(s for s, k in used if k == kind))}: {TP_LOSS_WORDS.get(kind, kind)}"
                     for kind in kinds)
    return [f"| Tensor-parallel loss | {text} |"]


SHARD_MEANING = {
    "fsdp-noreshard": "FSDP2 with reshard_after_forward=False: each block's gathered parameters kept from its "
                      "forward to its backward (ZeRO-2-like while the step runs), sharded at rest",
    "zero1": "DDP + torch's ZeroRedundancyOptimizer: optimizer state sharded, parameters and gradients "
             "replicated (ZeRO stage 1)",
    "zero2": "torch's ZeroRedundancyOptimizer, each gradient reduced to the rank that owns it: optimizer state "
             "and gradients sharded, parameters replicated (ZeRO stage 2)",
}
"""What the strategies whose names do not say it do (docs/tracing/zero.md)."""


DEGREES = ("pp", "dp", "cp", "tp", "ep")
"""A row's parallel degrees, in the order of the world's product (pp x dp x cp x tp; ep borrows from dp x tp)."""
DEGREE_WORDS = {"cp": "cp = context-parallel ranks (each holds 1/cp of every sample's sequence)",
                "ep": "ep = expert-parallel ranks (borrowed from dp x tp: each holds 1/ep of the experts)"}


def _degrees(rows) -> list[str]:
    """The degree columns of a table of ``rows``: dp and tp always, pp, cp and ep where a row has one."""
    return [k for k in DEGREES if k in ("dp", "tp") or any(getattr(row, k, 1) > 1 for row in rows)]


def _degree_cells(row, keys: list[str]) -> str:
    return "".join(f" {getattr(row, k)} |" for k in keys)


def _named(p) -> str:
    """A row's strategy, and the trace it was derived from when it was not traced itself."""
    return p.strategy + (f" (derived from the {p.derived_from_gpus}-GPU trace)" if p.derived_from_gpus else "")


def plan_markdown(result, plot_name: str = "plan.png") -> str:
    r = result
    d = r.device
    degrees = _degrees(r.plans)
    lines = [f"# Multi-GPU plan: {r.workload} on {d.display_name}, {r.options.precision}", ""]
    lines += approximation_lines(r)
    gb = f"global batch {r.global_batch}" if r.global_batch else "global batch = max local batch x dp"
    tokens = (f"{r.tokens:,.0f} tokens" + (" (chinchilla: 20 x parameters)" if r.tokens_asked == "chinchilla" else "")
              if r.tokens else "no --tokens given")
    what = ("reserved (traced, replayed through the caching allocator model)" if r.limit == "reserved"
            else "allocated (traced)")
    lines += ["## Recommended configuration", "",
              f"Per GPU count, the strategy with the most tokens/s at {gb}, micro-batch under "
              f"{r.target_util:.0%} of usable memory; days for {tokens}.", "",
              f"Memory limit: **{r.limit}** (`--limit {r.limit}`): every GiB figure below is rank 0's {what}"
              + ("; peak in: the step of a fresh process where the reserved peak is first reached "
                 "(a one-time peak outside the steady step is named)." if r.limit == "reserved" else "."), "",
              f"| GPUs | nodes | strategy | per-GPU micro-batch | accumulation steps | global batch | GiB per GPU "
              f"({r.limit}) | peak in | step s (computed) | tokens/s | days |",
              "|---:|---:|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for p in r.recommended:
        lines.append(f"| {p.gpus} | {p.nodes} | {p.strategy} | {p.micro_batch} | {p.accumulation_steps} | "
                     f"{p.global_batch} | {gib(_at_micro(p))} | {p.peak_step or '—'} | {_s(p.step_time_s)} | "
                     f"{_n(p.tokens_per_s)} | {_days(p.days)} |")
    if not r.recommended:
        lines.append("| — | — | nothing fits | | | | | | | | |")
    lines += ["",
              f"- Parameters: {r.params:,}",
              "- Source: memory **traced** (rank 0 of each strategy on a fake process group, PyTorch's own "
              "DDP / FSDP2 / DTensor code, fake tensors; no GPU was used); time **computed** (see below).",
              *[f"- `{shard}`: {SHARD_MEANING[shard]}." for shard in dict.fromkeys(p.shard for p in r.plans)
                if shard in SHARD_MEANING],
              "", f"![memory per GPU and tokens/s by strategy]({plot_name})", "",
              *ranking_lines(r, plot_name),
              "## Configuration", "", "| | |", "|---|---|",
              f"| Model | `{r.workload}`: {r.description} |",
              f"| Tokens per sample | {r.tokens_per_sample or '—'} |",
              f"| Precision | {r.options.precision} |",
              f"| Optimizer | {r.options.optimizer or 'the workload’s (AdamW by default)'} |",
              f"| Activation checkpointing | {r.options.checkpointing} |",
              *attention_rows(r.options),
              *_tp_loss_rows(r),
              f"| Frozen / train-only | {', '.join(r.options.frozen) or '—'} / "
              f"{', '.join(r.options.trainable) or '—'} |",
              f"| GPU | {d.display_name}: {gib(d.total_bytes)} GiB total, {gib(d.context_bytes)} GiB CUDA context "
              f"(assumed), {gib(d.usable_bytes)} GiB usable; target {r.target_util:.0%} = {gib(r.target_bytes)} GiB |",
              "| GPUs | " + ", ".join(f"{w.gpus} ({w.nodes} node{'s' if w.nodes > 1 else ''} of {w.gpus_per_node})"
                                      for w in r.worlds) + " |",
              f"| Strategies | {r.strategies_asked} |",
              f"| Local batch sizes | multiples of {r.multiple_of}"
              f"{'; a pipeline (pp<N>) also whole micro-batches' if any(p.pp > 1 for p in r.plans) else ''} |",
              f"| Traced | {r.traces} sharded steps in {r.trace_seconds:.1f} s |",
              "", "## Max batch by strategy", "",
              "Max global batch = max local batch x data-parallel degree (the ranks of one tensor-parallel group "
              "share their samples). At the max local batch, one step, no accumulation; then at the micro-batch "
              f"that reaches {gb}.", "",
              f"| GPUs | strategy |{''.join(f' {k} |' for k in degrees)} max local | max global | step s at max | "
              "tokens/s at max | micro x accum | GiB at micro | step s | tokens/s | days |",
              f"|---:|---|{'---:|' * len(degrees)}---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for p in r.plans:
        if p.skipped:
            why = p.skipped if p.bound_tokens_per_s is not None else f"skipped: {p.skipped}"  # 'not traced: ...'
            lines.append(f"| {p.gpus} | {p.strategy} |{_degree_cells(p, degrees)} {why} | | | | | | | | |")
            continue
        micro = (f"{p.micro_batch} x {p.accumulation_steps}" + (" (above target)" if p.above_target else "")
                 if p.fits else "does not fit")
        lines.append(f"| {p.gpus} | {_named(p)} |{_degree_cells(p, degrees)} {p.max_local_batch}"
                     f"{' (cap)' if p.capped else ''} | {p.max_global_batch} | "
                     f"{_s(p.time_at_max.step_time_s if p.time_at_max else None)} | {_n(p.tokens_per_s_at_max)} | "
                     f"{micro} | {gib(_at_micro(p))} | {_s(p.step_time_s)} | {_n(p.tokens_per_s)} | "
                     f"{_days(p.days)} |")
    lines += _time_section(r)
    lines += ["", "## Peak memory per GPU by local batch (traced, rank 0)", ""]
    order = ["parameters", "gradients", "optimizer", "optimizer_state", "activations", "collective", "temporaries",
             "inputs", "other", "workspace"]
    held = {k for p in r.plans for pt in p.points for k, v in pt.breakdown.items() if v}
    kinds = [k for k in order if k in held] + sorted(held - set(order))
    lines += ["| GPUs | strategy | local batch | peak GiB (allocated) | reserved GiB | reserved peak in | fits | "
              + " | ".join(k.replace("_", " ") for k in kinds) + " |", "|---:|---|---:|---:|---:|---|:-:|"
              + "---:|" * len(kinds)]
    for p in r.plans:
        for pt in p.points:
            replayed = getattr(pt, "reserved", None)
            reserved = ("cannot reserve" if replayed and replayed.reserved_oom
                        else gib(replayed.peak_reserved_bytes) if replayed else "—")
            fits = (pt.peak_bytes <= r.capacity_bytes if r.limit == "allocated" or not replayed
                    else pt.fits(r.capacity_bytes, "reserved"))
            lines.append(f"| {p.gpus} | {_named(p)} | {pt.local_batch} | {gib(pt.peak_bytes)} | {reserved} | "
                         f"{replayed.peak_step_name if replayed else '—'} | {'yes' if fits else 'no'} | "
                         + " | ".join(gib(pt.breakdown.get(k, 0)) for k in kinds) + " |")
        for only in p.replayed_only:  # replayed from a written stream, its step not traced
            replayed = only.reserved
            reserved = "cannot reserve" if replayed.reserved_oom else gib(replayed.peak_reserved_bytes)
            fits = replayed.reserved_oom is None and replayed.peak_reserved_bytes <= r.capacity_bytes
            lines.append(f"| {p.gpus} | {_named(p)} | {only.local_batch} | not traced | {reserved} | "
                         f"{replayed.peak_step_name} | {'yes' if fits else 'no'} | " + " | " * len(kinds))
    lines += _written_lines(r)
    misfits = [p for p in r.plans if not p.fits and not p.skipped]
    if misfits:
        lines += ["", "## What would make it fit", ""]
        for p in misfits:
            lines.append(f"- **{p.strategy} on {p.gpus} GPUs**: " + "; ".join(p.fix[:1]) + ". Computed options:")
            lines += [f"  - {fix}" for fix in p.fix[1:]]
    lines += ["", "## Known limits", "", KNOWN_LIMITS.format(limit=LIMITS[r.limit])]
    return "\n".join(lines)


def _written_lines(r) -> list[str]:
    """Where a reserved probe's stream was written from the line through traced ones (``trace/stream_line.py``)."""
    out = []
    for p in r.plans:
        w = p.reserved_written
        if w:
            out.append(f"- {_named(p)} on {p.gpus} GPUs: the reserved peak at local batch "
                       f"{', '.join(map(str, w['written']))} replayed from a fresh allocation stream written from "
                       f"the line through the streams traced at {' and '.join(map(str, w['through']))} (each "
                       f"allocation's bytes affine in the batch), checked event for event at "
                       f"{', '.join(map(str, w['checked_at']))}: the traced stream wherever the step's events do not "
                       "change between those sizes (`trace/stream_line.py`); a size only replayed has no traced row.")
    return ["", *out] if out else []


def _t(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def ranking_lines(r, plot_name: str = "plan.png") -> list[str]:
    """Seed 004's comparison for every combination: ranked by predicted tokens/s, each with its
    memory and its step time split; what does not fit or was not traced below, with why."""
    rows = r.ranking
    if len(r.plans) < 2:
        return []
    unit = "tokens/s" if any(row.tokens_per_s for row in rows) else "samples/s"
    gb = f"global batch {r.global_batch}" if r.global_batch else "global batch = micro-batch x dp (no --global-batch)"
    ranking_plot = plot_name.replace(".png", "-ranking.png")
    ranked = [row for row in rows if row.rank is not None]
    degrees = _degrees(ranked)
    out = ["## Ranking: every combination by predicted throughput", "",
           f"Per GPU count, each combination traced, by {ranked_by(rows)} at {gb}"
           f"{' (computed)' if ranked_by(rows) == unit else ''}, with rank 0's memory at its "
           f"micro-batch (traced; GiB = 2^30): allocated, and reserved (the caching allocator model) where replayed. "
           f"Step time per optimizer step = compute (FLOPs / (peak x MFU {r.time_model.mfu:.2f}, "
           f"{r.time_model.mfu_source})) + exposed communication (collectives not hidden behind compute) + pipeline "
           "bubble; dp = data-parallel ranks (samples split over them; a TP or pp group shares one rank's samples)"
           + "".join(f"; {DEGREE_WORDS[k]}" for k in DEGREE_WORDS if k in _degrees(rows)) + ".",
           "", f"![{unit} against memory per GPU, one point per combination]({ranking_plot})", "",
           f"| rank | GPUs | strategy |{''.join(f' {k} |' for k in degrees)} max local | max global | micro x accum | "
           f"GiB allocated | GiB reserved | compute s | exposed comm s | bubble s | step s | {unit} | vs best | days |",
           f"|---:|---:|---|{'---:|' * len(degrees)}---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in ranked:
        speed = row.tokens_per_s or row.samples_per_s
        out.append(f"| {row.rank} | {row.gpus} | "
                   f"{row.strategy}{' (above target)' if row.status == 'above target' else ''} |"
                   f"{_degree_cells(row, degrees)} {row.max_local_batch} | {row.max_global_batch} | "
                   f"{row.micro_batch} x {row.accumulation_steps} | {gib(row.allocated_bytes)} | "
                   f"{gib(row.reserved_bytes) if row.reserved_bytes else '—'} | {_t(row.compute_s)} | "
                   f"{_t(row.exposed_comm_s)} | {_t(row.bubble_s)} | {_s(row.step_time_s, 3)} | {_n(speed)} | "
                   f"{'—' if row.vs_best is None else f'{row.vs_best:.2f}x'} | {_days(row.days)} |")
    if not any(row.rank for row in rows):
        out.append("| — | | nothing fits |" + " |" * (len(degrees) + 12))
    others = [row for row in rows if row.rank is None]
    if others:
        out += ["", "Not ranked: what does not fit even at the smallest local batch (traced), what auto did not "
                "trace because the most it could reach is below the best traced row (`not traced`: a bound, not a "
                "traced figure), and what was not traced for another reason (the rule that cannot apply to this "
                "model):", "",
                f"| GPUs | strategy |{''.join(f' {k} |' for k in _degrees(others))} status | why |",
                f"|---:|---|{'---:|' * len(_degrees(others))}---|---|"]
        out += [f"| {row.gpus} | {row.strategy} |{_degree_cells(row, _degrees(others))} {row.status} | "
                f"{(row.why or '').replace('|', '/')} |" for row in others]
    if r.strategies_asked.strip().lower() == "auto":
        from batchfit.plan.candidates import bounds  # pure Python

        out += ["", "`--strategies auto` traced the combinations of `plan/candidates.py`'s rules in the order of "
                "the tokens/s each could reach (`plan/speed_bound.py`), none whose bound is below the best traced "
                "one's; to bound the tracing it leaves out (name any of them with --strategies to trace it):", "",
                *[f"- {line}" for line in bounds()]]
    return out + [""]


def _offload_lines(r) -> list[str]:
    """--offload: the host link, the transfer per micro-step and the pinned host memory."""
    if r.options.offload == "none":
        return []
    link = r.device.host_link or "PCIe Gen4 x16 (assumed: the GPU was given by its memory only)"
    gbps = r.device.host_link_gb_per_s or 32.0
    out = [f"- Offload ({r.options.offload}): host link {gbps:g} GB/s per direction, {link} (the signalling rate; "
           "copies overlap their own pass's compute on a side stream, forward = 1/3 and backward = 2/3 of it; "
           "what does not hide shows as time: plan/time_model.py)"]
    for p in r.recommended:
        out.append(f"- {host_line_for_plan(p, r.host_limit_bytes)}"
                   + (f"; activations {p.time.offload_transfer_s:.3f} s each way per micro-step, "
                      f"{p.time.offload_exposed_s:.3f} s exposed" if p.time and p.time.offload_transfer_s else "")
                   + (f"; parameter and gradient shards {p.time.communication_s['host']:.3f} s per micro-step "
                      f"({p.time.bytes_sent['host'] / GiB:.2f} GiB, overlapped with compute)"
                      if p.time and "host" in p.time.communication_s else ""))
    return out


def _other_comm(t, comm) -> str:
    """Groups beside dp and tp (ep<N>'s all-to-alls), named in the tp column."""
    return "".join(f"; {g}: {comm(g)}" for g in t.communication_s if g not in ("dp", "tp", "cp", "host"))


def _time_section(r) -> list[str]:
    tm, links = r.time_model, r.links
    # context parallelism's ring (cp<N> strategies) gets its own column
    cp_rows = any(p.time is not None and "cp" in p.time.communication_s for p in r.plans)
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
             f"- Overlap rule: {OVERLAP_RULE}", *_offload_lines(r), "",
             "Per micro-batch step (at the micro-batch), seconds:", "",
             "| GPUs | strategy | micro | TFLOP per GPU | compute | dp comm | tp comm | "
             + ("cp comm | " if cp_rows else "") + "overlapped | exposed | micro step | x accum | step |",
             "|---:|---|---:|---:|---:|---|---|" + ("---|" if cp_rows else "") + "---:|---:|---:|---:|---:|"]
    for p in r.plans:
        t = p.time
        if t is None:
            continue

        def comm(group: str) -> str:
            if group not in t.communication_s:
                return "—"
            return f"{t.communication_s[group]:.3f} ({t.links[group]}, {t.bytes_sent[group] / GiB:.2f} GiB sent)"

        lines.append(f"| {p.gpus} | {p.strategy} | {p.micro_batch} | {t.flops / 1e12:,.1f} | {t.compute_s:.3f} | "
                     f"{comm('dp')} | {comm('tp')}{_other_comm(t, comm)} | " + (f"{comm('cp')} | " if cp_rows else "")
                     + f"{t.overlapped_s:.3f} | {t.exposed_s:.3f} | {t.micro_step_s:.3f} | "
                     f"{t.accumulation_steps} | {t.step_time_s:.2f} |")
    return lines


def write_plan_report(result, out_dir: Path, files: StagedFiles | None = None,
                      trainer: dict | None = None) -> dict[str, Path]:
    """``trainer``: the ``--trainer`` section (``config/trainer.py``), added to the JSON and the report."""
    from batchfit.report.trainer_markdown import trainer_markdown

    data = result.to_json() if trainer is None else {**result.to_json(), "trainer": trainer}
    if files is None:
        with staged_files() as files:
            return write_plan_report(result, out_dir, files, trainer)
    paths = write_report(out_dir, "plan.json", data,
                         lambda: plan_markdown(result) + ("\n" + trainer_markdown(trainer) if trainer else ""),
                         lambda path: plan_plot(result, path), plot_name="plan.png", files=files)
    if len(result.plans) >= 2:  # the ranking's picture, beside plan.png, in the same all-or-none set
        paths["ranking_png"] = files.write(out_dir / "plan-ranking.png", lambda path: ranking_plot(result, path))
    return paths
