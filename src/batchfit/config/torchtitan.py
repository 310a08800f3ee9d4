"""A torchtitan job toml (``batchfit plan torchtitan:job.toml``) as plan's defaults.

The toml (``zoo/torchtitan_job.py``) gives plan its GPUs (when the degrees name them all), its
strategy, global batch, sequence length, precision and compile; an option given on the command
line wins over the toml. Activation checkpointing is torchtitan's own (``apply_ac``, from
``[activation_checkpoint]``), so ``--checkpointing`` is refused here. Printing what was read is
``cli/torchtitan.py``'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchfit.errors import OptionError

if TYPE_CHECKING:  # batchfit.zoo imports torch: not for --help
    from batchfit.zoo.torchtitan_job import TitanJob

PREFIX = "torchtitan:"


def read_torchtitan(model: str) -> TitanJob | None:
    """The torchtitan job of a ``torchtitan:FILE`` model spec, else None."""
    from batchfit.zoo.torchtitan_job import read_job

    return read_job(model.removeprefix(PREFIX)) if model.startswith(PREFIX) else None


def torchtitan_defaults(job: TitanJob, *, gpus: str | None, nodes: int | None, strategies: str, default_strategies: str,
                        global_batch: int | None, precision: str, compile_: str, checkpointing: str,
                        batch_sizes: list[int] | None):
    """(gpus, strategies, global_batch, precision, compile, batch_sizes) with the job's values
    wherever the command line left plan's default."""
    if checkpointing != "none":
        raise OptionError(f"`checkpointing` with a torchtitan job: torchtitan's apply_ac does it; set "
                          f"[activation_checkpoint] mode in {job.path}")
    if gpus is None and nodes is None:
        world = job.world_size()
        if world is None:
            raise OptionError(f"{job.path} shards over the GPUs left over (data_parallel_shard_degree = -1): give "
                              "`gpus` N (e.g. `gpus` 8)")
        gpus = str(world)
    if strategies == default_strategies:
        counts = [int(n) for n in gpus.split(",")] if gpus is not None and gpus.replace(",", "").isdigit() else []
        names = dict.fromkeys(job.strategy(n) for n in counts)
        if len(names) == 1:
            strategies = next(iter(names))
    if global_batch is None and gpus is not None and gpus.isdigit():
        global_batch = job.global_batch(int(gpus))
    precision = job.precision if precision == "fp32" else precision
    compile_ = job.compile if compile_ == "none" else compile_
    sizes = sorted({*(batch_sizes or []), job.local_batch_size})
    return gpus, strategies, global_batch, precision, compile_, sizes


def torchtitan_approximation(job: TitanJob):
    """What torchtitan's train loop does around the step that the trace does not run, said on the result."""
    from batchfit.trace.approximation import Approximation

    parallelism = job.data.get("parallelism", {})
    extra = ("; enable_async_tensor_parallel: TP's collectives traced as plain ones, not symmetric-memory async TP"
             if parallelism.get("enable_async_tensor_parallel") and job.tp > 1 else "")
    return Approximation(
        what="torchtitan's train loop around the step is not traced: clip_grad_norm_ (max_norm) and the loss's "
             "all-reduce of the global token count" + extra,
        may_differ_by="one fp32 norm per parameter tensor (512 B each with CUDA's rounding: under 0.2 MiB for "
                      "Llama 3 8B's 291 tensors) and a few scalars",
        source="torchtitan 0.2.2 torchtitan/train.py (train_step); docs/tracing/front-doors.md, From a torchtitan job",
        detail=f"torchtitan job {job.path.name}")


def torchtitan_section(job: TitanJob, result) -> dict:
    """The JSON 'torchtitan' key: the file, the code traced, the mapping and the answer in the toml's terms."""
    from batchfit.zoo.torchtitan_job import TORCHTITAN_VERSION

    best = result.recommended[-1] if result.recommended else None
    answer = None
    if best is not None and best.fits:
        from batchfit.plan.emit_torchtitan import degrees

        answer = {"parallelism": degrees(best),
                  "training": {"local_batch_size": best.micro_batch, "global_batch_size": best.global_batch}}
    return {"file": str(job.path), "torchtitan_version": TORCHTITAN_VERSION,
            "code": "torchtitan's own model (TransformerModelArgs of the flavor) and parallelize_llama, traced",
            "model": job.model, "flavor": job.flavor,
            "mapping": [{"key": key, "used_as": how} for key, how in job.mapping], "answer": answer}
