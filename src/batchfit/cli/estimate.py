"""``batchfit estimate``: predict peak memory and the largest batch, with no GPU."""

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
    HostMemoryOpt,
    JsonOpt,
    LengthColumnOpt,
    LimitOpt,
    LoraOpt,
    LossOpt,
    MemoryBudgetOpt,
    ModelArg,
    MultipleOfOpt,
    NoCacheOpt,
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
    capped_words,
    check_outputs,
    handle_errors,
    out_option,
    progress_line,
    quiet_if_stdout,
    report_folder,
    say_attention,
    say_dim,
    sequence_words,
    warn_about_approximations,
    warn_about_precision,
    write_outputs,
)
from batchfit.cli.trainer import EmitTrainerOpt, TrainerOpt, print_answer, print_mapping, trainer_outputs
from batchfit.config.estimate import EstimateFlags, estimate_config, read_estimate_door
from batchfit.config.step import StepFlags
from batchfit.config.trainer import run_answer
from batchfit.devices import GiB
from batchfit.report.host import host_line
from batchfit.report.run_markdown import eval_lines, rl_lines, run_lines
from batchfit.search import DEFAULT_MAX_BATCH
from batchfit.specs import load_workload, rl_workload

EXAMPLES = """
Examples:

  batchfit estimate gpt-tinystories-22m --gpu rtx4090-24gb

  batchfit estimate hf:llama-3.1-8b --gpu h100-80gb --seq-len 8192 --precision bf16-mixed --checkpointing full

  batchfit estimate gpt2-124m --gpu-memory 48GiB --batch-sizes 64,128,192 --json out.json --out report/

  batchfit estimate gpt2-124m --gpu t4 --precision fp16-mixed --limit allocated

  batchfit estimate hf:llama-3.2-1b --gpu rtx4090-24gb --precision bf16-mixed --global-batch 64

  batchfit estimate hf:llama-3.2-1b --gpu rtx4090-24gb --trainer args.json --emit trainer:args.fitted.json

  batchfit estimate hf:llama-3.2-1b --gpu rtx4090-24gb --data train.jsonl --batching pack:4096

  batchfit estimate gpt2-124m --gpu a100-40gb --no-cache    (trace again; `batchfit cache clear` empties the cache)
"""


@handle_errors
def estimate_command(
    model: ModelArg,
    gpu: GpuOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    device: DeviceOpt = None,
    seq_len: SeqLenOpt = None,
    precision: PrecisionOpt = "fp32",
    optimizer: OptimizerOpt = None,
    param_groups: ParamGroupsOpt = "one",
    checkpointing: CheckpointingOpt = "none",
    loss: LossOpt = "plain",
    offload: OffloadOpt = "none",
    routing: RoutingOpt = "balanced",
    attention: AttentionOpt = None,
    host_memory: HostMemoryOpt = None,
    quantize: QuantizeOpt = "none",
    lora: LoraOpt = "none",
    compile_: CompileOpt = "none",
    memory_budget: MemoryBudgetOpt = None,
    freeze: FreezeOpt = None,
    train_only: TrainOnlyOpt = None,
    accumulation_steps: AccumulationOpt = 1,
    batch_sizes: Annotated[str | None, typer.Option(help="Also trace these batch sizes, e.g. 8,16,32.")] = None,
    target_util: TargetUtilOpt = 0.9,
    multiple_of: MultipleOfOpt = 1,
    max_batch: Annotated[int, typer.Option(help="Never consider batches above this.")] = DEFAULT_MAX_BATCH,
    global_batch: Annotated[int | None, typer.Option(help="Samples per optimizer step: also name the largest "
                                                    "micro-batch under --target-util that divides it and the "
                                                    "accumulation steps (micro-batch x accumulation = N), "
                                                    "traced with that accumulation.")] = None,
    json_path: JsonOpt = None,
    limit: LimitOpt = "reserved",
    out: Annotated[Path | None, out_option("report.md, memory.png, estimate.json")] = None,
    trainer: TrainerOpt = None,
    emit: EmitTrainerOpt = None,
    data: DataOpt = None,
    batching: BatchingOpt = None,
    length_column: LengthColumnOpt = None,
    tokenizer: TokenizerOpt = None,
    replay_steps: Annotated[int, typer.Option(help="With --data: run the answer's first K steps one after another and "
                                              "replay them through the allocator model (reserved memory per step, "
                                              "fragmentation).")] = 0,
    replay_order: Annotated[str, typer.Option(help="data: replay the steps in the data's order; worst: also in "
                                              "ascending-length and long-short orders, and show the worst.")] = "data",
    eval_batch_size: Annotated[int | None, typer.Option(help="Also trace HF Trainer's eval loop at this batch "
                                                        "(no gradients, the whole logits) after the training "
                                                        "step: the larger peak decides (docs/run.md).")] = None,
    eval_accumulation_steps: Annotated[int | None, typer.Option(help="Eval steps whose logits stay on the GPU "
                                                                "together (the Trainer's, with "
                                                                "compute_metrics).")] = None,
    no_cache: NoCacheOpt = False,
) -> None:
    """Predict peak training memory and the largest batch that fits a GPU, without a GPU.

    Runs two real training steps of the model on fake tensors (no memory, no compute),
    counting every byte as the CUDA caching allocator would, at a few batch sizes; fits the
    memory curve; and confirms the largest batch by tracing it and the next size up.
    """
    given = dict(locals())  # every flag, by name: config/estimate.py's EstimateFlags and StepFlags pick theirs
    door, emit_path = read_estimate_door(trainer, emit, global_batch)
    check_outputs(json_path, out, *([("--emit", emit_path)] if emit_path else []))
    config = estimate_config(EstimateFlags.pick(given), StepFlags.pick(given), door, emit_path, say=say_dim)
    options, seq_len, rollout = config.options, config.seq_len, config.rollout
    warn_about_precision(config.target, options.precision)  # after StepOptions refused an unknown precision
    if door is not None:
        print_mapping(door, quiet_if_stdout(json_path))
    from batchfit.estimator.engine import estimate  # torch and the tracer: after the options are checked
    from batchfit.estimator.rollout import rollout_approximations
    from batchfit.estimator.run import data_lengths, estimate_run
    from batchfit.report import write_estimate_report
    from batchfit.trace.deferred import load_deferred

    lengths = data_lengths(data, model=model, length_column=length_column, tokenizer=tokenizer) if data else None
    engine = dict(device=config.target.device, options=options)
    with progress_line() as say:
        if config.run is None:
            workload = (load_deferred(model, seq_len=seq_len, cache=config.request.cache) if rollout is None
                        else rl_workload(model, rollout))
            result = estimate(workload, config.request, **engine, progress=say)
            if rollout is not None:
                result.approximations = [*result.approximations,
                                         *rollout_approximations(rollout, result.options.accumulation_steps)]
        else:
            result = estimate_run(lambda n: load_workload(model, seq_len=n), lengths, config.run, config.request,
                                  **engine, progress=say)
    folder = report_folder(out, "estimate", result.workload, config.target, options, seq_len, rollout)
    # GRPO: the answer is the update's batch at the args' steps_per_generation; a split for the same global
    # batch would change the generation batch (TRL's default follows gradient_accumulation_steps), never traced
    fitted = run_answer(door, result) if door is not None and rollout is None else None
    data, write_all = trainer_outputs(result.to_json(), door, fitted, lambda files, trainer: write_estimate_report(
        result, folder, files, trainer=trainer), emit_path)
    paths = write_outputs(json_path, data, write_all)
    console = quiet_if_stdout(json_path)
    _print_summary(result, console, paths["md"])
    if fitted is not None:
        print_answer(fitted, console)
        if emit_path is not None:
            console.print(f"wrote {emit_path}" if fitted["per_device_train_batch_size"] is not None
                          else f"[red]--emit {emit_path} not written[/]: no per-device batch fits", soft_wrap=True)
    warn_about_approximations(result)


