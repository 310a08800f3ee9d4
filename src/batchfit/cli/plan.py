"""``batchfit plan``: per-GPU memory, max global batch, time and a launch config for many GPUs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from batchfit.cli.common import (
    AttentionOpt,
    BatchingOpt,
    CheckpointingOpt,
    CompileOpt,
    DataOpt,
    DeviceOpt,
    FreezeOpt,
    GpuMemoryOpt,
    GpuOpt,
    HostMemoryOpt,
    JsonOpt,
    LengthColumnOpt,
    LimitOpt,
    LossOpt,
    MemoryBudgetOpt,
    ModelArg,
    MultipleOfOpt,
    NoCacheOpt,
    OffloadOpt,
    OptimizerOpt,
    ParamGroupsOpt,
    PrecisionOpt,
    RoutingOpt,
    SeqLenOpt,
    TargetUtilOpt,
    TokenizerOpt,
    TrainOnlyOpt,
    capped_words,
    check_outputs,
    handle_errors,
    out_option,
    progress_line,
    quiet_if_stdout,
    report_folder,
    say_attention,
    say_dim,
    say_notices,
    sequence_words,
    warn_about_approximations,
    warn_about_precision,
    write_outputs,
)
from batchfit.cli.flags import as_flags
from batchfit.cli.torchtitan import print_torchtitan
from batchfit.cli.trainer import TrainerOpt, print_answer, print_data_rows, print_mapping
from batchfit.config.step import StepFlags
from batchfit.config.torchtitan import (
    torchtitan_approximation,
    torchtitan_section,
)
from batchfit.config.trainer import (
    emitted_text,
)
from batchfit.devices import GiB
from batchfit.plan.request import DEFAULT_STRATEGIES
from batchfit.search import DEFAULT_MAX_BATCH
from batchfit.specs import load_workload

EXAMPLES = """
Examples:

  batchfit plan hf:llama-3.1-8b --gpu h100-80gb --gpus 8 --seq-len 8192 --precision bf16-mixed --checkpointing full --strategies ddp,fsdp,fsdp+tp2,fsdp+tp4 --global-batch 512 --tokens chinchilla

  batchfit plan frozen-pair --gpu h100-80gb --gpus 1,2,3,4 --strategies ddp --precision bf16-mixed --target-util 0.8 --emit config.yaml

  batchfit plan hf:qwen2.5-7b --gpu a100-80gb --nodes 2 --gpus-per-node 8 --strategies auto --precision bf16-mixed
