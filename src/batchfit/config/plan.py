"""``batchfit plan``'s flags, a ``--trainer`` file and a torchtitan job as one :class:`PlanConfig`.

Two steps, with the output paths checked between them (``cli/plan.py``): :func:`read_plan_doors`
reads what the plan starts from (the args, the job, the ``--emit`` list) and refuses a pair that
cannot go together; :func:`plan_config` merges them with the flags, in the order the checks
have always run, into the StepOptions, the GPU and the engine's :class:`~batchfit.plan.request.PlanRequest`.
A flag given on the command line wins over a torchtitan job; one that contradicts ``--trainer`` is
an error (``config/trainer.py``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from batchfit.config.step import DataFlags, StepFlags, parse_batch_sizes, parse_host_memory, quiet
from batchfit.config.torchtitan import read_torchtitan, torchtitan_defaults
from batchfit.config.trainer import (
    FrontDoor,
    data_rows,
    merged_batch_sizes,
    merged_options,
    merged_seq_len,
    read_trainer,
)
from batchfit.errors import OptionError
from batchfit.plan.emit import parse_emit
from batchfit.plan.request import DEFAULT_STRATEGIES, PlanRequest
from batchfit.plan.time_model import TimeModel, calibrated
from batchfit.plan.world import World, parse_tokens, parse_worlds
from batchfit.search import DEFAULT_MAX_BATCH
from batchfit.targets import Target
from batchfit.workload import StepOptions

if TYPE_CHECKING:  # batchfit.zoo imports torch: not for --help
    from batchfit.zoo.torchtitan_job import TitanJob

MAX_GPUS = 1 << 20
"""More GPUs than any cluster has: past it, counts are typos (and overflow the time model)."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class PlanFlags(DataFlags):
    """plan's own flags, each field the flag of its name (the step's are :class:`StepFlags`)."""

    no_cache: bool = False
    gpus: str | None = None
    nodes: int | None = None
    gpus_per_node: int | None = None
    strategies: str = DEFAULT_STRATEGIES
    global_batch: int | None = None
    tokens: str | None = None
    host_memory: str | None = None
    tp_loss: str = "sharded"
    batch_sizes: str | None = None
    target_util: float = 0.9
    multiple_of: int = 1
    max_batch: int = DEFAULT_MAX_BATCH
    limit: str = "reserved"
    mfu: float | None = None
    calibrate: Path | None = None
    intra_node_gb_per_s: float | None = None
    inter_node_gb_per_s: float | None = None
    emit: list[str] | None = None
    processes: int | None = None
    trainer: str | None = None
    pp_schedule: str = "1f1b"
    microbatches: int = 0


@dataclasses.dataclass(kw_only=True)
class PlanDoors:
    """What a plan starts from, read before any check: the --trainer args, the torchtitan job, the --emit files."""

    door: FrontDoor | None
    """The --trainer args, mapped (None: not given)."""
    titan: TitanJob | None
    """The torchtitan job of a ``torchtitan:FILE`` model (None: another model)."""
    emit: list[str]
    """--emit's values but ``trainer:FILE`` (a YAML, ``accelerate:FILE``, ``torchtitan:FILE``)."""
    trainer_emits: list[Path]
    """--emit trainer:FILE's files: the args written back with the recommended batch."""

    def output_files(self) -> list[tuple[str, str | Path]]:
        """(option, path) of every file --emit will write, to check before any work."""
        return [*(("--emit", path) for path in map(emit_path, self.emit) if path),
                *(("--emit", path) for path in self.trainer_emits)]


@dataclasses.dataclass(kw_only=True)
class PlanConfig:
    """Everything a plan runs with, typed, whichever door the settings came through."""

    model: str
    """The MODEL spec (``specs.py``)."""
    seq_len: int | None
    """Tokens per sample (the flag's, the args' max_length or the longest row of --data); None: the model's."""
    options: StepOptions
    target: Target
    """The GPU planned for (``target.device`` is set)."""
    request: PlanRequest
    """What the engine is asked (``plan/request.py``)."""
    emits: list[tuple[str, Path]]
    """(kind, path) of each --emit but ``trainer:`` (``plan/emit.py``)."""
    doors: PlanDoors
    data_section: dict | None
    """The JSON's ``data`` section with --data (``config/trainer.py: data_rows``), else None."""


def read_plan_doors(model: str, trainer: str | None, emit: list[str] | None) -> PlanDoors:
    """Read --trainer and a ``torchtitan:`` model, and split --emit; refuse the pairs that cannot go together."""
    door = read_trainer(trainer)
    titan = read_torchtitan(model)  # torchtitan:job.toml: its settings are the defaults of plan_config
    if titan is not None and door is not None:
        raise OptionError("give a torchtitan job or `trainer`, not both: each says how the model trains")
    trainer_emits = [Path(text.partition(":")[2]) for text in emit or [] if text.startswith("trainer:")]
    if trainer_emits and door is None:
        raise OptionError("`emit` trainer:FILE writes your TrainingArguments back: give them with `trainer` args.json")
    return PlanDoors(door=door, titan=titan, trainer_emits=trainer_emits,
                     emit=[text for text in emit or [] if not text.startswith("trainer:")])


