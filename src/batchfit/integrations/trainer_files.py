"""``--trainer args.json`` / ``args.py`` in, ``--emit trainer:args.json`` out.

    args.json   what ``TrainingArguments(...).to_json_string()`` / ``SFTConfig`` wrote, optionally
                with a ``peft_config`` and a ``quantization_config`` section (``to_dict()`` of a
                PEFT ``LoraConfig`` and of a ``BitsAndBytesConfig``)
    args.py     a Python file with ``args`` (a TrainingArguments, or a function returning one),
                and optionally ``peft_config`` / ``quantization_config`` beside it;
                ``args.py:build`` names another attribute

The ``deepspeed`` field may name a DeepSpeed JSON: it is read relative to the args file, then
to the working directory. The emitted args are the user's text with ``per_device_train_batch_size``
and ``gradient_accumulation_steps`` changed in place (every other byte kept); args from a .py
file are written as JSON, as ``to_json_string()`` would. Pure Python: no torch.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchfit.errors import OptionError, read_text
from batchfit.integrations.trainer_args import SECTIONS, TrainerMapping, args_to_dict, from_training_arguments

ANSWERED = ("per_device_train_batch_size", "gradient_accumulation_steps")
"""The two fields batchfit answers for the global batch; --emit trainer: changes them, and only where
the run asks for it (``--data``, ``--eval-batch-size``) ``max_length``, ``packing`` and
``per_device_eval_batch_size``, each named in the answer's notes."""


@dataclass(kw_only=True)
class TrainerArgs:
    """An args file as read."""

    path: Path
    data: dict[str, Any]
    """The fields (and sections) of the args."""
    text: str | None = None
    """The JSON text as the user wrote it (None for a .py file)."""
    deepspeed_config: dict | None = None
    """The DeepSpeed JSON the ``deepspeed`` field names, read."""
    world_size: int | None = None
    """From a live TrainingArguments built by a .py file (None for JSON: it does not record it)."""
    notes: list[str] = field(default_factory=list)


def load_trainer_args(spec: str) -> TrainerArgs:
    """Read ``spec`` (args.json, args.py or args.py:name); one-line OptionErrors for what cannot be read."""
    file, _, attribute = spec.partition(":") if spec.count(":") == 1 and not re.match(r"^[A-Za-z]:\\", spec) \
        else (spec, "", "")
    path = Path(file)
    if not path.is_file():
        raise OptionError(f"`trainer` {spec}: no such file; give the JSON TrainingArguments.to_json_string() wrote "
                          "(e.g. `trainer` args.json) or a .py file that builds them (`trainer` args.py)")
    if path.suffix == ".py":
        args = _from_python(path, attribute or "args")
    else:
        text = read_text(path, f"`trainer` {spec}")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise OptionError(f"`trainer` {spec} is not JSON ({error.msg} at line {error.lineno}, column "
                              f"{error.colno}): save the args with TrainingArguments(...).to_json_string(), or "
                              "give a .py file that builds them") from None
        if not isinstance(data, dict):
            raise OptionError(f"`trainer` {spec} holds a JSON {type(data).__name__}, not the object "
                              "TrainingArguments.to_json_string() writes")
        args = TrainerArgs(path=path, data=data, text=text)
    args.deepspeed_config = _deepspeed(args.data.get("deepspeed"), path)
    return args


def _from_python(path: Path, attribute: str) -> TrainerArgs:
    name = f"batchfit_trainer_args_{abs(hash(str(path.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:  # the user's file failed: say where, in one line
        raise OptionError(f"`trainer` {path}:{_line_in(error, path)}: {_first_line(error)} (raised while building "
                          "the args): fix that line") from None
    finally:
        sys.modules.pop(name, None)
    if not hasattr(module, attribute):
        raise OptionError(f"`trainer` {path} has no '{attribute}': define args = TrainingArguments(...) (or a "
                          f"function returning it), or name it: `trainer` {path}:build_args")
    args = getattr(module, attribute)
    if callable(args) and not hasattr(args, "to_dict"):
        try:
            args = args()
        except Exception as error:
            raise OptionError(f"`trainer` {path}:{_line_in(error, path)}: {_first_line(error)} (raised in "
                              f"{attribute}()): fix that line") from None
    _check_args_object(args, path, attribute)
    data = args_to_dict(args)
    for section in SECTIONS:
        value = getattr(module, section, None)
        if value is not None and section not in data:
            data[section] = args_to_dict(value)
    live = getattr(args, "world_size", None)
    return TrainerArgs(path=path, data=data, world_size=live if isinstance(live, int) and live > 1 else None)


def _check_args_object(args: Any, path: Path, attribute: str) -> None:
    """Refuse an ``args`` that holds no fields (``args = 42``, a string, a list): read as a dict of no
    fields, it was traced as the default TrainingArguments without a word."""
    from collections.abc import Mapping
    from dataclasses import is_dataclass

    if isinstance(args, Mapping) or hasattr(args, "to_dict") or (is_dataclass(args) and not isinstance(args, type)):
        return
    if {k for k in getattr(args, "__dict__", {}) if not k.startswith("_")}:
        return
    shown = repr(args)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    raise OptionError(f"`trainer` {path}: {attribute} is {shown} (type {type(args).__name__}), not TrainingArguments: "
                      f"define {attribute} = TrainingArguments(...) (or a function returning them, or a dict of "
                      "their fields)")


