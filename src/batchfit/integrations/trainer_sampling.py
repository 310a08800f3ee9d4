"""A TRL GRPOConfig's sampling settings, as its GRPOTrainer hands them to transformers' ``generate``: the
GenerationConfig it builds from temperature, top_p, top_k, min_p and repetition_penalty, updated with
generation_kwargs (trl/trainer/grpo_trainer.py, ``GenerationConfig(**generation_kwargs)``). Each setting that adds a
logits processor becomes ``Rollout.sampling`` (traced in ``zoo/hf_sampling.py``). Pure: no torch."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from batchfit.errors import OptionError
from batchfit.options import SAMPLING_SETTINGS, adds_logits_processor

TRL_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""The GRPOConfig fields TRL passes to GenerationConfig itself (with its defaults 1, 1, 0, None, 1: no processor)."""


@dataclass
class Sampling:
    settings: tuple[tuple[str, float], ...] = ()
    """The settings that add a logits processor, in SAMPLING_SETTINGS' order."""
    from_fields: list[str] = field(default_factory=list)
    """The GRPOConfig fields among them (each shown as used)."""
    from_kwargs: list[str] = field(default_factory=list)
    """The generation_kwargs keys among them."""
    kwargs_not_read: list[str] = field(default_factory=list)
    """generation_kwargs keys that are not sampling settings batchfit traces."""


def generation_kwargs(data: Mapping) -> dict:
    """GRPOConfig's generation_kwargs: a dict, its JSON text (TRL takes either), or none."""
    value = data.get("generation_kwargs")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = None
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise OptionError(f"generation_kwargs must be a dict of GenerationConfig settings, got {value!r}")
    return dict(value)


MULTIPLYING = ("num_beams", "num_return_sequences")
"""generation_kwargs that multiply what generate holds per completion (beams, or several sequences per prompt on
top of TRL's num_generations): refused, since the trace generates one sequence per row."""

INTEGER_SETTINGS = ("top_k", "min_length", "min_new_tokens")
"""The sampling settings transformers' processors take as integers; the others are floats."""

VALID = {"temperature": (lambda v: v > 0, "> 0 (1.0, TRL's default, samples unchanged; TRL always samples)"),
         "top_k": (lambda v: v > 0, "> 0 (0 or null: no top-k)"),
         "top_p": (lambda v: 0 <= v <= 1, "in [0, 1] (1.0: no top-p)"),
         "min_p": (lambda v: 0 <= v <= 1, "in [0, 1] (null: no min-p)"),
         "repetition_penalty": (lambda v: v > 0, "> 0 (1.0: no penalty)"),
         "typical_p": (lambda v: 0 < v <= 1, "in (0, 1] (1.0: no typical-p)"),
         "min_length": (lambda v: v >= 0, ">= 0"),
         "min_new_tokens": (lambda v: v >= 0, ">= 0")}
"""What each setting's processor accepts where generate adds it (transformers 5's constructors raise otherwise, in
the middle of the traced step); epsilon_cutoff and eta_cutoff add one only inside (0, 1), so none is refused."""


def checked(name: str, value: object) -> int | float:
    """``value`` of the sampling setting ``name`` as its processor takes it (a JSON 2 for a float setting is 2.0,
    a 50.0 for top_k is 50), or one line saying what to give instead: refused before any trace, not as the traced
    step's failure."""
    whole = isinstance(value, float) and value.is_integer()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (name in INTEGER_SETTINGS and
                                                                          isinstance(value, float) and not whole):
        kind = "an integer" if name in INTEGER_SETTINGS else "a number"
        raise OptionError(f"the trainer args' sampling setting {name}={value!r} is not {kind}: give {kind} "
                          f"{VALID[name][1] if name in VALID else ''}".rstrip())
    typed = int(value) if name in INTEGER_SETTINGS else float(value)
    rule = VALID.get(name)
    if rule and adds_logits_processor(name, typed) and not rule[0](typed):
        raise OptionError(f"the trainer args' sampling setting {name}={value!r} would make transformers' generate "
                          f"refuse: give {name} {rule[1]}")
    return typed


def sampling(data: Mapping) -> Sampling:
    """The settings of ``data`` (a GRPOConfig as a dict) that add a logits processor to generation (null: unset)."""
    extra = generation_kwargs(data)
    for name in MULTIPLYING:
        if isinstance(extra.get(name), (int, float)) and not isinstance(extra[name], bool) and extra[name] > 1:
            raise OptionError(f"generation_kwargs {name}={extra[name]!r} is not traced: generate would hold "
                              f"{extra[name]} sequences (each with its cache) per completion, where the trace holds "
                              f"one, a figure too low; drop {name}")
    merged = {name: data[name] for name in TRL_SAMPLING_FIELDS if name in data}
    merged.update({name: value for name, value in extra.items() if name in SAMPLING_SETTINGS})
    typed = {name: checked(name, value) for name, value in merged.items() if value is not None}
    active = {name: value for name, value in typed.items() if adds_logits_processor(name, value)}
    return Sampling(settings=tuple((name, active[name]) for name in SAMPLING_SETTINGS if name in active),
                    from_fields=[n for n in TRL_SAMPLING_FIELDS if n in active and n not in extra],
                    from_kwargs=[n for n in extra if n in active],
                    kwargs_not_read=[n for n in extra if n not in SAMPLING_SETTINGS])