def _print_summary(result, console, report_path: Path) -> None:
    console.print(f"[bold]{escape(result.workload)} on {escape(result.device.display_name)}, "
                  f"{result.options.precision}{sequence_words(result.tokens_per_sample)} (traced)[/]")
    say_attention(result.options, console)
    table = Table()
    for column in ("batch", "peak GiB", "fits", "peak in"):
        table.add_column(column, justify="right" if column != "peak in" else "left")
    for p in result.points:
        table.add_row(str(p.batch_size), f"{p.peak_bytes / GiB:.2f}",
                      result.fits(p), p.phase)
    console.print(table)
    console.print(f"parameters {result.params:,} ({result.trainable_params:,} trainable); "
                  f"usable memory {result.capacity_bytes / GiB:.2f} GiB")
    if result.max_batch_size:
        reserved = result.point(result.max_batch_size).peak_reserved_bytes
        under = (f"reserved {reserved / GiB:.2f} GiB (allocator model)" if reserved
                 else f"allocated {result.point(result.max_batch_size).peak_bytes / GiB:.2f} GiB")
        console.print(f"[bold green]max batch size {result.max_batch_size}[/] ({under}), "
                      f"{result.max_batch_size_at_target} at {result.target_util:.0%}")
        if result.capped:
            console.print(f"[yellow]capped:[/] {capped_words(result.max_batch_size)}", soft_wrap=True)
        if result.options.offload != "none":
            console.print(escape(host_line(result.point(result.max_batch_size), result.host_limit_bytes)))
    else:
        console.print(f"[bold red]batch {result.points[0].batch_size} does not fit[/]: "
                      f"{escape(result.why_smallest_does_not_fit())}")
        for s in result.suggestions:
            console.print(escape(f"  {'fits' if s.fits else 'no  '} {s.peak_bytes / GiB:7.2f} GiB  {s.change} "
                                 f"({s.option}; {s.source.split(':')[0]})"))
    if result.split is not None:
        console.print(("[bold green]" if result.split.micro_batch else "[bold red]")
                      + escape(result.split.line(result.target_util)) + "[/]", soft_wrap=True)
    paged = result.points[0].paged_bytes if result.points else 0
    if paged:
        console.print(f"paged optimizer state {paged / GiB:.2f} GiB in CUDA unified memory, not in the peaks "
                      "above (it spills to the host when the GPU is full)")
    for line in rl_lines(result):
        console.print(escape(line), soft_wrap=True)
    for line in run_lines(result) if result.run is not None else []:
        console.print(escape(line), soft_wrap=True)
    for line in eval_lines(result.eval_phase) if result.eval_phase is not None else []:
        console.print(escape(line), soft_wrap=True)
    console.print(f"report: {report_path}", soft_wrap=True)
