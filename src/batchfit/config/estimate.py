"""``batchfit estimate``'s flags and a ``--trainer`` file as one :class:`EstimateConfig`.

As for plan (``config/plan.py``), two steps with the output paths checked between them
(``cli/estimate.py``): :func:`read_estimate_door` reads the args and ``--emit trainer:FILE``;
:func:`estimate_config` merges them with the flags and checks every value before torch loads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchfit.config.step import DataFlags, StepFlags, parse_batch_sizes, parse_host_memory, quiet
from batchfit.config.trainer import (
    FrontDoor,
    merged_batch_sizes,
    merged_batching,
    merged_eval,
    merged_options,
    merged_seq_len,
    parse_trainer_emit,
    read_trainer,
)
from batchfit.errors import OptionError
from batchfit.estimator.batching import check_run_flags
from batchfit.estimator.request import EstimateRequest, RunRequest
from batchfit.search import DEFAULT_MAX_BATCH, check_estimate_options
from batchfit.targets import Target
from batchfit.workload import StepOptions


@dataclasses.dataclass(kw_only=True, frozen=True)
class EstimateFlags(DataFlags):
    """estimate's own flags, each field the flag of its name (the step's are :class:`StepFlags`)."""

    host_memory: str | None = None
    batch_sizes: str | None = None
    target_util: float = 0.9
    multiple_of: int = 1
    max_batch: int = DEFAULT_MAX_BATCH
    global_batch: int | None = None
    limit: str = "reserved"
    replay_steps: int = 0
    replay_order: str = "data"
    eval_batch_size: int | None = None
    eval_accumulation_steps: int | None = None
    no_cache: bool = False


@dataclasses.dataclass(kw_only=True)
class EstimateConfig:
    """Everything an estimate runs with, typed, from the flags and the --trainer args."""

    flags: EstimateFlags
    """The flags as typed (the model, --data's readers)."""
    seq_len: int | None
    """Tokens per sample (the flag's or the args' max_length); None: the model's."""
    options: StepOptions
    target: Target
    """The GPU sized for (``target.device`` is set)."""
    request: EstimateRequest
    """The search, limits, global batch and eval loop (``estimator/request.py``), the engine's to read."""
    run: RunRequest | None
    """--data: the data the run steps through and how it is batched; None for one shape."""
    rollout: Any = None
    """A TRL GRPOConfig / PPOConfig's generation settings (``--trainer``): the step traced is the RL step."""


def read_estimate_door(trainer: str | None, emit: list[str] | None,
                       global_batch: int | None) -> tuple[FrontDoor | None, Path | None]:
    """(the --trainer args, --emit trainer:FILE's file), read before the outputs are checked."""
    door = read_trainer(trainer, rl=True)
    if door is not None and global_batch is not None:
        raise OptionError("`trainer` gives the global batch (per-device batch x accumulation x world size): "
                          "drop `global_batch`, or drop `trainer` and give the options as flags")
    return door, parse_trainer_emit(emit, door)


def estimate_config(flags: EstimateFlags, step: StepFlags, door: FrontDoor | None, emit_path: Path | None,
                    say: Callable[[str], None] = quiet) -> EstimateConfig:
    """The flags merged with the --trainer args (where they agree), every value checked before torch loads;
    ``say``: a line for the user."""
    target = flags.target(say)
    if target.device is None:
        raise OptionError("estimate sizes a batch for a GPU: give `gpu` (e.g. `gpu` h100-80gb), "
                          "`gpu_memory` 24GiB or `device` cuda")
    options = step.options(say, routing_per_step=True)
    if options.routing_schedule.varies and not (flags.data and flags.replay_steps):
        raise OptionError(f"`routing` {step.routing} gives a routing per step: add `data` FILE `replay_steps` K (the "
                          "run's first K steps replayed, each with its routing), or give one routing")
    host_memory_bytes = parse_host_memory(flags.host_memory)
    options = merged_options(options, door)
    seq_len = merged_seq_len(flags.seq_len, door)
    sizes = merged_batch_sizes(parse_batch_sizes(flags.batch_sizes), door)
    check_estimate_options(target_util=flags.target_util, multiple_of=flags.multiple_of, batch_sizes=sizes,
                           max_batch=flags.max_batch, limit=flags.limit)  # before --data is read
    run_batching = check_run_flags(flags.data, merged_batching(flags.batching, flags.data, door), flags.length_column,
                                   flags.tokenizer, flags.replay_steps, flags.replay_order)
    if emit_path is not None and run_batching is not None and run_batching.kind == "tokens":
        raise OptionError(f"`batching` {run_batching} answers a token budget, which TrainingArguments has no field "
                          "for: drop `emit` (the budget is printed), or batch by pad-longest or pack:MAXLEN")
    eval_batch, eval_held = merged_eval(flags.eval_batch_size, flags.eval_accumulation_steps, door)
    rollout = door.mapping.rollout if door is not None else None
    if rollout is not None and (flags.data or seq_len or eval_batch):
        raise OptionError(f"`trainer` {door.args.path} is a GRPOConfig: its max_prompt_length and "
                          "max_completion_length set the lengths, so drop `data`, `seq_len` and `eval_batch_size`")
    if rollout is not None and emit_path is not None:  # TRL's steps_per_generation follows the accumulation
        raise OptionError("`emit` with a GRPOConfig: a new per_device_train_batch_size and gradient_accumulation_steps "
                          f"change the generation batch, traced here at {rollout.steps_per_generation} update steps "
                          "per generation; drop `emit` and set the batch the estimate answers by hand")
    request = EstimateRequest(batch_sizes=sizes, target_util=flags.target_util, multiple_of=flags.multiple_of,
                              max_batch=flags.max_batch, limit=flags.limit, host_memory_bytes=host_memory_bytes,
                              global_batch=flags.global_batch, eval_batch_size=eval_batch, eval_held_steps=eval_held,
                              cache=not flags.no_cache)
    run = (RunRequest(data=flags.data, batching=run_batching, seq_len=seq_len, replay_steps=flags.replay_steps,
                      replay_order=flags.replay_order) if run_batching is not None else None)
    return EstimateConfig(flags=flags, seq_len=seq_len, options=options, target=target, request=request, run=run,
                          rollout=rollout)
