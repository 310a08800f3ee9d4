"""Markdown reports: a result in, text out."""

from __future__ import annotations

from batchfit.devices import GiB, format_bytes
from batchfit.report.host import host_line
from batchfit.workload import attention_words

KNOWN_LIMITS = """\
- Traced on fake tensors with CUDA's rules mirrored: 512-byte allocation rounding, CUDA's
  autocast op table and weight-cast cache, the foreach optimizer path, SDPA's fused kernels
  (output + fp32 log-sum-exp saved, no T x T scores; eager attention keeps its T x T scores, as
  on a GPU), optimizer step counters on the host.
- Not counted: scratch memory that kernels allocate inside themselves (flash attention's
  backward accumulator, cuDNN workspaces) and the NCCL buffers of multi-GPU runs.
- Reserved memory comes from a model of the CUDA caching allocator (segments, splitting,
  freeing the cache and retrying before an out-of-memory), not yet compared with a GPU's
  `max_memory_reserved()`; it ignores several streams and CUDA graphs.
- The CUDA context is an assumption (512 MiB), not a measurement; the cuBLAS workspace is
  PyTorch's default (2 handles x 32 MiB on Hopper, 2 x 8 MiB before).
"""


def gib(n: float | None) -> str:
    return "—" if n is None else f"{n / GiB:.2f}"


def _by_depth_note(r) -> str:
    """How a model traced by depth got its points: extrapolated from depths 2, 3, 4, or, where its
    memory is not affine in depth (generation's growing cache), traced whole at every size."""
    if not r.depth_blocks:
        return ""
    depths = ", ".join(map(str, r.depths))
    if len(set(r.full_traces)) == r.traces:
        return (f"; whole ({r.depth_blocks} blocks) at every batch size: depths {depths} did not lie on one "
                "line (memory is not affine in depth here)"
                + ("; reserved peaks replayed from the whole model's allocation streams" if r.limit == "reserved"
                   else ""))
    note = f"; at depths {depths} of {r.depth_blocks} blocks, extrapolated exactly (byte for byte affine)"
    if r.limit == "reserved":
        note += (f"; reserved peaks replayed from allocation streams written for {r.depth_blocks} blocks from the "
                 "depths' streams (checked event for event at the smaller depths)"
                 + (f", except batch sizes {', '.join(map(str, r.whole_reserved))} (traced whole)"
                    if r.whole_reserved else ""))
    return note


def _written_note(r) -> str:
    """Where the generation loop of an RL step was written instead of run (``trace/written.py``): exact, and
    checked, so the report says how, as it says how depths were extrapolated."""
    w = getattr(r, "written_generation", None)
    if not w:
        return ""
    sizes = lambda kind: ", ".join(map(str, w[kind]))  # noqa: E731
    note = f"; the generation loop traced at batch sizes {sizes('traced')}"
    if w["repeated"]:
        note += ", each measured step's loop written again from its warm-up step's record (the same shapes)"
    if w["line"]:
        note += (f"; at {sizes('line')} written from the line through the first two traced sizes (each allocation's "
                 f"size is affine in the rows; checked event for event at {sizes('checked_at')})")
    return note + " (docs/tracing/generation.md)"


def _unreplayed_note(r) -> list[str]:
    """Why a row's reserved cell is empty: the search replays through the allocator model only the sizes that decide
    the answer (``search.curve_search``), so a reader does not take "—" for a size that could not reserve."""
    if all(p.peak_reserved_bytes is not None or p.reserved_oom for p in r.points):
        return []
    if r.limit != "reserved":
        return ["", "Reserved \"—\": not replayed through the allocator model (what had to fit is allocated memory)."]
    return ["", "Reserved \"—\": not replayed through the allocator model; only the sizes that decide the answer are "
            "(a size that cannot reserve says so under fits)."]


