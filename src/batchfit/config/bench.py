"""``batchfit bench``'s flags and a ``--trainer`` file as one :class:`BenchConfig`.

:func:`bench_config` merges the flags with the args (``config/trainer.py``, as probe does) and
checks every value before torch loads; ``cli/bench.py`` reads the args, calls it and prints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from batchfit.bench.request import BenchRequest
from batchfit.config.step import DataFlags, StepFlags, parse_batch_sizes, quiet
from batchfit.config.trainer import FrontDoor, merged_step
from batchfit.targets import Target
from batchfit.workload import StepOptions

BENCH_SIZES = "8,16,32,64"
"""bench's batch sizes when none are given (with --trainer: its per_device_train_batch_size)."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class BenchFlags(DataFlags):
    """bench's own flags, each field the flag of its name (the step's are :class:`StepFlags`)."""

    batch_sizes: str = BENCH_SIZES
    steps: int = 10
    warmup: int = 3
    leak_check: bool = False


@dataclasses.dataclass(kw_only=True)
class BenchConfig:
    """Everything a bench runs with, typed, from the flags and the --trainer args."""

    target: Target
    options: StepOptions
    seq_len: int | None
    """Tokens per sample (the flag's, the args' max_length, or --data's longest row); None: the model's."""
    data_section: dict | None
    """The JSON's ``data`` section (--data), None without --data."""
    request: BenchRequest
    """The sizes and steps (``bench/request.py``), the engine's to read."""


def bench_config(flags: BenchFlags, step: StepFlags, door: FrontDoor | None,
                 say: Callable[[str], None] = quiet) -> BenchConfig:
    """The flags merged with the --trainer args (where they agree), every value checked before torch loads;
    ``say``: a line for the user. With ``data``, every batch size is benched at the longest row a step of
    the data makes (as probe and plan)."""
    target = flags.target(say)
    options, seq_len, section = merged_step(flags, step, door, say)
    sizes = flags.batch_sizes
    if door is not None and sizes == BENCH_SIZES:  # the args' batch, unless sizes were given
        sizes = str(door.mapping.per_device_train_batch_size)
    request = BenchRequest(batch_sizes=parse_batch_sizes(sizes), steps=flags.steps, warmup=flags.warmup,
                           leak_check_steps=flags.steps if flags.leak_check else None)
    request.check()
    return BenchConfig(target=target, options=options, seq_len=seq_len, data_section=section, request=request)
