"""Exact budgets, the learning-rate schedule in tokens, and the learning rate per batch size.

Seed 002 trained "about 327.68M tokens" per batch size, but its step counts (25,701 at batch
1, 126 at batch 256) do not multiply back to one budget, and its warmup was "1%" at some
sizes and a fixed 100 steps at others. Here every run consumes exactly the budget, and the
warmup and the cosine decay are functions of tokens seen, so batch 8 and batch 256 follow
the same learning-rate curve against tokens, each sampling it at its own steps.

A budget that is not a whole number of steps at some batch size is refused (never rounded),
with the nearest budgets that are.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from batchfit.errors import OptionError
from batchfit.search import largest_micro_batch

_SUFFIX = {"": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "B": 10**9, "T": 10**12}
LR_SCALINGS: tuple[str, ...] = ("none", "linear", "sqrt")
MAX_COUNT = 2**53
"""The largest count read: past it a count read through a float is no longer exact, and far past
it (1e99) it overflows the store's 64-bit integers. 9e15 tokens: 600 times Llama 3's 15T."""


def parse_count(text: str, option: str) -> int:
    """'327.68M' -> 327_680_000; '200000', '200k', '2e5' -> 200_000 (decimal suffixes)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([kKMGBT]?)\s*", str(text))
    if not match:
        raise OptionError(f"cannot read {option} '{text}': give a count such as 327.68M, 50M, 200k or 200000")
    value = float(match.group(1)) * _SUFFIX[match.group(2)]
    if not value <= MAX_COUNT:  # inf too: runs and steps are stored as SQLite's 64-bit integers
        raise OptionError(f"{option} '{text}' is too large: at most {MAX_COUNT:,} (2^53, a count a float holds "
                          "exactly), e.g. 327.68M or 15T")
    if abs(value - round(value)) > 1e-6 * max(1.0, value):
        raise OptionError(f"{option} '{text}' is not a whole number: e.g. {round(value)}")
    return round(value)


def parse_amount(text: str, total: int, option: str) -> int:
    """A part of the budget: '1%' or '0.01' (a fraction) or '2M' (a count), as a count."""
    text = str(text).strip()
    if text.endswith("%"):
        try:
            fraction = float(text[:-1]) / 100
        except ValueError:
            raise OptionError(f"cannot read {option} '{text}': e.g. 1% or 0.01 or 2M") from None
    elif re.fullmatch(r"0?\.[0-9]+|0|1\.0*|0\.0*", text):
        fraction = float(text)
    else:
        return parse_count(text, option)
    if not 0 <= fraction <= 1:
        raise OptionError(f"{option} {text} must be between 0% and 100% of the budget")
    return round(fraction * total)