def plan_config(flags: PlanFlags, step: StepFlags, doors: PlanDoors, say: Callable[[str], None] = quiet) -> PlanConfig:
    """The flags merged with the doors (a torchtitan job's settings where a flag was left at its default, the
    --trainer args' where they agree), every value checked before any trace; ``say``: a line for the user."""
    emits = [parse_emit(text) for text in doors.emit]
    if flags.mfu is not None and flags.calibrate is not None:
        raise OptionError("give `mfu` or `calibrate`, not both: `calibrate` takes the MFU from a bench run")
    if flags.processes is not None and flags.processes < 1:
        raise OptionError(f"`processes` must be 1 or more, got {flags.processes}: e.g. `processes` 2")
    sizes = parse_batch_sizes(flags.batch_sizes)
    gpus, strategies, global_batch = flags.gpus, flags.strategies, flags.global_batch
    if doors.titan is not None:
        gpus, strategies, global_batch, precision, compile_, sizes = torchtitan_defaults(
            doors.titan, gpus=gpus, nodes=flags.nodes, strategies=strategies, default_strategies=DEFAULT_STRATEGIES,
            global_batch=global_batch, precision=step.precision, compile_=step.compile_,
            checkpointing=step.checkpointing, batch_sizes=sizes)
        step = dataclasses.replace(step, precision=precision, compile_=compile_)
    door = doors.door
    options = merged_options(step.options(say), door, accumulation=False)  # the plan picks the accumulation
    options = dataclasses.replace(options, tp_loss=flags.tp_loss)
    host_memory_bytes = parse_host_memory(flags.host_memory)
    seq_len = merged_seq_len(flags.seq_len, door)
    seq_len, data_section = data_rows(flags.model, seq_len, door, flags.data, flags.batching, flags.length_column,
                                      flags.tokenizer)
    time_model = _time_model(flags, step.precision)
    worlds = parse_worlds(gpus, flags.nodes, flags.gpus_per_node)
    if max(world.gpus for world in worlds) > MAX_GPUS:
        raise OptionError(f"at most {MAX_GPUS:,} GPUs (2^20) in all, got {max(w.gpus for w in worlds):,}: "
                          "e.g. `gpus` 64 or `nodes` 8 `gpus_per_node` 8")
    if parse_tokens(flags.tokens) == math.inf:  # a bad --tokens is one line before any trace
        raise OptionError(f"`tokens` {flags.tokens} is not a finite count: e.g. `tokens` 2e11 or `tokens` chinchilla")
    sizes = merged_batch_sizes(sizes, door)
    if door is not None:
        strategies, global_batch = trainer_plan(door, strategies, global_batch, worlds)
    target = flags.target(say)
    if target.device is None:
        raise OptionError("plan sizes a batch for a GPU: give `gpu` (e.g. `gpu` h100-80gb) or `gpu_memory` 80GiB")
    request = PlanRequest(worlds=worlds, strategies=strategies, global_batch=global_batch, tokens=flags.tokens,
                          batch_sizes=sizes, target_util=flags.target_util, multiple_of=flags.multiple_of,
                          max_batch=flags.max_batch, time_model=time_model, processes=flags.processes,
                          limit=flags.limit, host_memory_bytes=host_memory_bytes, pp_schedule=flags.pp_schedule,
                          microbatches=flags.microbatches, cache=not flags.no_cache)
    return PlanConfig(model=flags.model, seq_len=seq_len, options=options, target=target, request=request,
                      emits=emits, doors=doors, data_section=data_section)


def _time_model(flags: PlanFlags, precision: str) -> TimeModel:
    """--calibrate's MFU (a bench run's), --mfu, or the default; the links' GB/s where given."""
    time_model = (calibrated(flags.calibrate, precision) if flags.calibrate is not None
                  else TimeModel(mfu=flags.mfu, mfu_source="set by the user (--mfu)") if flags.mfu is not None
                  else TimeModel())
    return TimeModel(mfu=time_model.mfu, mfu_source=time_model.mfu_source,
                     intra_node_gb_per_s=flags.intra_node_gb_per_s, inter_node_gb_per_s=flags.inter_node_gb_per_s)


def trainer_plan(door: FrontDoor, strategies: str, global_batch: int | None, worlds: list[World]) -> tuple[str, int]:
    """--trainer's strategy (fsdp, deepspeed) unless --strategies was given, and its global batch
    (per-device batch x accumulation x its world size, else x the GPUs planned) unless --global-batch was."""
    mapping = door.mapping
    if mapping.strategy and strategies == DEFAULT_STRATEGIES:
        strategies = mapping.strategy
    if mapping.world_size == 1:  # a saved TrainingArguments does not record it: the GPUs planned
        mapping.world_size = worlds[0].gpus
    return strategies, global_batch or mapping.global_batch


def trainer_answer(result) -> dict:
    """per_device_train_batch_size and gradient_accumulation_steps of the recommended plan."""
    best = result.recommended[0] if result.recommended else None
    return {"global_batch": result.global_batch, "world_size": best.gpus if best else None,
            "max_micro_batch": best.max_local_batch if best else 0, "source": "traced",
            "strategy": best.strategy if best else None,
            "per_device_train_batch_size": best.micro_batch if best and best.fits else None,
            "gradient_accumulation_steps": best.accumulation_steps if best and best.fits else None,
            "notes": [] if best and best.fits else ["no strategy fits"]}


def emit_path(text: str) -> str:
    """The file of an --emit value ('accelerate:FILE', 'torchtitan:FILE' or FILE), to check before any trace."""
    kind, _, rest = text.partition(":")
    path = rest if kind in ("accelerate", "torchtitan") else text
    return "" if path in ("", ".") else path
