"""A Hugging Face ``TrainingArguments`` / TRL ``SFTConfig`` in batchfit's terms: one mapping.

    mapping = from_training_arguments(json.load(open("args.json")))
    StepOptions(**mapping.step)        # precision, optimizer, checkpointing, compile, loss, ...
    mapping.seq_len, mapping.per_device_train_batch_size, mapping.strategy, mapping.unused

The CLI's ``--trainer args.json`` and the HF Trainer / Lightning integrations all call
:func:`from_training_arguments`, so an estimate started from a file and one started inside a
Trainer trace the same step. Every field is accounted for: mapped onto a batchfit option
(``used``, with the option it became), or listed in ``unused`` with why (it does not change
training memory; batchfit has no such option yet; the value cannot be expressed). What this
batchfit accepts is read at run time (``StepOptions``' fields and checks, ``OPTIMIZERS``, the
plan's strategy parser): options other branches add are used as soon as they exist.

Beyond the TrainingArguments fields, a ``peft_config`` (PEFT ``LoraConfig.to_dict()``) and a
``quantization_config`` (``BitsAndBytesConfig.to_dict()``) section are read, at the top level
of the args or, for the quantization config, under TRL's ``model_init_kwargs``.

Pure Python: no torch, no transformers needed (with transformers installed, its field list
tells a typo from a field of another version).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

from batchfit.errors import OptionError
from batchfit.integrations.trainer_fields import (
    GRPO_FIELDS,
    PPO_FIELDS,
    SECTIONS,
    TRL_FIELDS,
    TrainerMapping,
    args_to_dict,
    traced_in_a_trainer,  # noqa: F401 - imported from here by the integrations
)


def known_fields() -> frozenset[str] | None:
    """The TrainingArguments fields of the transformers installed here, and SFTConfig's
    (:data:`TRL_FIELDS`); None without transformers (a typo cannot be told from a field of
    another version then)."""
    try:
        from transformers import TrainingArguments
    except ImportError:
        import warnings

        warnings.warn("transformers is not installed, so the args' field names are not checked for typos: "
                      "pip install 'batchfit[hf]'", stacklevel=3)
        return None
    names = {f.name for f in dataclasses.fields(TrainingArguments)}  # TRL's own: TRL_FIELDS, no TRL needed
    return frozenset(names | TRL_FIELDS | GRPO_FIELDS | PPO_FIELDS | set(SECTIONS))


def from_training_arguments(args: Any, *, world_size: int | None = None, source: str = "the args",
                            deepspeed_config: Mapping | None = None,
                            fields: frozenset[str] | None = None, check_fields: bool = True) -> TrainerMapping:
    """Map ``args`` (a dict read from ``to_json_string()``, or a TrainingArguments / SFTConfig
    object) onto batchfit's options; every field ends up in ``used`` or ``unused``.

    ``world_size``: the devices it trains on (a live TrainingArguments knows; a file does not:
    1). ``deepspeed_config``: the DeepSpeed JSON the ``deepspeed`` field names, already read
    (``trainer_files.load_trainer_args`` reads it). ``fields``: the known field names (default:
    :func:`known_fields`); an unknown field close to a known one is an OptionError naming it.
    ``check_fields=False``: no field list (args built by batchfit itself, e.g. from a Lightning
    Trainer: no typo possible, and no transformers import).
    """
    data = args_to_dict(args)
    if world_size is None:
        live = getattr(args, "world_size", None) if not isinstance(args, Mapping) else data.get("world_size")
        world_size = live if isinstance(live, int) and live >= 1 else 1
    if fields is None and check_fields:
        fields = known_fields()
    if isinstance(args, Mapping):  # only a file can hold a typo: a live TrainingArguments refuses one
        _refuse_typos(data, fields, source)
    from batchfit.integrations.trainer_mapper import Mapper

    return Mapper(data, world_size, deepspeed_config, fields).run()


def _refuse_typos(data: Mapping, fields: frozenset[str] | None, source: str) -> None:
    if fields is None:
        return
    for name in data:
        if name in fields or name == "world_size":
            continue
        close = difflib.get_close_matches(name, sorted(fields), n=1, cutoff=0.8)
        if close:
            raise OptionError(f"{source}: unknown field '{name}': did you mean '{close[0]}'? (fix the name, or "
                              "save the args with TrainingArguments(...).to_json_string())")