def _line_in(error: BaseException, path: Path) -> int | str:
    """The line of ``path`` the error came through (the last frame in the user's file)."""
    import traceback

    frames = [f for f in traceback.extract_tb(error.__traceback__) if Path(f.filename).resolve() == path.resolve()]
    return frames[-1].lineno if frames else "?"


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _deepspeed(value: Any, args_path: Path) -> dict | None:
    """The DeepSpeed JSON the ``deepspeed`` field names (a path or the dict itself)."""
    if not value:
        return None
    if isinstance(value, dict):
        return value
    for base in (args_path.parent, Path.cwd()):
        candidate = base / str(value)
        if candidate.is_file():
            try:
                config = json.loads(read_text(candidate, f"the DeepSpeed config {candidate}"))
            except json.JSONDecodeError as error:
                raise OptionError(f"the DeepSpeed config {candidate} is not JSON ({error.msg} at line {error.lineno})"
                                  ": fix it, or drop 'deepspeed' from the args") from None
            if not isinstance(config, dict):
                raise OptionError(f"the DeepSpeed config {candidate} holds a JSON {type(config).__name__}, not an "
                                  "object with zero_optimization")
            return config
    return None


def map_trainer_args(args: TrainerArgs, *, world_size: int | None = None) -> TrainerMapping:
    """:func:`from_training_arguments` on a file read by :func:`load_trainer_args`."""
    return from_training_arguments(args.data, world_size=world_size or args.world_size,
                                   deepspeed_config=args.deepspeed_config, source=f"--trainer {args.path}")


def split_for_global_batch(mapping: TrainerMapping, max_micro_batch: int, multiple_of: int = 1,
                           world_size: int | None = None) -> tuple[int, int] | None:
    """(per_device_train_batch_size, gradient_accumulation_steps) that keep the args' global
    batch (per-device batch x accumulation x world size) over ``world_size`` devices (default:
    the args'), with the largest micro-batch at most ``max_micro_batch``, a multiple of
    ``multiple_of``; None when no such micro-batch divides the samples each device takes."""
    world = world_size or mapping.world_size
    if max_micro_batch < 1 or mapping.global_batch % world:
        return None
    samples = mapping.global_batch // world
    cap = min(max_micro_batch, samples)
    for micro in range(cap - cap % multiple_of, 0, -multiple_of):
        if samples % micro == 0:
            return micro, samples // micro
    return None


def patched_args_text(args: TrainerArgs, per_device_train_batch_size: int, gradient_accumulation_steps: int,
                      more: dict[str, Any] | None = None) -> str:
    """The user's args with the two answered fields (and ``more``) set; everything else as it was."""
    values = {**dict(zip(ANSWERED, (per_device_train_batch_size, gradient_accumulation_steps), strict=True)),
              **(more or {})}
    if args.text is None:
        data = {**args.data, **values}
        return json.dumps(data, indent=2, sort_keys=True) + "\n"
    text = args.text
    for name, value in values.items():
        pattern = re.compile(rf'("{name}"\s*:\s*)(-?\d+|true|false|null)')
        found = len(pattern.findall(text))
        if found == 1:
            text = pattern.sub(lambda match, v=json.dumps(value): f"{match.group(1)}{v}", text)
        elif found == 0 and f'"{name}"' not in text and text.rstrip().endswith("}") and args.data:
            # absent (a TRL field in TrainingArguments' JSON): added last, every other byte kept
            body = text.rstrip()[:-1].rstrip()
            text = f'{body},\n  "{name}": {json.dumps(value)}\n}}\n'
        else:  # a default the Trainer used, or odd: rewrite the whole object
            data = json.loads(args.text)
            data.update(values)
            return json.dumps(data, indent=2, sort_keys=True) + "\n"
    return text


def run_fields(mapping: TrainerMapping, *, batching: str | None = None, eval_batch_size: int | None = None,
               eval_max_batch: int | None = None) -> tuple[dict[str, Any], list[str]]:
    """The fields beyond the two that the run's answer sets in the args (``--batching pack:MAXLEN``: rows of
    MAXLEN; an eval batch that does not fit: the largest that does), each with a note: never silently."""
    fields: dict[str, Any] = {}
    notes: list[str] = []
    if batching is not None and batching.startswith("pack:"):
        length = int(batching.removeprefix("pack:"))
        if not mapping.packing:
            fields["packing"] = True
            notes.append(f"packing: true (--batching {batching}): per_device_train_batch_size counts packed rows of "
                         f"{length:,} tokens, not samples, so each step holds more samples than the args' padded "
                         "batches did; the global batch is kept in rows")
        if mapping.seq_len != length:
            fields["max_length"] = length
            notes.append(f"max_length {mapping.seq_len} -> {length} (--batching {batching})")
    if eval_batch_size and eval_max_batch is not None and eval_max_batch < eval_batch_size:
        if eval_max_batch:
            fields["per_device_eval_batch_size"] = eval_max_batch
            notes.append(f"per_device_eval_batch_size {eval_batch_size} -> {eval_max_batch}: the eval loop at "
                         f"{eval_batch_size} does not fit after the training step (the training batch is unchanged)")
        else:
            notes.append(f"per_device_eval_batch_size {eval_batch_size}: not even an eval batch of 1 fits after "
                         "the training step; left as it was")
    return fields, notes