@dataclass(frozen=True, kw_only=True)
class Budget:
    """What every run consumes: ``total`` tokens (or samples), exactly."""

    unit: str
    """'tokens' or 'samples'."""
    total: int
    tokens_per_sample: int | None
    """Sequence length; needed when the budget is in tokens."""

    def __post_init__(self) -> None:
        if self.unit not in ("tokens", "samples"):
            raise OptionError(f"a budget is in tokens or samples, not {self.unit}")
        if self.total < 1:
            raise OptionError(f"`{self.unit}` must be 1 or more, e.g. `{self.unit}` 50M")
        if self.unit == "tokens" and not self.tokens_per_sample:
            raise OptionError("`tokens` needs a model with a sequence length: give `samples` instead")

    @property
    def per_sample(self) -> int:
        """Budget units in one sample: its tokens, or 1."""
        return self.tokens_per_sample if self.unit == "tokens" else 1

    def check_data(self, available_samples: int, seq_len: int) -> None:
        """Refuse a budget that the train split (``available_samples`` samples of ``seq_len`` tokens)
        holds only by repeating it: sweep and recommend refuse it alike, in the same words."""
        needed = self.total // self.per_sample
        if available_samples < needed:
            times = f"{needed / available_samples:,.1f} times" if available_samples else "more than once"
            raise OptionError(f"data too short for the budget: the train split holds {available_samples:,} samples "
                              f"of {seq_len} tokens, the budget needs {needed:,} ({self.total:,} {self.unit}) "
                              f"without repeating data (it would read the data {times}); give more text or a "
                              "smaller budget")

    def per_step(self, batch_size: int) -> int:
        return batch_size * self.per_sample

    def steps(self, batch_size: int) -> int:
        """Optimizer steps at ``batch_size``: budget / (batch x seq), refused unless exact."""
        per_step = self.per_step(batch_size)
        if per_step > self.total:
            raise OptionError(
                f"batch size {batch_size} is above the budget: one step takes {per_step:,} {self.unit}, "
                f"the budget is {self.total:,}; raise `{self.unit}` to at least {per_step:,} or drop that batch size")
        if self.total % per_step:
            return self.check([batch_size])[batch_size]  # raises, naming the nearest exact budgets
        return self.total // per_step

    def check(self, batch_sizes: list[int]) -> dict[int, int]:
        """Steps per batch size, or one error naming a budget that divides at all of them."""
        lcm = math.lcm(*(self.per_step(b) for b in batch_sizes))
        for b in sorted(batch_sizes):
            per_step = self.per_step(b)
            if per_step <= self.total and self.total % per_step:
                lower, upper = self.total // lcm * lcm, (self.total // lcm + 1) * lcm
                nearest = f"{lower:,} or {upper:,}" if lower else f"{upper:,}"
                raise OptionError(
                    f"`{self.unit}` {self.total:,} is not a whole number of steps at batch size {b} "
                    f"({per_step:,} {self.unit} per step): budgets exact at every batch size are multiples of "
                    f"{lcm:,}, e.g. `{self.unit}` {nearest.replace(',', '')}")
        return {b: self.steps(b) for b in batch_sizes}

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """Linear warmup then cosine decay to ``min_lr_ratio``, as functions of budget consumed."""

    total: int
    warmup: int
    """Warmup length in the budget's unit (tokens or samples)."""
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        if not 0 <= self.warmup <= self.total:
            raise OptionError(f"`warmup` must be within the budget (0 to {self.total:,}), got {self.warmup:,}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise OptionError(f"`min_lr_ratio` must be between 0 and 1, e.g. 0.1; got {self.min_lr_ratio}")

    def factor(self, consumed: int) -> float:
        """The learning rate over its peak once ``consumed`` units have been trained on
        (a step's rate is read at the end of that step, so the first step never has rate 0)."""
        if self.warmup and consumed <= self.warmup:
            return consumed / self.warmup
        if self.total == self.warmup:
            return 1.0
        progress = min(1.0, (consumed - self.warmup) / (self.total - self.warmup))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def to_json(self) -> dict:
        return asdict(self)


def time_left(elapsed_s: float, done: float, total: float) -> str:
    """'ETA 3 min 20 s': the time the rest of ``total`` takes at the rate ``done`` went in ``elapsed_s``
    ('' before anything is done: no rate yet, and after the end)."""
    if done <= 0 or done >= total or elapsed_s <= 0:
        return ""
    seconds = round(elapsed_s / done * (total - done))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    if hours:
        return f"ETA {hours} h {minutes} min"
    return f"ETA {minutes} min {seconds} s" if minutes else f"ETA {seconds} s"


def scaled_lr(base_lr: float, batch_size: int, scaling: str, ref_batch: int) -> float:
    """``base_lr`` is right at ``ref_batch``; linear: x (b/ref), sqrt: x sqrt(b/ref), none: as is."""
    if scaling not in LR_SCALINGS:
        raise OptionError(f"unknown `lr_scaling` '{scaling}': use none, linear or sqrt")
    ratio = batch_size / ref_batch
    return base_lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[scaling]


def parse_lrs(text: str | None) -> list[float] | None:
    """'1e-4,3e-4,1e-3' -> [1e-4, 3e-4, 1e-3]."""
    if text is None:
        return None
    try:
        lrs = [float(s) for s in text.split(",")]
    except ValueError:
        raise OptionError(f"cannot read `lrs` '{text}': give learning rates separated by commas, "
                          "e.g. 1e-4,3e-4,1e-3") from None
    if not lrs or min(lrs) <= 0 or any(math.isnan(x) or math.isinf(x) for x in lrs):
        raise OptionError(f"`lrs` must all be positive, e.g. 1e-4,3e-4,1e-3; got '{text}'")
    return sorted(set(lrs))


def micro_batch_for(batch_size: int, fits: int | None) -> int:
    """The largest divisor of ``batch_size`` that is at most ``fits`` (equal micro-batches,
    so each sample weighs the same); ``batch_size`` when there is no limit; 0 when not even
    one sample fits."""
    return batch_size if fits is None else largest_micro_batch(batch_size, fits) or 0
