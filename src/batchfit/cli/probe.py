"""``batchfit probe``: find the largest batch that really fits, in few probes, safely."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from batchfit.cli.common import (
    AccumulationOpt,
    AttentionOpt,
    BatchingOpt,
    CheckpointingOpt,
    CompileOpt,
    DataOpt,
    DeviceOpt,
    FreezeOpt,
    GpuMemoryOpt,
    GpuOpt,
    JsonOpt,
    LengthColumnOpt,
    LimitOpt,
    LoraOpt,
    LossOpt,
    MemoryBudgetOpt,
    ModelArg,
    MultipleOfOpt,
    OffloadOpt,
    OptimizerOpt,
    ParamGroupsOpt,
    PrecisionOpt,
    QuantizeOpt,
    RoutingOpt,
    SeqLenOpt,
    TargetUtilOpt,
    TokenizerOpt,
    TrainOnlyOpt,
    check_outputs,
    flag,
    handle_errors,
    out_option,
    progress_line,
    quiet_if_stdout,
    report_folder,
    say_attention,
    say_dim,
    say_notices,
    sequence_words,
    warn_about_precision,
    write_outputs,
)
from batchfit.cli.trainer import (
    EmitTrainerOpt,
    TrainerOpt,
    print_answer,
    print_data_rows,
    print_mapping,
    trainer_outputs,
)
from batchfit.config.probe import ProbeFlags, probe_answer, probe_config, read_probe_door
from batchfit.config.step import StepFlags
from batchfit.devices import GiB
from batchfit.distributed.wrap import STRATEGIES
from batchfit.search import POLICIES
from batchfit.specs import load_workload

EXAMPLES = """
Examples:

  batchfit probe gpt-tinystories-22m --device cuda

  batchfit probe my_model.py:workload --device virtual:rtx6000ada-48gb --multiple-of 16

  batchfit probe hf:gpt2-124m --device cuda --policy binsearch --isolate --out report/

  torchrun --nproc-per-node 8 -m batchfit.cli.app probe hf:llama-3.2-1b --device cuda --strategy fsdp
