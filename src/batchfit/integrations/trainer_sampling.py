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


def sampling(data: Mapping) -> Sampling:
    """The settings of ``data`` (a GRPOConfig as a dict) that add a logits processor to generation."""
    extra = generation_kwargs(data)
    merged = {name: data[name] for name in TRL_SAMPLING_FIELDS if name in data}
    merged.update({name: value for name, value in extra.items() if name in SAMPLING_SETTINGS})
    active = {name: value for name, value in merged.items() if isinstance(value, (int, float))
              and not isinstance(value, bool) and adds_logits_processor(name, value)}
    return Sampling(settings=tuple((name, active[name]) for name in SAMPLING_SETTINGS if name in active),
                    from_fields=[n for n in TRL_SAMPLING_FIELDS if n in active and n not in extra],
                    from_kwargs=[n for n in extra if n in active],
                    kwargs_not_read=[n for n in extra if n not in SAMPLING_SETTINGS])
