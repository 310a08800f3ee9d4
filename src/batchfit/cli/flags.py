"""Library errors name fields; the CLI prints the flag a command line types instead.

A library error names a setting as the keyword a library user passes, in backticks:
``seq_len``, or with a value, ``checkpointing='full'`` (see :mod:`batchfit.errors`). A CLI user
typed flags, so :func:`as_flags` turns each such name back into the flag:
``checkpointing='full'`` becomes ``--checkpointing full``, ``seq_len`` becomes ``--seq-len``.
One table, :data:`FIELD_FLAGS`; ``tests/test_layout.py`` checks every flag in it is declared
by some command and every backticked field a library error names is in it.
"""

from __future__ import annotations

import re

FIELDS = (
    "accumulation_steps", "attention", "batch_sizes", "batching", "branch_at", "cache_dir", "calibrate",
    "checkpoint_every", "checkpointing", "compile", "cooldown", "data", "device", "ema", "emit", "epsilon",
    "eval_accumulation_steps", "eval_batch_size", "eval_every", "eval_samples", "executor", "global_batch", "gpu",
    "gpu_memory", "gpus", "gpus_per_node", "grad_clip", "host_memory", "inter_node_gb_per_s", "intra_node_gb_per_s",
    "isolate", "json", "length_column", "limit", "lora", "loss", "lr", "lr_ref_batch", "lr_scaling", "lrs", "max",
    "max_batch", "max_share", "memory_budget", "mfu", "microbatches", "min", "min_lr_ratio", "multiple_of", "nodes",
    "offload", "optimizer", "param_groups", "policy", "pp_schedule", "precision", "processes", "quantize", "repeats",
    "replay_order", "replay_steps", "resume", "routing", "samples", "seeds", "seq_len", "steps", "store", "strategies",
    "strategy", "target_util", "tokenizer", "tokens", "tp_loss", "trainer", "val_fraction", "warmup", "window",
    "workers",
)
"""Fields whose flag is the field's name with dashes: ``seq_len`` is ``--seq-len``."""

RENAMED = {"frozen": "--freeze", "trainable": "--train-only"}
"""Fields a library user types under another name than the flag (``StepOptions.frozen``)."""

FIELD_FLAGS: dict[str, str] = {**{field: "--" + field.replace("_", "-") for field in FIELDS}, **RENAMED}
"""Field (as a library user types it) -> the flag a CLI user types for it."""

NAMED = re.compile(r"`([a-z][a-z0-9_]*)(?:=([^`]*))?`")
"""A field in backticks, with an optional ``=value``."""


def _unquoted(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def _flag(match: re.Match) -> str:
    field, value = match.group(1), match.group(2)
    flag = FIELD_FLAGS.get(field)
    if flag is None:
        return match.group(0)
    if value is None or value == "True":
        return flag
    return f"{flag} {_unquoted(value)}"


def as_flags(message: str) -> str:
    """``message`` with each backticked field of :data:`FIELD_FLAGS` written as its flag."""
    return NAMED.sub(_flag, message)
