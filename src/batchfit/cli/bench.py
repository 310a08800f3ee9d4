"""``batchfit bench``: throughput, reserved memory, phases, non-linear growth and leaks."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich import box
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
    LoraOpt,
    LossOpt,
    MemoryBudgetOpt,
    ModelArg,
    OffloadOpt,
    OptimizerOpt,
    ParamGroupsOpt,
    PrecisionOpt,
    QuantizeOpt,
    RoutingOpt,
    SeqLenOpt,
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
from batchfit.cli.trainer import TrainerOpt, print_data_rows, print_mapping
from batchfit.config.bench import BENCH_SIZES, BenchFlags, bench_config
from batchfit.config.step import StepFlags
from batchfit.config.trainer import read_trainer
from batchfit.devices import GiB
from batchfit.specs import load_workload

EXAMPLES = """
Examples:

  batchfit bench gpt2-124m --device cuda --batch-sizes 8,16,32,48,64

  batchfit bench grpo-gpt2-124m --device cuda --batch-sizes 8,16,32 --leak-check --steps 200

  batchfit bench gpt-tinystories-22m --device virtual:rtx4090-24gb     # predicted, no GPU

  batchfit bench hf:llama-3.2-1b --device cuda --data train.jsonl --batching pack:4096
"""


@handle_errors
def bench_command(
    model: ModelArg,
    device: DeviceOpt = None,
    gpu: GpuOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    batch_sizes: Annotated[str, typer.Option(help="Batch sizes to bench, e.g. 8,16,32,64 (with --trainer: its "
                                                  "per_device_train_batch_size).")] = BENCH_SIZES,
    seq_len: SeqLenOpt = None,
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
    steps: Annotated[int, typer.Option(help="Timed steps per batch size (with --leak-check: steps to watch).")] = 10,
    warmup: Annotated[int, typer.Option(help="Burn-in steps before timing.")] = 3,
    leak_check: Annotated[bool, flag("--leak-check",
                                     "Watch allocated memory over --steps steps and say if it grows.")] = False,
    json_path: JsonOpt = None,
    out: Annotated[Path | None, out_option("report.md, throughput.png, bench.json")] = None,
    trainer: TrainerOpt = None,
    data: DataOpt = None,
    batching: BatchingOpt = None,
    length_column: LengthColumnOpt = None,
    tokenizer: TokenizerOpt = None,
) -> None:
    """Measure throughput (tokens/s, samples/s, MFU), allocated and reserved memory per batch size.

    On cuda everything is measured. On a virtual device memory is traced and reserved memory
    predicted with a model of the CUDA caching allocator; nothing is timed. Phases (a
    generation phase before the update, as in GRPO) are reported separately.
    """
    given = dict(locals())  # every flag, by name: config/bench.py's BenchFlags and StepFlags pick theirs
    door = read_trainer(trainer)
    check_outputs(json_path, out)
    config = bench_config(BenchFlags.pick(given), StepFlags.pick(given), door, say=say_dim)
    target, options, seq_len = config.target, config.options, config.seq_len
    warn_about_precision(target, options.precision)  # after StepOptions refused an unknown precision
    if door is not None:
        print_mapping(door, quiet_if_stdout(json_path))
    from batchfit.bench.engine import bench  # torch: after the options are checked
    from batchfit.report import write_bench_report
    from batchfit.trace.noops import no_op_notices

    workload = load_workload(model, seq_len=seq_len)
    notices = no_op_notices(workload, options)
    say_notices(notices)
    request = config.request
    with progress_line(total=len(set(request.batch_sizes)) + (1 if request.leak_check_steps else 0)) as say:
        result = bench(workload, request, target=target, options=options, progress=say)
    folder = report_folder(out, "bench", result.workload, target, options, seq_len)
    section = door.section(None) if door is not None else None
    data_section = config.data_section
    data = {**result.to_json(), "notices": notices, **({"trainer": section} if section is not None else {}),
            **({"data": data_section} if data_section else {})}
    paths = write_outputs(json_path, data, lambda files: write_bench_report(result, folder, files, trainer=section))
    print_data_rows(data_section, quiet_if_stdout(json_path))
    _print_summary(result, quiet_if_stdout(json_path), paths["md"])
    if not any(r.status == "ok" for r in result.rows):  # nothing ran: a script must not read success
        raise typer.Exit(1)


def _print_summary(result, console, report_path: Path) -> None:
    console.print(f"[bold]{escape(result.workload)} on {escape(result.target.spec)}, {result.options.precision}"
                  f"{sequence_words(result.tokens_per_sample)}[/]")
    say_attention(result.options, console)
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 0), show_edge=False)  # 80 columns hold the figures whole (see plan)
    for column in ("batch", "status", "step s", "tokens/s", "MFU", "alloc\nGiB", "reserved\nGiB", "source"):
        table.add_column(column, justify="left" if column in ("status", "source") else "right",
                         no_wrap=column != "source")
    for r in result.rows:
        table.add_row(str(r.batch_size), r.status, f"{r.step_time_s:.3f}" if r.step_time_s else "—",
                      f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else "—", f"{r.mfu:.1%}" if r.mfu is not None else "—",
                      f"{r.peak_allocated_bytes / GiB:.2f}" if r.peak_allocated_bytes else "—",
                      f"{r.peak_reserved_bytes / GiB:.2f}" if r.peak_reserved_bytes else "—", r.source)
    console.print(table)
    if result.target.kind == "virtual":  # the columns a traced run cannot fill, and what fills them
        console.print("step s, tokens/s, MFU: measured only, and nothing ran on a GPU here (--gpu traces memory); "
                      "run on the GPU with --device cuda for them", soft_wrap=True)
    for r in result.rows:
        if r.status != "ok" and r.error:  # the table says 'error'; this says which
            console.print(f"[red]batch {r.batch_size} {r.status}:[/] {escape(r.error)}", soft_wrap=True)
    if not any(r.status == "ok" for r in result.rows):
        console.print("[bold red]no batch size ran[/]: see the errors above")
    for t in result.tiers:
        console.print(f"  {t.name:12s} batch {t.batch_size:6d}  headroom {t.headroom_bytes / GiB:.2f} GiB")
    if result.leak:
        verdict = "[bold red]leaking[/]" if result.leak.leaking else "[green]no leak[/]"
        console.print(f"leak check: {verdict} ({result.leak.bytes_per_step:,.0f} bytes/step)")
    for hint in result.hints:
        console.print(f"[yellow]hint:[/] {escape(hint)}")
    console.print(f"report: {report_path}", soft_wrap=True)
