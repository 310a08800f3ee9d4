"""``--trainer args.json``: a Hugging Face TrainingArguments / TRL SFTConfig file merged with the flags.

The mapping of each field is the library's (``integrations/trainer_args.py``); here what a command
needs from it: the options, sequence length, batch sizes, data batching and eval loop merged with the
flags typed beside them (a flag that contradicts the args is an error: which wins would be a guess), and
the answer in the Trainer's own terms. Printing it is ``cli/trainer.py``'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchfit.config.step import DataFlags, StepFlags, quiet
from batchfit.errors import OptionError
from batchfit.workload import StepOptions


@dataclasses.dataclass(kw_only=True)
class FrontDoor:
    """The --trainer file, read and mapped."""

    args: Any
    """The TrainerArgs read (``integrations/trainer_files.py``)."""
    mapping: Any
    """Its TrainerMapping."""

    def section(self, answer: dict | None) -> dict:
        """The JSON's ``trainer`` section: the source, the mapping, the answer."""
        return {"source": str(self.args.path), **self.mapping.to_json(), "answer": answer}


def read_trainer(spec: str | None, *, world_size: int | None = None, rl: bool = False) -> FrontDoor | None:
    """Read and map --trainer (None when not given); one-line errors for a bad file. ``rl``: the command
    traces an RL step (a TRL GRPOConfig / PPOConfig's); elsewhere such args are refused, not traced as SFT."""
    if spec is None:
        return None
    from batchfit.integrations.trainer_files import load_trainer_args, map_trainer_args

    args = load_trainer_args(spec)
    door = FrontDoor(args=args, mapping=map_trainer_args(args, world_size=world_size))
    if door.mapping.rollout is not None and not rl:
        raise OptionError(f"`trainer` {spec} is a TRL {door.mapping.rollout.algorithm.upper()}Config: only estimate "
                          f"traces its RL step (generation, scoring, update) yet: `batchfit estimate MODEL --gpu GPU "
                          f"--trainer {spec}`")
    return door


def parse_trainer_emit(values: list[str] | None, door: FrontDoor | None) -> Path | None:
    """--emit trainer:FILE (the only kind a single-device command takes) -> FILE."""
    if not values:
        return None
    if len(values) > 1:
        raise OptionError("give `emit` trainer:FILE once")
    kind, _, rest = values[0].partition(":")
    if kind != "trainer" or not rest:
        raise OptionError(f"`emit` {values[0]}: this command writes trainer:FILE, e.g. `emit` trainer:args.fitted.json")
    if door is None:
        raise OptionError("`emit` trainer:FILE writes your TrainingArguments back: give them with `trainer` args.json")
    return Path(rest)


def _typed(name: str) -> bool:
    """Whether the flag of StepOptions' ``name`` was typed on the command line (click knows): a flag
    typed as its default (--precision fp32) says as much as any other value."""
    try:  # typer 0.2x runs its own copy of click; older typer, click itself
        from typer._click.globals import get_current_context
    except ImportError:
        from click import get_current_context

    context = get_current_context(silent=True)
    if context is None:  # called from Python, not a command: only values away from the default were typed
        return False
    source = context.get_parameter_source({"compile": "compile_"}.get(name, name))
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


def merged_options(options: StepOptions, door: FrontDoor | None, *, accumulation: bool = True) -> StepOptions:
    """``options`` (from the flags) with the args' settings; a flag set to something else than
    the args say is an error (which one wins would be a guess), the default value too when typed."""
    if door is None:
        return options
    default = StepOptions()
    changes = {name: value for name, value in door.mapping.step.items()
               if accumulation or name != "accumulation_steps"}
    for name, value in changes.items():
        typed = getattr(options, name)
        if (typed != getattr(default, name) or _typed(name)) and typed != value:
            option = "--accumulation-steps" if name == "accumulation_steps" else f"--{name.replace('_', '-')}"
            source = next((u.field for u in door.mapping.used if u.option.startswith(f"{option} ")), "the args")
            raise OptionError(f"{option} {typed} contradicts `trainer` {door.args.path} ({source} -> {option} "
                              f"{value}): drop {option}, or change the args")
    return dataclasses.replace(options, **changes)


def merged_seq_len(seq_len: int | None, door: FrontDoor | None) -> int | None:
    if door is None or door.mapping.seq_len is None:
        return seq_len
    if seq_len is not None and seq_len != door.mapping.seq_len:
        raise OptionError(f"`seq_len` {seq_len} contradicts `trainer` {door.args.path} (max_length "
                          f"{door.mapping.seq_len}): drop `seq_len`, or change the args")
    return door.mapping.seq_len


def merged_eval(eval_batch_size: int | None, eval_accumulation_steps: int | None,
                door: FrontDoor | None) -> tuple[int | None, int]:
    """(--eval-batch-size, the eval steps whose logits are held together) from the flags and the args."""
    pairs = (("--eval-batch-size", eval_batch_size, "per_device_eval_batch_size"),
             ("--eval-accumulation-steps", eval_accumulation_steps, "eval_accumulation_steps"))
    values = []
    for flag, typed, name in pairs:
        given = getattr(door.mapping, name) if door is not None else None
        if typed is not None and given is not None and typed != given:
            raise OptionError(f"{flag} {typed} contradicts `trainer` {door.args.path} ({name} {given}): "
                              f"drop {flag}, or change the args")
        if typed is not None and typed < 1:
            raise OptionError(f"{flag} {typed}: give a positive number, e.g. {flag} 8")
        values.append(typed if typed is not None else given)
    if values[0] is None and values[1] is not None and eval_accumulation_steps is not None:
        raise OptionError("`eval_accumulation_steps` needs `eval_batch_size` N (the eval loop's batch)")
    return values[0], values[1] or 1


