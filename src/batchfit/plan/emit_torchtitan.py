"""``--emit torchtitan:FILE``: the recommended plan as a torchtitan job config (.toml).

What is written: ``[parallelism]`` (the degrees of the recommended strategy; under pp<N> the
schedule as torchtitan names it, the micro-batch size, and an equal split of the layers, as
traced: ``pipeline_parallel_first_stage_less_layers`` / ``..._last_stage_less_layers`` 0, and
``pipeline_parallel_layers_per_stage`` where the stages per rank are not torchtitan's default,
1 for GPipe / 1F1B, 2 otherwise), ``[training]``
``local_batch_size`` (the micro-batch) and ``global_batch_size`` (micro-batch x accumulation x
data-parallel ranks: torchtitan derives its accumulation steps from it), and, when the plan's
options set them, ``[activation_checkpoint]``, ``[compile]`` and float8 (``[model] converters``,
``[quantize.linear.float8] recipe_name``). Keys as torchtitan 0.2.2's ``job_config.py`` names them.

When the plan started from a torchtitan toml (``torchtitan:job.toml``), that file is patched: each
key whose value changes is rewritten in place (its comment kept), a missing key is added at the end
of its section, a missing section at the end of the file; every other byte stays. Pure Python, no
torch: a PlanResult in, text out.
"""

from __future__ import annotations

import re

import tomllib

from batchfit.distributed.parallelisms import degree_of, registered
from batchfit.errors import OptionError