def approximation_lines(result) -> list[str]:
    """A warning line per approximation the result carries (``trace/approximation.py``) and a notice line
    per option that changed nothing (``trace/noops.py``), then a gap."""
    found = [f"> **Warning: approximated.** {a.line()}" for a in getattr(result, "approximations", [])]
    found += [f"> **Notice.** {notice}" for notice in getattr(result, "notices", [])]
    return [*found, ""] if found else []


def attention_rows(options) -> list[str]:
    """The configuration table's attention row (``StepOptions.attention``, named by the engine): none
    for a model whose attention is its own code."""
    return [f"| Attention | {attention_words(options.attention)} |"] if options.attention is not None else []


def estimate_markdown(result, plot_name: str = "memory.png") -> str:
    r = result
    d = r.device
    best = r.max_batch_size
    lines = [f"# Batch size estimate: {r.workload} on {d.display_name}, {r.options.precision}", ""]
    lines += approximation_lines(r)
    limit = ("**reserved** memory (what the CUDA caching allocator holds, fragmentation included; a GPU runs "
             "out when it cannot reserve a segment), replayed through the allocator model"
             if r.limit == "reserved" else "**allocated** memory (`max_memory_allocated`, tensors only)")
    lines += ["## Summary", ""]
    if best:
        at_best = r.point(best)
        peak = at_best.peak_reserved_bytes or at_best.peak_bytes
        what = "reserved" if at_best.peak_reserved_bytes else "allocated"
        lines += [
            f"- **Largest batch that fits: {best}** (traced at {best} and {best + r.multiple_of}"
            f"{'; the cap (--max-batch), not shown to fail above' if r.capped else ''})",
            f"- **At {r.target_util:.0%} of usable memory: {r.max_batch_size_at_target}**",
            f"- What had to fit: {limit}",
            f"- Peak at {best}: {gib(peak)} GiB {what} of {gib(r.capacity_bytes)} GiB usable "
            f"({peak / r.capacity_bytes:.1%}; {gib(at_best.peak_bytes)} GiB allocated); "
            f"headroom {gib(r.capacity_bytes - peak)} GiB",
        ]
        if r.options.offload != "none":
            host = host_line(at_best, r.host_limit_bytes)
            lines += [f"- {host[0].upper()}{host[1:]}"]
    else:
        small = r.points[0]
        lines += [
            f"- **Even batch {small.batch_size} does not fit**: {r.why_smallest_does_not_fit()} "
            f"(peak in the {small.phase} phase).",
        ]
    if getattr(r, "split", None) is not None:
        lines.append(f"- **{r.split.line(r.target_util)[0].upper()}{r.split.line(r.target_util)[1:]}** "
                     "(--global-batch)")
    paged = r.points[0].paged_bytes if r.points else 0
    if paged:
        lines.append(f"- Paged optimizer state: {gib(paged)} GiB in CUDA unified memory (bitsandbytes' paged "
                     "optimizer), **not in the peak above**: it takes free device memory and spills to the host "
                     "when there is none (traced)")
    lines += [
        f"- Parameters: {r.params:,} ({r.trainable_params:,} trainable)",
        "- Source: **traced** on fake tensors (no GPU was used); every figure below is traced "
        "unless it says computed.",
        "",
        f"![peak memory vs batch size]({plot_name})",
        "",
        "## Configuration",
        "",
        "| | |", "|---|---|",
        f"| Model | `{r.workload}`: {r.description} |",
        f"| Tokens per sample | {r.tokens_per_sample or '—'} |",
        f"| Precision | {r.options.precision} |",
        f"| Optimizer | {r.options.optimizer or 'the workload’s (AdamW by default)'} |",
        f"| Activation checkpointing | {r.options.checkpointing} |",
        *attention_rows(r.options),
        *([f"| Quantized base (bitsandbytes) | {r.options.quantize} |"] if r.options.quantize != "none" else []),
        *([f"| LoRA (PEFT) | {r.options.lora} |"] if r.options.lora != "none" else []),
        f"| Gradient accumulation | {r.options.accumulation_steps} micro-batches |",
        f"| Frozen / train-only | {', '.join(r.options.frozen) or '—'} / {', '.join(r.options.trainable) or '—'} |",
        f"| GPU | {d.display_name}: {gib(d.total_bytes)} GiB total, {gib(d.context_bytes)} GiB CUDA "
        f"context (assumed), {gib(d.usable_bytes)} GiB usable |",
        f"| Batch sizes | multiples of {r.multiple_of} |",
        f"| Traced with | torch {r.torch_version}, {r.traces} traced batch sizes in {r.trace_seconds:.1f} s"
        + _by_depth_note(r) + _written_note(r) + " |",
        "",
        "## Peak memory by batch size (GiB)",
        "",
    ]
    # The categories that hold anything, in a fixed order (generation only for RL workloads).
    kinds = [k for k in ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "inputs",
                         "generation", "other", "workspace")
             if k in ("parameters", "activations") or any(p.breakdown.get(k) for p in r.points)]
    lines += ["| batch | peak allocated | reserved | fits | phase | "
              + " | ".join(k.replace("_", " ") for k in kinds) + " |",
              "|---:|---:|---:|:-:|---|" + "---:|" * len(kinds)]
    for p in r.points:
        lines.append(f"| {p.batch_size} | {gib(p.peak_bytes)} | {gib(p.peak_reserved_bytes)} | {r.fits(p)} | "
                     f"{p.phase} | "
                     + " | ".join(gib(p.breakdown.get(k, 0)) for k in kinds) + " |")
    lines += _unreplayed_note(r)
    refused = [p for p in r.points if p.reserved_oom]
    if refused:
        lines += ["", "## Where the allocator model runs out", "",
                  "Allocated memory fits at these sizes, but the caching allocator cannot reserve a segment "
                  "for a request (its message, as a GPU's `torch.OutOfMemoryError` would say it):", ""]
        lines += [f"- batch {p.batch_size}: {p.reserved_oom}" for p in refused]
    fit = r.curve.to_json(max(best, r.points[-1].batch_size), r.multiple_of)
    lines += ["", "## Memory curve (allocated)", "",
              "Each phase's peak is a line in the batch size; the step's peak is the largest of them, "
              "so the curve is made of pieces, each where one phase dominates:", "",
              "| batches | dominant phase | fixed | per sample |", "|---|---|---:|---:|"]
    for piece in fit["pieces"]:
        lines.append(f"| {piece['from_batch']}–{piece['to_batch']} | {piece['phase']} | "
                     f"{format_bytes(piece['fixed_bytes'])} | {format_bytes(piece['bytes_per_sample'])} |")
    peak_point = r.point(best) if best else r.points[0]
    lines += ["", f"## Largest tensors at the peak (batch {peak_point.batch_size})", "",
              "| size | shape | dtype | kind | made by | in module |", "|---:|---|---|---|---|---|"]
    for t in peak_point.top:
        lines.append(f"| {format_bytes(t['bytes'])} | {tuple(t['shape'])} | {t['dtype']} | {t['category']} | "
                     f"`{t['op']}` ({t['phase']}) | {t['module'] or '—'} |")
    if r.suggestions:
        lines += ["", f"## What would make batch {r.points[0].batch_size} fit", "",
                  "| change | how | peak | saving | fits | source |", "|---|---|---:|---:|:-:|---|"]
        for s in r.suggestions:
            lines.append(f"| {s.change} | `{s.option}` | {gib(s.peak_bytes)} GiB | {gib(s.saving_bytes)} GiB | "
                         f"{'yes' if s.fits else 'no'} | {s.source} |")
    lines += ["", "## Known limits", "", KNOWN_LIMITS]
    lines += [f"- {limit_text}" for limit_text in getattr(r, "known_limits", [])]
    return "\n".join(lines)