def merged_batch_sizes(sizes: list[int] | None, door: FrontDoor | None) -> list[int] | None:
    """The typed sizes and the args' per_device_train_batch_size: it is traced, so the answer says if it fits."""
    if door is None:
        return sizes
    return sorted({*(sizes or []), door.mapping.per_device_train_batch_size})


def merged_batching(batching: str | None, data: str | None, door: FrontDoor | None) -> str | None:
    """--batching, or pack:max_length where the args pack (TRL's ``packing``) and --data is given."""
    mapping = door.mapping if door is not None else None
    if data is None or mapping is None or not mapping.packing or mapping.seq_len is None:
        return batching
    own = f"pack:{mapping.seq_len}"
    if batching is not None and batching != own:
        raise OptionError(f"`batching` {batching} contradicts `trainer` {door.args.path} (packing, max_length "
                          f"{mapping.seq_len}: `batching` {own}): drop `batching`, or change the args")
    return own


def data_rows(model: str, seq_len: int | None, door: FrontDoor | None, data: str | None, batching: str | None,
              length_column: str | None, tokenizer: str | None) -> tuple[int | None, dict | None]:
    """plan / probe ``--data``: (the tokens per row to trace every step at, the JSON's ``data`` section,
    None without --data): the longest row a step of the data makes (``estimator.run.data_row_length``)."""
    from batchfit.estimator.batching import check_run_flags

    run_batching = check_run_flags(data, merged_batching(batching, data, door), length_column, tokenizer)
    if run_batching is None:
        return seq_len, None
    from batchfit.estimator.run import data_row_length  # torch: after the options are checked

    return data_row_length(data, run_batching, model=model, seq_len=seq_len, length_column=length_column,
                           tokenizer=tokenizer)


def merged_step(flags: DataFlags, step: StepFlags, door: FrontDoor | None,
                say: Callable[[str], None] = quiet) -> tuple[StepOptions, int | None, dict | None]:
    """probe / bench: (the step's options, the tokens per row, the JSON's ``data`` section) from the flags
    merged with the args; with ``data``, every row at the longest a step of the data makes (:func:`data_rows`)."""
    options = merged_options(step.options(say), door)
    seq_len = merged_seq_len(flags.seq_len, door)
    seq_len, section = data_rows(flags.model, seq_len, door, flags.data, flags.batching, flags.length_column,
                                 flags.tokenizer)
    return options, seq_len, section


def run_answer(door: FrontDoor, result, **kwargs) -> dict:
    """:func:`answer` for an estimate, in the user's knobs: with --data, the largest micro-batch whose
    whole run fits, and the rows of --batching pack:MAXLEN; with --eval-batch-size, an eval batch that fits."""
    from batchfit.integrations.trainer_files import run_fields

    run, phase = result.run, result.eval_phase
    micro = result.max_batch_size_at_target if run is None else min(result.max_batch_size_at_target, run.max_batch_size)
    fitted = answer(door, micro, result.options.accumulation_steps, multiple_of=result.multiple_of,
                    fits_whole=result.max_batch_size if run is None else run.max_batch_size, **kwargs)
    fields, notes = run_fields(door.mapping, batching=run.batching if run is not None else None,
                               eval_batch_size=phase.batch_size if phase is not None else None,
                               eval_max_batch=phase.max_batch_size if phase is not None else None)
    fitted["fields"], fitted["notes"] = fields, [*fitted["notes"], *notes]
    return fitted


def answer(door: FrontDoor, max_micro_batch: int, traced_accumulation: int, *, multiple_of: int = 1,
           world_size: int | None = None, source: str = "traced", fits_whole: int | None = None) -> dict:
    """per_device_train_batch_size and gradient_accumulation_steps for the args' global batch.
    ``max_micro_batch``: the largest under the target; ``fits_whole``: the largest in all the memory."""
    from batchfit.integrations.trainer_files import split_for_global_batch

    mapping = door.mapping
    world = world_size or mapping.world_size
    split = split_for_global_batch(mapping, max_micro_batch, multiple_of, world)
    result: dict[str, Any] = {"global_batch": mapping.global_batch, "world_size": world,
                              "max_micro_batch": max_micro_batch, "source": source,
                              "per_device_train_batch_size": split[0] if split else None,
                              "gradient_accumulation_steps": split[1] if split else None}
    notes = []
    if split is None and max_micro_batch:
        notes.append(f"no per-device batch of at most {max_micro_batch} divides the {mapping.global_batch} samples "
                     f"of the global batch over {world} device(s)")
    elif split is None and fits_whole:
        notes.append(f"a micro-batch of {fits_whole} fits the whole usable memory but none fits under the target "
                     "(--target-util): raise it (e.g. --target-util 1.0) to take it, or lower the memory of a sample")
    elif split is None:
        notes.append("not even a micro-batch of 1 fits: lower the memory of a sample (checkpointing, bf16, "
                     "--loss fused-linear, LoRA) or pick a larger GPU")
    elif split[1] > 1 and traced_accumulation == 1:
        notes.append(f"traced without accumulation; with {split[1]} accumulation steps the gradients stay alive "
                     "through the next forward: trace the emitted args to confirm (--trainer FILE)")
    result["notes"] = notes
    return result


def emitted_text(door: FrontDoor, result: dict) -> str:
    """The args file to write for --emit trainer:FILE."""
    from batchfit.integrations.trainer_files import patched_args_text

    if result["per_device_train_batch_size"] is None:
        raise OptionError("`emit` trainer: nothing fits, so there are no arguments to write: "
                          + "; ".join(result["notes"]))
    return patched_args_text(door.args, result["per_device_train_batch_size"], result["gradient_accumulation_steps"],
                             result.get("fields"))