"""


@handle_errors
def probe_command(
    model: ModelArg,
    device: DeviceOpt = None,
    gpu: GpuOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    policy: Annotated[str, typer.Option(help=f"Search policy: {', '.join(POLICIES)}.")] = "guided",
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
    quantize: QuantizeOpt = "none",
    lora: LoraOpt = "none",
    compile_: CompileOpt = "none",
    memory_budget: MemoryBudgetOpt = None,
    freeze: FreezeOpt = None,
    train_only: TrainOnlyOpt = None,
    accumulation_steps: AccumulationOpt = 1,
    multiple_of: MultipleOfOpt = 1,
    min_batch: Annotated[int, typer.Option("--min", help="Smallest batch size to probe.")] = 1,
    max_batch: Annotated[int | None, typer.Option("--max", help="Largest batch size to probe (the cap; default 4096).",
                                                  show_default=False)] = None,
    steps: Annotated[int, typer.Option(help="Training steps per probe (at least 2: the second has "
                                            "optimizer state).")] = 2,
    isolate: Annotated[bool, flag("--isolate", "Run each probe in a fresh process.")] = False,
    stop_on_nan: Annotated[bool, flag("--stop-on-nan",
                                      "Treat a NaN or infinite loss as an error that stops the search.")] = False,
    target_util: TargetUtilOpt = 0.9,
    verify_tiers: Annotated[bool, flag("--verify-tiers",
                                       "Probe the production and conservative tiers too (default: predicted from the "
                                       "measured line, one extra probe).")] = False,
    global_batch: Annotated[int | None, typer.Option(help="Samples per optimizer step you want: adds the gradient "
                                                          "accumulation that reaches it.")] = None,
    strategy: Annotated[str | None, typer.Option(help="Under torchrun, how each rank wraps the model: "
                                                      f"{', '.join(STRATEGIES)} (default ddp; not on "
                                                      "virtual devices).")] = None,
    json_path: JsonOpt = None,
    limit: LimitOpt = "reserved",
    out: Annotated[Path | None, out_option("report.md, memory.png, probe.json")] = None,
    trainer: TrainerOpt = None,
    emit: EmitTrainerOpt = None,
) -> None:
    """Find the largest batch that really fits: run real training steps, few probes, safely.

    Every probe builds the model fresh and runs full training steps (forward, backward,
    optimizer step). Only out-of-memory counts as "does not fit": any other error stops the
    search and is reported as itself, with the probes before it kept. The answer is always a
    batch size that ran, with the next size up shown to fail (or the cap).
    """
    given = dict(locals())  # every flag, by name: config/probe.py's ProbeFlags and StepFlags pick theirs
    door, emit_path = read_probe_door(trainer, emit)
    check_outputs(json_path, out, *([("--emit", emit_path)] if emit_path else []))
    config = probe_config(ProbeFlags.pick(given), StepFlags.pick(given), door, say=say_dim)
    target, options, seq_len = config.target, config.options, config.seq_len
    warn_about_precision(target, options.precision)  # after StepOptions refused an unknown precision
    console = quiet_if_stdout(json_path)
    if door is not None:
        print_mapping(door, console)
    from batchfit.probe.find import find_max_batch  # torch: after the options are checked
    from batchfit.probe.ranks import rank
    from batchfit.report import write_probe_report
    from batchfit.trace.noops import no_op_notices

    workload = load_workload(model, seq_len=seq_len)
    notices = no_op_notices(workload, options)
    say_notices(notices)
    with progress_line() as say:
        result = find_max_batch(workload, config.request, target=target, options=options, progress=say)
    if rank() != 0:  # every rank probed; one writes
        return
    folder = report_folder(out, "probe", result.workload, target, options, seq_len)
    fitted = probe_answer(door, result, config) if door is not None else None
    section = config.data_section
    found = {**result.to_json(), "notices": notices, **({"data": section} if section else {})}
    data, write_all = trainer_outputs(found, door, fitted, lambda files, trainer: write_probe_report(
        result, folder, files, trainer=trainer), emit_path)
    paths = write_outputs(json_path, data, write_all)
    print_data_rows(section, console)
    _print_summary(result, console, paths["md"])
    if fitted is not None:
        print_answer(fitted, console)
        if emit_path is not None and fitted["per_device_train_batch_size"] is not None:
            console.print(f"wrote {emit_path}", soft_wrap=True)
    if result.stopped_by:
        raise typer.Exit(1)


def _print_summary(result, console, report_path: Path) -> None:
    console.print(f"[bold]{escape(result.workload)}: probes on {escape(result.target.spec)}, "
                  f"{result.options.precision}{sequence_words(result.tokens_per_sample)} ({result.policy})[/]")
    say_attention(result.options, console)
    table = Table()
    for column in ("#", "batch", "status", "peak alloc GiB", "error"):
        table.add_column(column, justify="right" if column in ("#", "batch", "peak alloc GiB") else "left")
    for i, t in enumerate(result.trials, 1):
        peak = f"{t.peak_allocated_bytes / GiB:.2f}" if t.peak_allocated_bytes else "—"
        table.add_row(str(i), str(t.batch_size), t.status, peak, escape(t.error or ""))
    console.print(table)
    if result.stopped_by:
        console.print(f"[bold red]stopped:[/] batch {result.stopped_by.batch_size} failed with "
                      f"{escape(result.stopped_by.error)} (not out of memory)")
    search = result.search
    exact = ("capped: the largest size allowed, --max" if search and search.capped
             else "exact" if search and search.exact else "not shown to be the largest")
    console.print(f"[bold green]max batch size {result.max_batch_size}[/] ({exact})")
    for rec in result.recommendations:
        console.print(escape(f"  {rec.name:13s} {rec.batch_size:6d}  x{rec.accumulation_steps}  {rec.why}"))
    console.print(f"report: {report_path}", soft_wrap=True)