def degrees(layout) -> dict[str, object]:
    """torchtitan's [parallelism] keys for a strategy's degrees (a ``Strategy`` or a ``StrategyPlan``:
    dp, tp, pp, cp, ep, shard, replicas): fsdp+tp2 on 8 -> shard 4, tp 2; hsdp2 on 8 -> replicate 2,
    shard 4; pp2+fsdp -> pipeline 2."""
    if layout.shard in ("zero1", "zero2"):  # ZeroRedundancyOptimizer, which torchtitan has no setting for
        name = getattr(layout, "strategy", None) or layout.name  # a StrategyPlan's name, or a Strategy's
        raise OptionError(f"`emit` torchtitan: the recommended {name} has no torchtitan equivalent (torchtitan shards "
                          "with FSDP2): plan with `strategies` fsdp,hsdp<R>,fsdp+tp<N>")
    replicate = layout.replicas if layout.shard == "hsdp" else layout.dp if layout.shard == "ddp" else 1
    out: dict[str, object] = {"data_parallel_replicate_degree": replicate,
                              "data_parallel_shard_degree": layout.dp // replicate}
    for parallelism in (p for p in registered() if p.torchtitan_key):  # each degree's key (distributed/parallelisms.py)
        degree = degree_of(layout, parallelism.key)
        if degree > 1 or parallelism.torchtitan_at_1:
            out[parallelism.torchtitan_key] = degree
    if layout.shard == "fsdp-noreshard":
        out["fsdp_reshard_after_forward"] = "never"
    # torchtitan's "default" keeps them gathered under pp; batchfit traced resharding
    elif layout.shard == "fsdp" and layout.pp > 1:
        out["fsdp_reshard_after_forward"] = "always"
    return out


def pipeline_values(p) -> dict[str, object]:
    """torchtitan's [parallelism] pipeline keys for a pp<N> StrategyPlan ``p``: the schedule, the
    micro-batch size (torchtitan splits local_batch_size into micro-batches of it) and the split."""
    from batchfit.distributed.pp_schedules import parse_schedule

    schedule = parse_schedule(p.pp_schedule, p.microbatches)
    out: dict[str, object] = {"pipeline_parallel_schedule": schedule.torchtitan_name,
                              "pipeline_parallel_microbatch_size": p.micro_batch // p.microbatches,
                              "pipeline_parallel_first_stage_less_layers": 0,
                              "pipeline_parallel_last_stage_less_layers": 0}
    default_v = 1 if schedule.kind in ("gpipe", "1f1b") else 2  # pipeline_llm's stages_per_rank
    if schedule.virtual != default_v:
        out["pipeline_parallel_layers_per_stage"] = p.pp_layers_per_stage
    return out


def job_values(p, options) -> dict[str, dict[str, object]]:
    """{section: {key: value}} of the plan ``p`` (a StrategyPlan) with the plan's ``options``."""
    values: dict[str, dict[str, object]] = {
        "parallelism": {**degrees(p), **(pipeline_values(p) if p.pp > 1 else {})},
        "training": {"local_batch_size": p.micro_batch, "global_batch_size": p.global_batch},
    }
    checkpointing = options.checkpointing_spec
    if checkpointing.kind == "full":
        values["activation_checkpoint"] = {"mode": "full"}
    elif checkpointing.kind == "every":  # torchtitan's layer SAC: every N-th block recomputed
        values["activation_checkpoint"] = {"mode": "selective", "selective_ac_option": str(checkpointing.every)}
    elif checkpointing.kind == "selective":
        values["activation_checkpoint"] = {"mode": "selective", "selective_ac_option": "op"}
    if options.compile != "none":
        values["compile"] = {"enable": True}
    if options.precision_spec.fp8_recipe:
        values["model"] = {"converters": ["float8"]}
        values["quantize.linear.float8"] = {"recipe_name": options.precision_spec.fp8_recipe}
    elif options.precision in ("bf16-mixed", "fp32"):
        values["training"]["mixed_precision_param"] = "bfloat16" if options.precision == "bf16-mixed" else "float32"
    return values


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


_HEADER = re.compile(r"^\s*\[([A-Za-z0-9_.\- \"]+)\]\s*(#.*)?$")
_KEY = re.compile(r"^(\s*)([A-Za-z0-9_\-]+)(\s*=\s*)(.*)$")


def _value_end(rest: str) -> int:
    """Where the value on ``key = <rest>`` ends (the comment after it kept): the longest prefix
    that TOML reads as one value with only a comment or blanks after it."""
    for end in range(len(rest), 0, -1):
        if re.fullmatch(r"\s*(#.*)?", rest[end:]) is None:
            continue
        try:
            tomllib.loads("x = " + rest[:end])
        except tomllib.TOMLDecodeError:
            continue
        return end
    return len(rest)


def patch_toml(text: str, values: dict[str, dict[str, object]]) -> str:
    """``text`` (a TOML file) with ``values`` ({section: {key: value}}) set, every other byte kept."""
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    current = tomllib.loads(text)
    for section, keys in values.items():
        have = current
        for part in section.split("."):
            have = have.get(part, {}) if isinstance(have, dict) else {}
        keys = {k: v for k, v in keys.items() if have.get(k) != v}
        if not keys:
            continue
        start = next((i for i, line in enumerate(lines)
                      if (m := _HEADER.match(line)) and m.group(1).strip().replace('"', "") == section), None)
        if start is None:
            lines += ["\n", f"[{section}]\n"] + [f"{k} = {_toml(v)}\n" for k, v in keys.items()]
            continue
        end = next((i for i in range(start + 1, len(lines)) if _HEADER.match(lines[i])), len(lines))
        last_key = start
        for i in range(start + 1, end):
            m = _KEY.match(lines[i])
            if m is None:
                continue
            last_key = i
            if m.group(2) in keys:
                rest = m.group(4).rstrip("\n")
                cut = _value_end(rest)
                newline = "\n" if lines[i].endswith("\n") else ""
                lines[i] = m.group(1) + m.group(2) + m.group(3) + _toml(keys.pop(m.group(2))) + rest[cut:] + newline
        lines[last_key + 1:last_key + 1] = [f"{k} = {_toml(v)}\n" for k, v in keys.items()]
    out = "".join(lines)
    tomllib.loads(out)  # still TOML (a bug here must not write a file torchtitan cannot read)
    return out


DEFAULTS = {"parallelism": {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": -1,
                            "tensor_parallel_degree": 1, "pipeline_parallel_degree": 1, "context_parallel_degree": 1,
                            "expert_parallel_degree": 1, "fsdp_reshard_after_forward": "default",
                            "pipeline_parallel_schedule": "1F1B", "pipeline_parallel_microbatch_size": 1,
                            "pipeline_parallel_first_stage_less_layers": 1,
                            "pipeline_parallel_last_stage_less_layers": 1},
            "training": {"local_batch_size": 8, "global_batch_size": -1, "mixed_precision_param": "bfloat16"},
            "activation_checkpoint": {"mode": "selective", "selective_ac_option": "2"},
            "compile": {"enable": False}, "model": {"converters": []},
            "quantize.linear.float8": {"recipe_name": None}}
"""torchtitan 0.2.2's defaults of the keys written here (job_config.py): a key the file leaves out
and whose default already is the plan's value is not added."""


def _unchanged(values: dict, source: dict) -> dict:
    """``values`` less what ``source`` (the toml read) already says, its defaults included; a shard
    degree of -1 ("the GPUs left over") stays when it comes to the plan's."""
    out = {}
    for section, keys in values.items():
        have = source
        for part in section.split("."):
            have = have.get(part, {}) if isinstance(have, dict) else {}
        defaults = DEFAULTS.get(section, {})
        kept = {k: v for k, v in keys.items() if have.get(k, defaults.get(k, object())) != v}
        if section == "parallelism" and have.get("data_parallel_shard_degree", -1) == -1:
            kept.pop("data_parallel_shard_degree", None)  # the other degrees are written: -1 resolves to it
        if kept:
            out[section] = kept
    return out


def torchtitan_toml(result, source_text: str | None = None) -> str:
    """The recommended plan (on the largest GPU count) as a torchtitan job toml: ``source_text``
    patched, or a new file with the sections batchfit sets."""
    if not result.recommended:
        raise OptionError("no strategy fits, so there is nothing to emit: see the report's 'what would make it fit'")
    p = result.recommended[-1]
    values = job_values(p, result.options)
    if source_text is not None:
        source = tomllib.loads(source_text)
        if p.accumulation_steps == 1 and source.get("training", {}).get("global_batch_size", -1) == -1:
            del values["training"]["global_batch_size"]  # -1 (local x data-parallel ranks) already says it
        return patch_toml(source_text, _unchanged(values, source))
    head = (f"# batchfit plan: {result.workload} on {p.gpus} x {result.device.display_name}, {p.strategy}: "
            f"micro-batch {p.micro_batch} x {p.accumulation_steps} accumulation.\n"
            "# torchtitan 0.2.2 job config keys; merge into your job's toml (memory traced, not measured).\n")
    return head + patch_toml("", values).lstrip("\n")
