"""A torchtitan job config (.toml) as a MODEL spec: ``torchtitan:path/to/job.toml``.

The file is read with ``tomllib`` into a :class:`TitanJob`: every key batchfit uses says what it
became (:attr:`TitanJob.mapping`), every key it does not use says why, one table. No torch and
no torchtitan here: ``--emit torchtitan:FILE`` and the bad-input checks need neither.

The model and the parallelisms are torchtitan's own (``zoo/torchtitan_model.py``, the
``[torchtitan]`` extra): the toml's ``[model] name/flavor`` picks torchtitan's ``TransformerModelArgs``
(``torchtitan.models.llama3.llama3_args``), and ``plan`` applies torchtitan's
``parallelize_llama`` (TP, activation checkpointing, FSDP2 / HSDP with its mixed-precision
policy) over its fake process group, so the traced step is the one torchtitan runs.

Written against torchtitan 0.2.2 (the last release that reads .toml job files; 0.3.0 moved to
Python configs and pins ``datasets<4.8``): its ``torchtitan/config/job_config.py`` is the list of
sections and defaults below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from batchfit.errors import ModelSpecError, read_text

TORCHTITAN_VERSION = "0.2.2"
"""The torchtitan release whose job config and code this front door reads (the ``[torchtitan]`` extra pins it)."""

SECTIONS = ("job", "profiling", "metrics", "model", "optimizer", "lr_scheduler", "training", "parallelism",
            "checkpoint", "activation_checkpoint", "compile", "quantize", "comm", "memory_estimation",
            "fault_tolerance", "experimental", "validation", "debug")
"""The sections of torchtitan 0.2.2's ``JobConfig`` (torchtitan/config/job_config.py), in its order."""

MODELS = {"llama3": ("debugmodel", "debugmodel_flex_attn", "debugmodel_varlen_attn", "8B", "8B_flex", "8B_varlen",
                     "70B", "405B")}
"""Models and flavors batchfit traces with torchtitan's code: ``torchtitan.models.llama3.llama3_args``
(0.2.2). The flex / varlen flavors are listed by torchtitan but need CUDA kernels: refused below."""

_UNUSED_SECTIONS = {
    "job": "names and folders of the run: no effect on a step's memory",
    "profiling": "the profiler's settings: not part of the step",
    "metrics": "logging: not part of the step",
    "lr_scheduler": "the learning-rate schedule: a scalar per step",
    "checkpoint": "saving checkpoints happens between steps, not inside one",
    "comm": "timeouts and tracing of collectives: no memory",
    "memory_estimation": "torchtitan's own estimator: batchfit is the estimate",
    "fault_tolerance": "torchft replicas: not traced",
    "experimental": "custom importers and model args: not read",
    "validation": "the validation loop runs between training steps (no gradients)",
    "debug": "seeds and determinism flags: no memory",
}
"""Whole sections batchfit does not use, and why (each key in them is listed with this reason)."""

_UNUSED_KEYS = {
    "model.hf_assets_path": "tokenizer and weights folder: the flavor fixes the vocabulary",
    "model.tokenizer_path": "the tokenizer: the flavor fixes the vocabulary",
    "model.print_after_conversion": "printing only",
    "optimizer.lr": "a scalar: no memory", "optimizer.beta1": "a scalar: no memory",
    "optimizer.beta2": "a scalar: no memory", "optimizer.early_step_in_backward": "not traced (off by default)",
    "training.max_norm": "gradient clipping: its norms (one fp32 scalar per parameter) are not traced",
    "training.steps": "how many steps, not what one holds", "training.dataset": "the data, not its shape",
    "training.dataset_path": "the data, not its shape", "training.gc_freq": "Python's garbage collector",
    "training.gc_debug": "Python's garbage collector", "training.seed": "no memory",
    "training.deterministic": "no memory",
    "parallelism.enable_async_tensor_parallel": "overlaps TP's collectives with compute (symmetric memory on "
                                                "CUDA): not traced, TP collectives counted as plain ones",
    "parallelism.pipeline_parallel_schedule": "pipeline_parallel_degree is 1",
    "parallelism.context_parallel_rotate_method": "context_parallel_degree is 1",
    "compile.backend": "batchfit traces AOTAutograd's partition itself (trace/compiled.py)",
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": "MoE routers only: Llama has none",
    "activation_checkpoint.early_stop": "passed to torchtitan's apply_ac as is",
    "activation_checkpoint.preserve_rng_state": "passed to torchtitan's apply_ac as is",
    "activation_checkpoint.determinism_check": "passed to torchtitan's apply_ac as is",
    "activation_checkpoint.debug": "passed to torchtitan's apply_ac as is",
}

