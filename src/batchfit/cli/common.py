"""What every command shares: error handling, option parsing, the target device."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from batchfit.errors import BatchfitError, OptionError
from batchfit.specs import SPEC_HELP
from batchfit.targets import DEVICE_HELP, Target, resolve_target
from batchfit.workload import StepOptions

err = Console(stderr=True)
out = Console()


def handle_errors(command: Callable) -> Callable:
    """Known errors become one line and a hint, with exit code 2 (bad input) or 1."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except BatchfitError as error:
            if os.environ.get("BATCHFIT_DEBUG"):
                raise
            err.print(f"[bold red]error:[/] {escape(str(error))}", highlight=False, soft_wrap=True)
            err.print("[dim]set BATCHFIT_DEBUG=1 for a traceback[/]")
            raise typer.Exit(error.exit_code) from None

    return wrapper


def parse_batch_sizes(text: str | None) -> list[int] | None:
    """'8,16,32' -> [8, 16, 32]."""
    if text is None:
        return None
    if not re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*", text):
        raise OptionError(f"cannot read --batch-sizes '{text}': give positive integers separated by commas, e.g. 8,16,32")
    sizes = [int(s) for s in text.split(",")]
    if min(sizes) < 1:
        raise OptionError("--batch-sizes must all be 1 or more, e.g. 8,16,32")
    return sizes


def command_target(gpu: str | None, gpu_memory: str | None, device: str | None) -> Target:
    """The device options every command shares (``batchfit.targets``), saying which device
    was chosen when none was named."""
    return resolve_target(gpu=gpu, gpu_memory=gpu_memory, device=device,
                          say=lambda message: err.print(f"[dim]{escape(message)}[/]"))


def is_stdout(path: str | None) -> bool:
    return path == "-"


def quiet_if_stdout(path: str | None) -> Console:
    """Human output goes to stderr when JSON goes to stdout."""
    return err if is_stdout(path) else out


# --- options shared by the commands that run a training step ------------------------------
GpuOpt = Annotated[str | None, typer.Option(help="GPU from the catalog (`batchfit gpus`), traced, e.g. h100-80gb.")]
GpuMemoryOpt = Annotated[str | None, typer.Option(help="Any GPU by its memory, traced, e.g. 24GiB or 80GB.")]
DeviceOpt = Annotated[str | None, typer.Option(help=f"Where to run: {DEVICE_HELP}. Default: the GPU here, else a traced H100.")]
ModelArg = Annotated[str, typer.Argument(help=f"What to train: {SPEC_HELP}.", show_default=False)]
SeqLenOpt = Annotated[int | None, typer.Option(help="Tokens per sample (default: the model's).")]
PrecisionOpt = Annotated[str, typer.Option(help="fp32, bf16-mixed, fp16-mixed (autocast, fp32 weights) or bf16 (pure).")]
OptimizerOpt = Annotated[str | None, typer.Option(help="Override the optimizer: adamw, adam, sgd, sgd-momentum, adafactor.")]
CheckpointingOpt = Annotated[str, typer.Option(help="Activation checkpointing: none or full (every block).")]
FreezeOpt = Annotated[list[str] | None, typer.Option(help="Freeze parameters matching this glob (repeatable), e.g. 'model.layers.*'.")]
TrainOnlyOpt = Annotated[list[str] | None, typer.Option(help="Train only parameters matching this glob (repeatable), e.g. '*lora*'.")]
AccumulationOpt = Annotated[int, typer.Option(help="Micro-batches per optimizer step.")]
TargetUtilOpt = Annotated[float, typer.Option(help="Fraction of usable memory to plan for.")]
MultipleOfOpt = Annotated[int, typer.Option(help="Batch sizes must be multiples of this, e.g. 8.")]
JsonOpt = Annotated[str | None, typer.Option("--json", help="Write the JSON result here too ('-' for stdout).")]
OutOpt = Annotated[Path | None, typer.Option(help="Report folder (report.md, memory.png, the JSON).")]


def step_options(precision: str, optimizer: str | None, checkpointing: str, freeze: list[str] | None,
                 train_only: list[str] | None, accumulation_steps: int) -> StepOptions:
    return StepOptions(precision=precision, optimizer=optimizer, checkpointing=checkpointing,
                       frozen=tuple(freeze or ()), trainable=tuple(train_only or ()),
                       accumulation_steps=accumulation_steps)


def report_folder(out: Path | None, command: str, workload: str, device: str) -> Path:
    """--out, or reports/<command>-<model>-<device>/."""
    return out or Path("reports") / re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{command}-{workload}-{device}")


def write_json(json_path: str | None, data: dict) -> None:
    """--json PATH writes the result there; --json - prints it (and nothing else) on stdout."""
    if json_path is None:
        return
    text = json.dumps(data, indent=2) + "\n"
    if is_stdout(json_path):
        sys.stdout.write(text)
    else:
        Path(json_path).write_text(text)


@contextlib.contextmanager
def progress_line() -> Iterator[Callable[[str], None]]:
    """A spinner with the current step and the elapsed time, on stderr; gone when done."""
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=err, transient=True) as progress:
        task = progress.add_task("starting", total=None)
        yield lambda message: progress.update(task, description=message)