"""  # noqa: E501 - each example is a command line to copy whole from --help


@handle_errors
def plan_command(
    model: ModelArg,
    gpu: GpuOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    device: DeviceOpt = None,
    gpus: Annotated[str | None, typer.Option(help="GPUs: a count (8) or counts for a table by GPU count (1,2,3,4); "
                                                  "above 8, nodes of 8.")] = None,
    nodes: Annotated[int | None, typer.Option(help="Nodes (with --gpus-per-node): multi-node plans.")] = None,
    gpus_per_node: Annotated[int | None, typer.Option(help="GPUs in each node.")] = None,
    strategies: Annotated[str, typer.Option(help="Comma-separated: ddp, fsdp (ZeRO-3), fsdp-noreshard (FSDP2 "
                                                 "reshard_after_forward=False: gathered parameters kept "
                                                 "from forward to backward, sharded at rest), zero1 (DDP + "
                                                 "ZeroRedundancyOptimizer: optimizer state sharded), zero2 (optimizer "
                                                 "state and gradients sharded, parameters replicated), hsdp<R>, tp<N>, "
                                                 "fsdp+tp<N>, fsdp+cp<N>[+tp<T>], ddp+cp<N> (context parallelism: "
                                                 "sequence/N per rank, ring attention), ep<N>+fsdp[+tp<M>] (MoE expert "
                                                 "parallelism; with tp torchtitan's etp=1 layout), "
                                                 "pp<N>[+any of these] (pipeline stages: pp4+fsdp, "
                                                 "pp2+fsdp+tp2); or auto: every combination of plan/candidates.py's "
                                                 "rules (the 5 above, hsdp<R>, tp within a node, pp<N>+fsdp[+tp] when "
                                                 "the layers split), ranked by tokens/s: at most 7 candidates on 2 "
                                                 "GPUs, 11 on 4, 15 on 8, 17 on 64 (those that cannot apply are "
                                                 "listed, not traced), traced highest tokens/s bound first; one whose "
                                                 "bound is below the best traced row is a 'not traced' row with its "
                                                 "bound and formula, never a traced figure (docs/tracing/auto.md); a "
                                                 "list traces all of its strategies.")]
    = DEFAULT_STRATEGIES,
    global_batch: Annotated[int | None, typer.Option(help="Samples per optimizer step over all GPUs; the plan picks "
                                                          "micro-batch x accumulation to reach it.")] = None,
    tokens: Annotated[str | None, typer.Option(help="Tokens to train on, for days: a count (2e11) or chinchilla "
                                                    "(20 x parameters).")] = None,
    seq_len: SeqLenOpt = None,
    data: DataOpt = None,
    batching: BatchingOpt = None,
    length_column: LengthColumnOpt = None,
    tokenizer: TokenizerOpt = None,
    precision: PrecisionOpt = "fp32",
    optimizer: OptimizerOpt = None,
    param_groups: ParamGroupsOpt = "one",
    checkpointing: CheckpointingOpt = "none",
    loss: LossOpt = "plain",
    offload: OffloadOpt = "none",
    routing: RoutingOpt = "balanced",
    attention: AttentionOpt = None,
    host_memory: HostMemoryOpt = None,
    compile_: CompileOpt = "none",
    tp_loss: Annotated[str, typer.Option(help="Under tp<N> / fsdp+tp<N>: sharded (the logits stay split by the "
                                              "vocabulary, loss_parallel, as torchtitan) or gathered (the whole "
                                              "logits on every rank).")] = "sharded",
    memory_budget: MemoryBudgetOpt = None,
    freeze: FreezeOpt = None,
    train_only: TrainOnlyOpt = None,
    batch_sizes: Annotated[str | None, typer.Option(help="Also trace these local batch sizes, e.g. 1,2,4.")] = None,
    target_util: TargetUtilOpt = 0.9,
    multiple_of: MultipleOfOpt = 1,
    max_batch: Annotated[int, typer.Option(help="Never consider local batches above this.")] = DEFAULT_MAX_BATCH,
    limit: LimitOpt = "reserved",
    mfu: Annotated[float | None, typer.Option(help="Model FLOPs utilisation for the computed time (default 0.4, "
                                                   "assumed).")] = None,
    calibrate: Annotated[Path | None, typer.Option(help="Take the MFU from `batchfit bench --device cuda --json` "
                                                        "output.")] = None,
    intra_node_gb_per_s: Annotated[float | None, typer.Option(help="GPU-to-GPU GB/s within a node, per direction "
                                                                   "(default: the GPU catalog's).")] = None,
    inter_node_gb_per_s: Annotated[float | None, typer.Option(help="GB/s per GPU between nodes, per direction "
                                                                   "(default: the GPU catalog's).")] = None,
    emit: Annotated[list[str] | None, typer.Option(help="Write the recommended configuration: FILE (YAML + torchrun "
                                                        "line), accelerate:FILE (Accelerate config), "
                                                        "torchtitan:FILE (a torchtitan job toml's [parallelism] and "
                                                        "batch sizes; patches the torchtitan:job.toml planned) or "
                                                        "trainer:FILE (the --trainer args with the recommended batch); "
                                                        "repeatable.")]
    = None,
    processes: Annotated[int | None, typer.Option(help="Strategies traced at once, one process each (default: one "
                                                       "per CPU core); 1 traces them one after another.")] = None,
    json_path: JsonOpt = None,
    out: Annotated[Path | None, out_option("report.md, plan.png, plan.json")] = None,
    trainer: TrainerOpt = None,
    pp_schedule: Annotated[str, typer.Option(help="Pipeline schedule of pp<N> strategies: gpipe, 1f1b, "
                                                  "interleaved-1f1b[:V] (V stages per GPU, default 2), the "
                                                  "zero-bubble interleaved-zb[:V], zbv (V-shaped: GPU 0 holds the "
                                                  "first and last stage) or dualpipev; torchtitan's names work too "
                                                  "(ZBVZeroBubble). Zero-bubble ones need fsdp-noreshard inside.")
                 ] = "1f1b",
    microbatches: Annotated[int, typer.Option(help="Pipeline micro-batches per step of pp<N> strategies (default: "
                                                   "as many as the stages); the local batch is split into them.")] = 0,
    no_cache: NoCacheOpt = False,
) -> None:
    """Plan a multi-GPU run: memory per GPU, max global batch, step time and a launch config.

    Traces rank 0's real sharded step (DDP, FSDP2, HSDP, TP, FSDP+TP: PyTorch's own code on a
    fake process group, fake tensors, no GPU) at a few local batch sizes for every strategy and
    GPU count, finds the largest local batch that fits (traced and confirmed), the micro-batch
    and accumulation that reach --global-batch, and computes step time from the FLOPs and
    collective bytes the trace counted.
    """
    given = dict(locals())  # every flag, by name: config/plan.py's PlanFlags and StepFlags pick theirs
    # the planner, its config and emitters (about 0.1 CPU-s of imports): here, not for --help or another command
    from batchfit.config.plan import PlanFlags, plan_config, read_plan_doors, trainer_answer
    from batchfit.plan.emit import write_emit
    from batchfit.plan.engine import plan
    from batchfit.report.plan_markdown import write_plan_report  # matplotlib: not for --help

    doors = read_plan_doors(model, trainer, emit)
    check_outputs(json_path, out, *doors.output_files())
    config = plan_config(PlanFlags.pick(given), StepFlags.pick(given), doors, say=say_dim)
    door, titan, options = doors.door, doors.titan, config.options
    warn_about_precision(config.target, options.precision)
    console = quiet_if_stdout(json_path)
    if door is not None:
        print_mapping(door, console)
    if titan is not None:
        print_torchtitan(titan, console)
    workload = load_workload(model, seq_len=config.seq_len, for_plan=True)
    from batchfit.trace.noops import no_op_notices

    notices = no_op_notices(workload, options)
    say_notices(notices)
    with progress_line() as say:
        result = plan(workload, config.request, device=config.target.device, options=options, progress=say)
    if titan is not None:
        result.approximations.append(torchtitan_approximation(titan))
    folder = report_folder(out, "plan", result.workload, config.target, options, config.seq_len)
    fitted = trainer_answer(result) if door is not None else None
    section = door.section(fitted) if door is not None else None
    data = {**result.to_json(), "notices": notices, **({"trainer": section} if section is not None else {}),
            **({"data": config.data_section} if config.data_section is not None else {}),
            **({"torchtitan": torchtitan_section(titan, result)} if titan is not None else {})}

    def write_all(files):  # the report, every --emit and --json: all or none, JSON last
        paths = write_plan_report(result, folder, files, trainer=section)
        source = titan.path if titan is not None else None
        written = [files.write(path, lambda temporary, kind=kind: write_emit(kind, temporary, result,
                                                                             torchtitan_source=source))
                   for kind, path in config.emits]
        if fitted is not None and fitted["per_device_train_batch_size"] is not None:
            written += [files.text(path, emitted_text(door, fitted)) for path in doors.trainer_emits]
        return paths, written

    paths, written = write_outputs(json_path, data, write_all)
    print_data_rows(config.data_section, console)
    _print_summary(result, console, paths["md"], written)
    if fitted is not None:
        print_answer(fitted, console)
    warn_about_approximations(result)


def _named(p, several: bool) -> str:
    return f"{p.strategy} on {p.gpus} GPUs" if several else p.strategy


def _timed(result) -> bool:
    """Whether any row has a computed step time (a named GPU's FLOP/s; not with --gpu-memory alone)."""
    return any(row.tokens_per_s or row.samples_per_s for row in result.ranking)


def _print_summary(result, console, report_path: Path, written: list[Path]) -> None:
    from batchfit.plan.ranking import ranked_by  # loaded by the planner already

    console.print(f"[bold]{escape(result.workload)} on {escape(result.device.display_name)}, "
                  f"{result.options.precision}{sequence_words(result.tokens_per_sample)} "
                  f"(memory traced{', time computed' if _timed(result) else '; no time: no FLOP/s for this GPU'})[/]")
    say_attention(result.options, console)
    console.print("memory: " + ("reserved (rank 0's fresh process replayed through the caching allocator model: "
                                "what a GPU runs out of)" if result.limit == "reserved"
                                else "allocated (tensors only; --limit reserved for what a GPU runs out of)"))
    console.print(_ranking_table(result))
    rows, several, unit = result.ranking, len(result.worlds) > 1, ranked_by(result.ranking)
    if any(row.rank for row in rows):
        by = f"{unit} (computed, MFU {result.time_model.mfu:.2f})" if unit.endswith("/s") else unit
        console.print(f"ranked by {by}; memory at the micro-batch "
                      "(traced, rank 0); comm: exposed communication per step"
                      + ("; !: above --target-util" if any(r.status == "above target" for r in rows) else ""))
    capped = [p for p in result.plans if p.capped and not p.skipped]
    if capped:
        console.print(f"[yellow]capped:[/] max local {', '.join(dict.fromkeys(_named(p, several) for p in capped))}: "
                      f"{capped_words(capped[0].max_local_batch)}", soft_wrap=True)
    for row in rows:
        if row.rank is None and row.why:
            console.print(escape(f"{row.strategy}{f' on {row.gpus} GPUs' if several else ''}: {row.status}: "
                                 f"{as_flags(row.why)}"),
                          soft_wrap=True)
    losses = dict.fromkeys(p.tp_loss for p in result.plans if p.tp_loss)
    if losses:
        console.print("tensor-parallel loss: " + ", ".join(losses)
                      + (" (logits split by the vocabulary, loss_parallel)" if "sharded" in losses else ""))
    if result.options.offload != "none":
        from batchfit.report.host import plan_host_line

        for best in result.recommended:
            console.print(escape(plan_host_line(best, result.host_limit_bytes)))
    for best in result.recommended:
        console.print(f"[bold green]{best.gpus} GPU{'s' if best.gpus > 1 else ''}: {best.strategy}[/], micro-batch "
                      f"{best.micro_batch} x {best.accumulation_steps} accumulation = global batch {best.global_batch}"
                      + (f"; its reserved peak is in the {best.peak_step}"
                         if best.peak_step not in (None, "steady step") else ""))
    for path in written:
        console.print(f"wrote {path}")
    console.print(f"report: {report_path}", soft_wrap=True)


def _speed_unit(rows) -> str:
    """The ranking's speed: tokens/s where the workload has tokens, else samples/s."""
    return "tokens/s" if any(row.tokens_per_s for row in rows) else "samples/s"


def _ranking_table(result) -> Table:
    """The ranking (plan/ranking.py): every combination by predicted tokens/s with its memory."""
    # The ranking (plan/ranking.py): every combination by predicted tokens/s with its memory. 80 columns
    # hold every column whole: light box, headers on two lines, nothing wrapped (a strategy name or a
    # tokens/s figure cut to 'fsdp-…' or '1,23…' was the one thing to read); GPUs and days only when there.
    rows = result.ranking
    several = len(result.worlds) > 1
    days = any(row.days is not None for row in rows)
    unit = _speed_unit(rows)
    # one memory column, the limit's (report.md has both); the bubble only when a pipeline is ranked
    reserved = result.limit == "reserved"
    bubble = any(row.bubble_s for row in rows)
    columns = [*(["GPUs"] if several else []), "strategy", "max\nlocal", "micro x\naccum",
               "GiB\nresv" if reserved else "GiB\nalloc", "comm\ns", *(["bubble\ns"] if bubble else []), "step\ns",
               unit, *(["days"] if days else [])]
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 0), show_edge=False)
    for column in columns:
        table.add_column(column, justify="left" if column == "strategy" else "right", no_wrap=True)

    def gib(value: int | None) -> str:
        return f"{value / GiB:.1f}" if value else "—"

    def secs(value: float | None) -> str:  # three significant figures: 0.12, 1.23, 12.3
        return "—" if value is None else f"{value:.1f}" if value >= 10 else f"{value:.2f}"

    for row in rows:
        head = [*([str(row.gpus)] if several else []), row.strategy]  # in rank order; the ranked ones first
        if row.rank is None:  # a bound (not traced) in the speed column: at most that
            cells = ["", {"skipped": "skipped", "not traced": "not traced"}.get(row.status, "no fit"),
                     *[""] * (len(columns) - len(head) - 2)]
            if row.bound_tokens_per_s:
                cells[columns.index(unit) - len(head)] = f"<={row.bound_tokens_per_s:,.0f}"
            table.add_row(*head, *cells)
            continue
        speed = row.tokens_per_s or row.samples_per_s
        table.add_row(*head, str(row.max_local_batch),
                      f"{row.micro_batch} x {row.accumulation_steps}" + ("!" if row.status == "above target" else ""),
                      gib(row.reserved_bytes if reserved else row.allocated_bytes), secs(row.exposed_comm_s),
                      *([secs(row.bubble_s)] if bubble else []), secs(row.step_time_s),
                      f"{speed:,.0f}" if speed else "—",
                      *([("—" if row.days is None else f"{row.days:.0f}" if row.days >= 100 else f"{row.days:.1f}")]
                        if days else []))
    return table
