"""``--trainer args.json`` and ``--emit trainer:args.json``: the CLI side of the HF front door.

Reading the args and merging them with the flags is the config layer's (``config/trainer.py``);
here only the options' declarations and what a command prints and writes: what was used and
what was not, and the answer in the Trainer's own terms.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from batchfit.config.trainer import FrontDoor, emitted_text

TrainerOpt = Annotated[str | None, typer.Option(
    "--trainer", help="Start from a Hugging Face TrainingArguments / TRL SFTConfig (estimate also reads a TRL "
                      "GRPOConfig / PPOConfig and traces its RL step): the JSON to_json_string() wrote "
                      "(with optional peft_config / quantization_config sections), or a .py file defining `args`. "
                      "Its batch, precision, checkpointing, optimizer, compile, Liger loss, sequence length, "
                      "sharding, LoRA and quantization become the options; every field it does not use is listed.")]
EmitTrainerOpt = Annotated[list[str] | None, typer.Option(
    "--emit", help="trainer:FILE: the --trainer args with per_device_train_batch_size and "
                   "gradient_accumulation_steps for the same global batch (every other field kept).")]


def print_mapping(door: FrontDoor, console: Console) -> None:
    """What the args became, what was not used and why (one line each for what can change memory)."""
    console.print(f"[bold]--trainer {escape(str(door.args.path))}[/] (global batch "
                  f"{door.mapping.per_device_train_batch_size} x {door.mapping.gradient_accumulation_steps} x "
                  f"{door.mapping.world_size} device(s) = {door.mapping.global_batch})", soft_wrap=True)
    for use in door.mapping.used:
        if use.option:
            console.print(f"  {escape(use.line())}", soft_wrap=True, highlight=False)
    quiet = []
    for use in door.mapping.unused:
        if use.matters:
            console.print(f"  [yellow]{escape(use.line())}[/]", soft_wrap=True, highlight=False)
        else:
            quiet.append(use.field)
    if quiet:
        console.print(f"  [dim]not used, off or not changing training memory ({len(quiet)}; why: "
                      f"trainer.trainer_fields_unused in the JSON, report.md): {escape(', '.join(quiet))}[/]",
                      soft_wrap=True, highlight=False)


def print_data_rows(section: dict | None, console: Console) -> None:
    if section is not None:
        from types import SimpleNamespace

        from batchfit.report.run_markdown import distribution_line

        console.print(escape(f"{distribution_line(SimpleNamespace(**section))}: every step at "
                             f"{section['traced_length']:,} tokens per row, the longest this data makes"),
                      soft_wrap=True)


def print_answer(result: dict, console: Console) -> None:
    if result["per_device_train_batch_size"] is None:
        console.print(f"[bold red]no TrainingArguments for global batch {result['global_batch']}[/]: "
                      f"{escape('; '.join(result['notes']))}", soft_wrap=True)
        return
    more = "".join(f", {name}={value}" for name, value in result.get("fields", {}).items())
    console.print(f"[bold green]per_device_train_batch_size={result['per_device_train_batch_size']}, "
                  f"gradient_accumulation_steps={result['gradient_accumulation_steps']}{escape(more)}[/] for "
                  f"global batch {result['global_batch']} over {result['world_size']} device(s) (largest micro-batch "
                  f"{result['max_micro_batch']}, {result['source']})", soft_wrap=True)
    for note in result["notes"]:
        console.print(f"[yellow]note:[/] {escape(note)}", soft_wrap=True)


def trainer_outputs(result_json: dict, door: FrontDoor | None, fitted: dict | None, write_report,
                    emit_path: Path | None):
    """(the JSON, the all-or-none writer) of a command that may have started from ``--trainer``:
    ``write_report(files, trainer=section)`` writes the report, then the patched args
    (``--emit trainer:``) when there is an answer; the JSON (written last) and the report carry the
    trainer section."""
    section = door.section(fitted) if door is not None else None
    data = result_json if section is None else {**result_json, "trainer": section}

    def write_all(files):  # the report, --emit and --json: all or none, JSON last
        paths = write_report(files, trainer=section)
        if emit_path is not None and fitted["per_device_train_batch_size"] is not None:
            files.text(emit_path, emitted_text(door, fitted))
        return paths

    return data, write_all
