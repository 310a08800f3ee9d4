"""``--emit``: the recommended configuration as files a trainer reads.

    --emit config.yaml             seed 001's ``training.batch_config`` shape, one entry per GPU
                                   count, each with its ``torchrun`` command line
    --emit accelerate:fsdp.yaml    an Accelerate config (``accelerate launch --config_file``)
                                   for the recommended DDP / FSDP2 / HSDP run
    --emit torchtitan:job.toml     a torchtitan job config's [parallelism] and batch sizes
                                   (``plan/emit_torchtitan.py``; patches the torchtitan:job.toml planned)

Pure Python, no torch and no PyYAML (a base install has no YAML library): a PlanResult in,
text out. The YAML is written by :func:`dump_yaml`, for the only shapes emitted here: nested
mappings of strings, integers, floats, booleans and None.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from batchfit.distributed.parallelisms import degree_of, registered
from batchfit.errors import OptionError

EMIT_HELP = "FILE (YAML + torchrun line), accelerate:FILE or torchtitan:FILE"
SCRIPT = "train.py"
"""The training script in the torchrun line: batchfit cannot know it; the YAML says to replace it."""


_PLAIN = re.compile(r"[A-Za-z_$/][A-Za-z0-9_$/.:=+,()@ -]*")
"""Strings written unquoted: they start with a letter (or _ $ /), so YAML cannot read them as a
number, a date, null, an anchor, a tag or a flow collection."""
_YAML11_WORDS = {"y", "yes", "n", "no", "true", "false", "on", "off", "null"}
"""Words YAML 1.1 (PyYAML's) reads as booleans or null in any of their spellings."""


def _scalar(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return ".nan"
        if math.isinf(value):
            return ".inf" if value > 0 else "-.inf"
        text = repr(value)  # YAML 1.1 floats need a dot: 1e-05 -> 1.0e-05
        return text.replace("e", ".0e", 1) if "e" in text and "." not in text else text
    if isinstance(value, str):
        plain = (_PLAIN.fullmatch(value) and not value.endswith((" ", ":")) and ": " not in value
                 and " #" not in value and value.lower() not in _YAML11_WORDS)
        return value if plain else _quoted(value)
    raise TypeError(f"cannot write {type(value).__name__} as YAML: {value!r}")


_PRINTABLE = re.compile("[\t\x20-\x7e\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
"""The characters a YAML stream may hold as they are (YAML 1.1, 5.1); others are escaped."""


def _quoted(value: str) -> str:
    """A double-quoted YAML scalar: backslash escapes for quotes, line breaks and unprintables."""
    out = []
    for ch in value:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif _PRINTABLE.fullmatch(ch) and ch not in "\u2028\u2029":  # YAML 1.1 reads those as line breaks
            out.append(ch)
        else:
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return '"' + "".join(out) + '"'


def dump_yaml(data: dict, indent: int = 0) -> str:
    """``data`` (nested dicts of str / int / float / bool / None) as block YAML, keys in order."""
    lines = []
    for key, value in data.items():
        head = " " * indent + _scalar(str(key)) + ":"
        if isinstance(value, dict) and value:
            lines.append(head + "\n" + dump_yaml(value, indent + 2))
        else:
            lines.append(head + " " + ("{}" if isinstance(value, dict) else _scalar(value)) + "\n")
    return "".join(lines)


def parse_emit(text: str) -> tuple[str, Path]:
    """'config.yaml' -> ('yaml', path); 'accelerate:fsdp.yaml' -> ('accelerate', path).
    The folder must exist: refused before any trace, so no result is lost."""
    kind, _, rest = text.partition(":")
    kind, path = (kind, Path(rest)) if kind in ("accelerate", "torchtitan") else ("yaml", Path(text))
    if not str(path) or str(path) == ".":
        raise OptionError(f"`emit` {text}: give a file, e.g. `emit` config.yaml or `emit` accelerate:fsdp.yaml")
    if not path.parent.is_dir():
        raise OptionError(f"`emit` {text}: the folder '{path.parent}' does not exist; create it or write elsewhere")
    if path.is_dir():
        raise OptionError(f"`emit` {text} is a folder: give a file name, e.g. `emit` {path}/config.yaml")
    return kind, path


def torchrun_line(p, script: str = SCRIPT) -> str:
    """How to launch ``p`` (a StrategyPlan): one process per GPU on each node."""
    per_node = p.gpus // p.nodes
    if p.nodes == 1:
        return f"torchrun --standalone --nnodes 1 --nproc-per-node {per_node} {script}"
    return (f"torchrun --nnodes {p.nodes} --nproc-per-node {per_node} --rdzv-backend c10d "
            f"--rdzv-endpoint $MASTER_ADDR:29500 {script}")


def _entry_name(result, p) -> str:
    family = re.sub(r"-\d+gb$", "", result.device.name).replace("-", "_")
    return f"{family}_{p.gpus}gpu" + (f"_{p.nodes}node" if p.nodes > 1 else "")


def config_yaml(result) -> str:
    """Seed 001's ``config.yaml`` shape: ``training.batch_config.<gpu>_<n>gpu`` entries."""
    if not result.recommended:
        raise OptionError("no strategy fits, so there is nothing to emit: see the report's 'what would make it fit'")
    entries = {}
    for p in result.recommended:
        entries[_entry_name(result, p)] = {
            "batch_size": p.micro_batch,
            "gradient_accumulation_steps": p.accumulation_steps,
            "effective_batch_size": p.global_batch,
            "world_size": p.gpus,
            "nodes": p.nodes,
            "strategy": p.strategy,
            "data_parallel": p.dp,
            **{k.config_key: degree_of(p, k.key) for k in registered()  # tensor_parallel always; the others above 1
               if k.config_key and (degree_of(p, k.key) > 1 or k.config_at_1)},
            "elastic_target_util": result.target_util,
            "peak_gib_per_gpu": round(p.peak_bytes_at_micro / 2**30, 2),
            "launch": torchrun_line(p),
        }
    head = (f"# batchfit plan: {result.workload} on {result.device.display_name}, {result.options.precision}.\n"
            "# batch_size is per GPU (the micro-batch); effective_batch_size = batch_size x data_parallel x\n"
            f"# gradient_accumulation_steps. Memory traced, not measured. Replace {SCRIPT} in launch with "
            "your script.\n")
    return head + dump_yaml({"training": {"batch_config": entries}})


ACCELERATE_PRECISION = {"fp32": "no", "bf16-mixed": "bf16", "fp16-mixed": "fp16", "bf16": "bf16",
                        "fp8-tensorwise": "fp8", "fp8-rowwise": "fp8"}


def accelerate_yaml(result) -> str:
    """An Accelerate config for the recommended run on the largest GPU count: its data-parallel wrap as
    Accelerate's ``distributed_type`` (MULTI_GPU, FSDP2, DeepSpeed ZeRO stage 1 / 2) with the replicate / shard /
    tp sizes of ``parallelism_config``, and each parallelism the row uses as its registry entry writes it
    (``Parallelism.accelerate``, ``distributed/parallelisms.py``); one the config cannot say is refused by its
    ``words``."""
    if not result.recommended:
        raise OptionError("no strategy fits, so there is nothing to emit: see the report's 'what would make it fit'")
    p = result.recommended[-1]
    parallel: dict[str, object] = {}  # each parallelism's own parallelism_config keys (cp's size and ring)
    for own in (k for k in registered() if k.degree and k.used_by(p)):  # pp and ep: the config cannot say them
        if own.accelerate is None:
            raise OptionError(f"the recommended {p.strategy} is {own.words}, which Accelerate's config cannot say: "
                              f"emit the YAML (`emit` config.yaml), or plan without {own.token} strategies")
        parallel.update(own.accelerate(p, degree_of(p, own.key)))
    config = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": ("NO" if p.gpus == 1 else "MULTI_GPU" if p.shard in ("ddp", "none") and p.tp == 1
                             else "DEEPSPEED" if p.shard in ("zero1", "zero2") else "FSDP"),
        "mixed_precision": ACCELERATE_PRECISION[result.options.precision],
        "num_machines": p.nodes,
        "num_processes": p.gpus,
        "machine_rank": 0,
        "main_training_function": "main",
        "rdzv_backend": "static" if p.nodes == 1 else "c10d",
        "same_network": True,
        "use_cpu": False,
        "gradient_accumulation_steps": p.accumulation_steps,
    }
    if config["distributed_type"] == "DEEPSPEED":
        # Accelerate's DeepSpeed plugin, ZeRO stage 1 / 2: the optimizer state (and gradients)
        # partitioned, the parameters replicated, as zero1 / zero2 traced them.
        config["deepspeed_config"] = {"zero_stage": 1 if p.shard == "zero1" else 2,
                                      "gradient_accumulation_steps": p.accumulation_steps,
                                      "offload_optimizer_device": "none", "offload_param_device": "none",
                                      "zero3_init_flag": False}
    fp8_note = ""
    if config["mixed_precision"] == "fp8":  # Accelerate's torchao backend; the recipe is set in the script
        config["fp8_config"] = {"backend": "AO"}
        recipe = result.options.precision_spec.fp8_recipe
        fp8_note = (f"# float8 ({recipe}): pass AORecipeKwargs(config=Float8LinearConfig.from_recipe_name('{recipe}')) "
                    "to Accelerator(kwargs_handlers=...) in your script.\n")
    if config["distributed_type"] == "FSDP":
        fsdp = {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": p.shard != "fsdp-noreshard",
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_activation_checkpointing": result.options.checkpointing == "full",
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_offload_params": False,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        }
        # No fsdp_transformer_layer_cls_to_wrap: Accelerate then wraps a transformers model's
        # _no_split_modules (its decoder layers), one FSDP group per block as the trace did.
        config["fsdp_config"] = fsdp
        if p.shard == "hsdp" or p.tp > 1 or parallel:
            replicas = p.replicas if p.shard == "hsdp" else 1
            config["parallelism_config"] = {"parallelism_config_dp_replicate_size": replicas,
                                            "parallelism_config_dp_shard_size": p.dp // replicas,
                                            "parallelism_config_tp_size": p.tp, **parallel}
    head = (f"# batchfit plan: {result.workload}, {p.strategy} on {p.gpus} GPUs; per-GPU batch size "
            f"{p.micro_batch}, {p.accumulation_steps} accumulation steps, global batch {p.global_batch}.\n"
            "# accelerate launch --config_file THIS_FILE your_script.py\n" + fp8_note)
    if config["distributed_type"] == "DEEPSPEED":
        head += ("# Traced with torch's ZeroRedundancyOptimizer, not DeepSpeed: DeepSpeed's own reduce bucket and\n"
                 "# gradient partition buffers (reduce_bucket_size) and, under bf16, fp32 master weights "
                 "come on top.\n")
    return head + dump_yaml(config)


def write_emit(kind: str, path: Path, result, *, torchtitan_source: Path | None = None) -> Path:
    """Write ``kind``'s file for ``result``; ``torchtitan_source``: the torchtitan toml the plan
    started from, which ``torchtitan:`` patches."""
    if kind == "torchtitan":
        from batchfit.plan.emit_torchtitan import torchtitan_toml

        source = torchtitan_source.read_text() if torchtitan_source is not None else None
        text = torchtitan_toml(result, source)
    else:
        text = accelerate_yaml(result) if kind == "accelerate" else config_yaml(result)
    path.write_text(text)
    return path
