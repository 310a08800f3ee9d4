"""``batchfit probe``'s flags and a ``--trainer`` file as one :class:`ProbeConfig`.

As for estimate (``config/estimate.py``), two steps with the output paths checked between them
(``cli/probe.py``): :func:`read_probe_door` reads the args and ``--emit trainer:FILE``;
:func:`probe_config` merges them with the flags and checks every value before torch loads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from batchfit.config.step import DataFlags, StepFlags, quiet
from batchfit.config.trainer import FrontDoor, answer, merged_step, parse_trainer_emit, read_trainer
from batchfit.errors import OptionError
from batchfit.probe.request import ProbeRequest
from batchfit.search import no_memory_limit
from batchfit.targets import Target
from batchfit.workload import StepOptions

DEFAULT_MAX = 4096
"""probe's ``max`` when none is given (the library's default cap, ``search.DEFAULT_MAX_BATCH``, is larger)."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class ProbeFlags(DataFlags):
    """probe's own flags, each field the flag of its name (the step's are :class:`StepFlags`)."""

    policy: str = "guided"
    multiple_of: int = 1
    min_batch: int = 1
    max_batch: int | None = None
    steps: int = 2
    isolate: bool = False
    stop_on_nan: bool = False
    target_util: float = 0.9
    verify_tiers: bool = False
    global_batch: int | None = None
    strategy: str | None = None
    limit: str = "reserved"


@dataclasses.dataclass(kw_only=True)
class ProbeConfig:
    """Everything a probe runs with, typed, from the flags and the --trainer args."""

    target: Target
    options: StepOptions
    seq_len: int | None
    """Tokens per sample (the flag's, the args' max_length, or --data's longest row); None: the model's."""
    data_section: dict | None
    """The JSON's ``data`` section (--data), None without --data."""
    request: ProbeRequest
    """The search (``probe/request.py``), the engine's to read."""


def read_probe_door(trainer: str | None, emit: list[str] | None) -> tuple[FrontDoor | None, Path | None]:
    """(the --trainer args, --emit trainer:FILE's file), read before the outputs are checked."""
    door = read_trainer(trainer)
    return door, parse_trainer_emit(emit, door)


def probe_config(flags: ProbeFlags, step: StepFlags, door: FrontDoor | None,
                 say: Callable[[str], None] = quiet) -> ProbeConfig:
    """The flags merged with the --trainer args (where they agree), every value checked before torch loads;
    ``say``: a line for the user."""
    target = flags.target(say)
    if target.kind == "cpu" and target.device is None and flags.max_batch is None:  # before torch loads
        raise OptionError(no_memory_limit("probe `device` cpu", "`max` N", "add `gpu` t4-16gb or `gpu_memory` 16GiB"))
    options, seq_len, section = merged_step(flags, step, door, say)
    global_batch = flags.global_batch
    if door is not None and global_batch is None:  # the args' global batch, per device
        global_batch = door.mapping.global_batch // door.mapping.world_size
    request = ProbeRequest(policy=flags.policy, multiple_of=flags.multiple_of, smallest=flags.min_batch,
                           largest=DEFAULT_MAX if flags.max_batch is None else flags.max_batch, steps=flags.steps,
                           isolate=flags.isolate, spec=flags.model, seq_len=seq_len, stop_on_nan=flags.stop_on_nan,
                           target_util=flags.target_util, global_batch=global_batch,
                           verify_tiers=flags.verify_tiers, limit=flags.limit, strategy=flags.strategy)
    request.check()
    return ProbeConfig(target=target, options=options, seq_len=seq_len, data_section=section, request=request)


def probe_answer(door: FrontDoor, result, config: ProbeConfig) -> dict:
    """The args' per-device batch and accumulation from a probe: its production tier (else its maximum)."""
    tier = next((r for r in result.recommendations if r.name == "production"), None)
    return answer(door, tier.batch_size if tier else result.max_batch_size, config.options.accumulation_steps,
                  multiple_of=config.request.multiple_of,
                  source="probed" if config.target.kind == "cuda" else "traced (virtual)")