_REFUSED = {
    "parallelism.pipeline_parallel_degree": "torchtitan's pipeline_llm is not traced yet: use batchfit's own "
                                            "pp<N> strategies on hf:llama-3.1-8b-shaped models",
    "parallelism.context_parallel_degree": "torchtitan's context parallelism is not traced yet",
    "parallelism.expert_parallel_degree": "Llama 3 has no experts",
    "training.enable_cpu_offload": "FSDP2's CPU offload under torchtitan is not traced yet: use `offload` params "
                                   "on a zoo model",
}
"""Keys whose non-default values batchfit cannot trace with torchtitan's code: a one-line error."""


@dataclass(kw_only=True)
class TitanJob:
    """What batchfit reads from a torchtitan job toml."""

    path: Path
    """The toml file."""
    data: dict
    """The whole toml, as tomllib read it."""
    model: str
    """[model] name ("llama3")."""
    flavor: str
    """[model] flavor ("debugmodel", "8B", ...)."""
    local_batch_size: int
    """[training] local_batch_size: samples per rank per micro-step."""
    global_batch_size: int
    """[training] global_batch_size; -1: local_batch_size x the data-parallel degree (no accumulation)."""
    seq_len: int
    """[training] seq_len."""
    dp_replicate: int
    """[parallelism] data_parallel_replicate_degree."""
    dp_shard: int
    """[parallelism] data_parallel_shard_degree; -1: the GPUs left over."""
    tp: int
    """[parallelism] tensor_parallel_degree."""
    precision: str
    """batchfit's --precision for [training] mixed_precision_param and [quantize.linear.float8]."""
    compile: str
    """batchfit's --compile for [compile] ("none" or "blocks": torchtitan compiles each block)."""
    mapping: list[tuple[str, str]] = field(default_factory=list)
    """(toml key, what batchfit made of it, or why it is not used), every key of the file."""

    def strategy(self, gpus: int) -> str:
        """batchfit's strategy name for these degrees on ``gpus`` GPUs."""
        shard = self.dp_shard if self.dp_shard != -1 else gpus // (self.dp_replicate * self.tp)
        if self.dp_replicate * shard * self.tp != gpus or shard < 1:
            raise ModelSpecError(
                f"{self.path}: [parallelism] data_parallel_replicate_degree {self.dp_replicate} x "
                f"data_parallel_shard_degree {self.dp_shard} x tensor_parallel_degree {self.tp} does not make "
                f"{gpus} GPUs: give `gpus` {self.world_size() or 'N'} or set data_parallel_shard_degree = -1")
        if self.dp_replicate > 1 and shard == 1:
            raise ModelSpecError(f"{self.path}: data_parallel_replicate_degree without sharding is torchtitan's "
                                 "DDP (replicate), not traced yet: set data_parallel_shard_degree > 1 (FSDP or HSDP)")
        if self.tp > 1:
            if self.dp_replicate > 1:
                raise ModelSpecError(f"{self.path}: HSDP with tensor parallelism is not traced yet: set "
                                     "data_parallel_replicate_degree = 1")
            return f"fsdp+tp{self.tp}" if shard > 1 else f"tp{self.tp}"
        if gpus == 1:
            return "fsdp"
        return f"hsdp{self.dp_replicate}" if self.dp_replicate > 1 else "fsdp"

    def world_size(self) -> int | None:
        """The GPUs the degrees name, None when data_parallel_shard_degree is -1 (the rest)."""
        return None if self.dp_shard == -1 else self.dp_replicate * self.dp_shard * self.tp

    def global_batch(self, gpus: int) -> int:
        """Samples per optimizer step: [training] global_batch_size, or local x data-parallel ranks."""
        if self.global_batch_size > 0:
            return self.global_batch_size
        return self.local_batch_size * (gpus // self.tp)


def _flat(data: dict, prefix: str = "") -> list[tuple[str, object]]:
    """Every key of ``data`` as 'section.key' (nested tables joined by dots), in file order."""
    out = []
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out += _flat(value, name + ".")
        else:
            out.append((name, value))
    return out


def _int(data: dict, section: str, key: str, default: int, path: Path) -> int:
    value = data.get(section, {}).get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ModelSpecError(f"{path}: [{section}] {key} must be an integer, got {value!r}")
    return value


def read_job(path: str | Path) -> TitanJob:
    """The torchtitan job at ``path``; a one-line ModelSpecError for a missing or malformed file,
    a section torchtitan does not have, a model or flavor it does not have, or settings batchfit
    cannot trace with torchtitan's code."""
    path = Path(path)
    if path.suffix == ".py" or ".py:" in str(path):
        raise ModelSpecError(f"torchtitan:{path}: torchtitan 0.3's Python configs are not read (torchtitan 0.3.0 pins "
                             "datasets<4.8 and is not installed here): give a torchtitan 0.2.x job .toml, e.g. "
                             "torchtitan:train_configs/llama3_8b.toml")
    if path.suffix != ".toml":
        raise ModelSpecError(f"torchtitan:{path}: give a torchtitan job config (.toml), e.g. "
                             "torchtitan:train_configs/llama3_8b.toml")
    try:
        text = read_text(path, f"torchtitan:{path}", ModelSpecError)
    except OSError as error:
        raise ModelSpecError(f"cannot read torchtitan job {path}: {error.strerror or error}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ModelSpecError(f"{path} is not valid TOML ({error}): fix that line") from None
    unknown = [name for name in data if name not in SECTIONS]
    if unknown:
        raise ModelSpecError(f"{path}: unknown section [{unknown[0]}]: torchtitan {TORCHTITAN_VERSION}'s job config "
                             f"has {', '.join(SECTIONS)}")
    model = data.get("model", {})
    name, flavor = model.get("name", "llama3"), model.get("flavor", "debugmodel")
    if name not in MODELS:
        raise ModelSpecError(f"{path}: [model] name = {name!r}: batchfit traces torchtitan's {', '.join(MODELS)} "
                             f"(flavors {', '.join(MODELS['llama3'])}); for other models use hf:<config>")
    if flavor not in MODELS[name]:
        raise ModelSpecError(f"{path}: torchtitan's {name} has no flavor {flavor!r}: use one of "
                             f"{', '.join(MODELS[name])}")
    if flavor.endswith(("_flex", "_flex_attn", "_varlen", "_varlen_attn")):
        raise ModelSpecError(f"{path}: flavor {flavor!r} uses flex / varlen attention (CUDA kernels), not traced: use "
                             f"{flavor.split('_')[0]}")
    for key, why in _REFUSED.items():
        section, _, option = key.partition(".")
        value = data.get(section, {}).get(option)
        if not (value is None or value is False or (type(value) is int and value == 1)):  # True == 1 in Python
            raise ModelSpecError(f"{path}: [{section}] {option} = {value!r}: {why}")
    converters = model.get("converters", [])
    if [c for c in converters if c != "float8"]:
        raise ModelSpecError(f"{path}: [model] converters {converters}: batchfit traces torchtitan's float8 converter "
                             "only (torchao's float8 linears); remove the others")
    float8 = data.get("quantize", {}).get("linear", {}).get("float8", {})
    recipe = float8.get("recipe_name") or "tensorwise"
    if recipe not in ("tensorwise", "rowwise"):
        raise ModelSpecError(f"{path}: [quantize.linear.float8] recipe_name = {recipe!r}: use tensorwise or rowwise")
    param_dtype = data.get("training", {}).get("mixed_precision_param", "bfloat16")
    if param_dtype not in ("bfloat16", "float32"):
        raise ModelSpecError(f"{path}: [training] mixed_precision_param = {param_dtype!r}: use bfloat16 or float32")
    if data.get("training", {}).get("dtype", "float32") != "float32":
        raise ModelSpecError(f"{path}: [training] dtype = 'bfloat16' (bf16 weights and optimizer state) is not "
                             "mapped yet: use float32 (torchtitan's default)")
    if float8.get("enable_fsdp_float8_all_gather", False) and "float8" in converters:
        raise ModelSpecError(f"{path}: [quantize.linear.float8] enable_fsdp_float8_all_gather = true under "
                             "torchtitan's apply_fsdp is not traced yet: set it to false")
    precision = f"fp8-{recipe}" if "float8" in converters else "bf16-mixed" if param_dtype == "bfloat16" else "fp32"
    compile_section = data.get("compile", {})
    compiled = bool(compile_section.get("enable", False)) and "model" in compile_section.get("components",
                                                                                            ["model", "loss"])
    if compiled:
        raise ModelSpecError(f"{path}: [compile] enable = true with 'model': torchtitan compiles each block of its "
                             "layers ModuleDict, which batchfit's compiled trace (a ModuleList of blocks) does not "
                             "reach yet; set enable = false to plan the eager step")
    ac = data.get("activation_checkpoint", {})
    if ac.get("mode", "selective") not in ("none", "selective", "full"):
        raise ModelSpecError(f"{path}: [activation_checkpoint] mode = {ac.get('mode')!r}: use none, selective or "
                             "full (memory_budget needs torch.compile's solver: not traced)")
    optimizer = data.get("optimizer", {})
    if optimizer.get("name", "AdamW") not in ("AdamW", "Adam"):
        raise ModelSpecError(f"{path}: [optimizer] name = {optimizer.get('name')!r}: torchtitan builds AdamW or Adam")
    job = TitanJob(
        path=path, data=data, model=name, flavor=flavor,
        local_batch_size=_int(data, "training", "local_batch_size", 8, path),
        global_batch_size=_int(data, "training", "global_batch_size", -1, path),
        seq_len=_int(data, "training", "seq_len", 2048, path),
        dp_replicate=_int(data, "parallelism", "data_parallel_replicate_degree", 1, path),
        dp_shard=_int(data, "parallelism", "data_parallel_shard_degree", -1, path),
        tp=_int(data, "parallelism", "tensor_parallel_degree", 1, path),
        precision=precision, compile="blocks" if compiled else "none")
    if job.local_batch_size < 1 or job.seq_len < 1 or job.dp_replicate < 1 or job.tp < 1 or \
            (job.dp_shard < 1 and job.dp_shard != -1):
        raise ModelSpecError(f"{path}: local_batch_size, seq_len and the parallel degrees must be 1 or more "
                             "(data_parallel_shard_degree may be -1)")
    job.mapping = _mapping(job)
    return job


_USED = {
    "model.name": "the model: torchtitan's {model}",
    "model.flavor": "torchtitan's TransformerModelArgs '{flavor}' (llama3_args)",
    "model.converters": "--precision {precision} (torchao's float8 linears)",
    "training.local_batch_size": "the micro-batch the plan starts from (traced; the plan may pick another)",
    "training.global_batch_size": "--global-batch",
    "training.seq_len": "--seq-len",
    "training.mixed_precision_param": "--precision {precision}; FSDP2's param_dtype in torchtitan's apply_fsdp",
    "training.mixed_precision_reduce": "FSDP2's reduce_dtype in torchtitan's apply_fsdp",
    "training.dtype": "float32 weights and optimizer state",
    "training.enable_cpu_offload": "off",
    "optimizer.name": "the optimizer, built as torchtitan's build_optimizers does",
    "optimizer.eps": "the optimizer's eps", "optimizer.weight_decay": "the optimizer's weight_decay",
    "optimizer.implementation": "fused / foreach / for-loop AdamW (its temporaries differ)",
    "parallelism.data_parallel_replicate_degree": "the strategy (HSDP replicas)",
    "parallelism.data_parallel_shard_degree": "the strategy (FSDP2 shards; -1: the GPUs left over)",
    "parallelism.tensor_parallel_degree": "the strategy (torchtitan's apply_tp)",
    "parallelism.disable_loss_parallel": "the loss under TP (torchtitan's apply_tp)",
    "parallelism.fsdp_reshard_after_forward": "torchtitan's apply_fsdp",
    "parallelism.pipeline_parallel_degree": "1 (no pipeline)",
    "parallelism.context_parallel_degree": "1 (no context parallelism)",
    "parallelism.expert_parallel_degree": "1",
    "activation_checkpoint.mode": "torchtitan's apply_ac",
    "activation_checkpoint.selective_ac_option": "torchtitan's apply_ac",
    "activation_checkpoint.memory_budget": "torchtitan's apply_ac (mode memory_budget only)",
    "compile.enable": "false: the eager step (enable = true is refused: not traced yet)",
    "compile.components": "not used while compile is off",
    "quantize.linear.float8.recipe_name": "--precision {precision}",
    "quantize.linear.float8.enable_fsdp_float8_all_gather": "false: FSDP2 gathers bf16 weights",
    "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp": "not traced (one scale per weight)",
    "quantize.linear.float8.filter_fqns": "not traced: batchfit's float8 filter (train/float8.py) skips the "
                                          "output head and layers torchao cannot cast, as filter_fqns=['output'] does",
}


def _mapping(job: TitanJob) -> list[tuple[str, str]]:
    values = {"model": job.model, "flavor": job.flavor, "precision": job.precision, "compile": job.compile}
    rows = []
    for key, _ in _flat(job.data):
        section = key.split(".")[0]
        if key in _USED:
            rows.append((key, _USED[key].format(**values)))
        elif key in _UNUSED_KEYS:
            rows.append((key, "not used: " + _UNUSED_KEYS[key]))
        elif section in _UNUSED_SECTIONS:
            rows.append((key, "not used: " + _UNUSED_SECTIONS[section]))
        else:
            rows.append((key, "not used: batchfit does not read it (no effect it models)"))
    return rows
