"""The caching allocator's settings, read as PyTorch reads ``PYTORCH_ALLOC_CONF``.

A copy of the parser in ``c10/core/AllocatorConfig.cpp`` and ``c10/cuda/CUDAAllocatorConfig.cpp``
for the keys that change reserved memory, with the same bounds and the same refusals, each
turned into a message that says what to write instead. Pure Python, no torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from batchfit.errors import OptionError

LARGE_BUFFER = 20 << 20         # kLargeBuffer: 20 MiB segment, and large expandable page
MiB = 1 << 20
ROUNDUP_INTERVALS = 16          # kRoundUpPowerOfTwoIntervals: 1 MiB .. 64 GiB, one per power of two

_BACKENDS = ("native", "cudaMallocAsync")
# Keys the real parsers accept that do not change device memory (pinned host memory, locking).
_IGNORED_KEYS = frozenset({
    "release_lock_on_cudamalloc", "release_lock_on_hipmalloc", "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register", "pinned_num_register_threads", "pinned_reserve_segment_size_mb",
    "pinned_use_background_threads", "graph_capture_record_stream_reuse",
})
_KEYS = ("max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold",
         "roundup_power2_divisions", "expandable_segments", "backend")
# Newest first: c10/core/AllocatorConfig.cpp reads the first one that is set, and only it.
ENV_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


def _is_power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(kw_only=True, frozen=True)
class AllocatorConfig:
    """The caching allocator's settings, as ``PYTORCH_ALLOC_CONF`` sets them."""

    max_split_size_bytes: int | None = None
    """Cached blocks this large or larger are never split (max_split_size_mb); None: no limit."""
    max_non_split_rounding_bytes: int = LARGE_BUFFER
    """How much larger than a request of max_split_size or more a cached block may be (max_non_split_rounding_mb)."""
    expandable_segments: bool = False
    """One growing segment per pool instead of one cudaMalloc per new segment."""
    garbage_collection_threshold: float = 0.0
    """Above this fraction of set_per_process_memory_fraction's limit, free old cached segments; 0: never."""
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
    """Steps between two powers of two that requests round up to, per interval 1 MiB, 2 MiB, .. >= 32 GiB; 0/1: none."""
    backend: str = "native"
    """'native' (this model) or 'cudaMallocAsync' (not modelled: reserved memory is the driver's)."""

    def __post_init__(self) -> None:
        if self.max_split_size_bytes is not None and self.max_split_size_bytes < LARGE_BUFFER:
            raise OptionError(f"max_split_size_mb must be >= {LARGE_BUFFER // MiB}, e.g. max_split_size_mb:128")
        if self.max_non_split_rounding_bytes < LARGE_BUFFER:
            raise OptionError(f"max_non_split_rounding_mb must be >= {LARGE_BUFFER // MiB}, "
                              "e.g. max_non_split_rounding_mb:64")
        if self.garbage_collection_threshold != 0.0 and not 0.0 < self.garbage_collection_threshold < 1.0:
            raise OptionError("garbage_collection_threshold must be between 0 and 1 (exclusive), "
                              "e.g. garbage_collection_threshold:0.6")
        divisions = self.roundup_power2_divisions
        if len(divisions) != ROUNDUP_INTERVALS or any(d != 0 and not _is_power_of_2(d) for d in divisions):
            raise OptionError("roundup_power2_divisions takes powers of two (or 0), e.g. "
                              "roundup_power2_divisions:4 or roundup_power2_divisions:[256:1,512:2,>:4]")
        if self.backend not in _BACKENDS:
            raise OptionError(f"backend must be native or cudaMallocAsync, not {self.backend!r}, e.g. backend:native")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> AllocatorConfig:
        """The settings the user's training run would get: the first of ``ENV_VARS`` that is set.

        PyTorch with ``c10/core/AllocatorConfig.cpp`` reads PYTORCH_ALLOC_CONF and ignores
        PYTORCH_CUDA_ALLOC_CONF (deprecated) when both are set; older versions read only
        PYTORCH_CUDA_ALLOC_CONF, so a user of those who sets both gets the other one.
        """
        for name in ENV_VARS:
            text = environ.get(name)
            if text is not None:
                return parse_alloc_conf(text, source=name)
        return cls()


def _tokens(text: str) -> list[str]:
    """ConfigTokenizer: split on , : [ ] (kept as tokens), drop whitespace."""
    tokens: list[str] = []
    word = ""
    for ch in text:
        if ch in ",:[]":
            if word:
                tokens.append(word)
                word = ""
            tokens.append(ch)
        elif not ch.isspace():
            word += ch
    if word:
        tokens.append(word)
    return tokens


def parse_alloc_conf(text: str, *, source: str = "PYTORCH_ALLOC_CONF") -> AllocatorConfig:
    """Read ``max_split_size_mb:128,expandable_segments:True,...`` as PyTorch does.

    Bad input raises ``OptionError`` naming the key and an example of what to write.
    """
    tokens = _tokens(text)
    settings: dict[str, object] = {}

    def token(i: int, what: str) -> str:
        if i >= len(tokens):
            raise OptionError(f"{source} ends early: expected {what}, e.g. max_split_size_mb:128")
        return tokens[i]

    def colon(i: int, key: str) -> None:
        if token(i, f"':' after {key}") != ":":
            raise OptionError(f"{source}: expected ':' after {key}, e.g. {key}:{_EXAMPLES.get(key, 'True')}")

    def integer(word: str, key: str) -> int:
        try:
            return int(word)
        except ValueError:
            raise OptionError(f"{key} takes a whole number, not {word!r}, e.g. {key}:{_EXAMPLES[key]}") from None

    i = 0
    while i < len(tokens):
        key = tokens[i]
        if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            colon(i + 1, key)
            mb = integer(token(i + 2, f"a value for {key}"), key)
            if mb < LARGE_BUFFER // MiB:
                raise OptionError(f"{key} must be >= {LARGE_BUFFER // MiB}, e.g. {key}:{_EXAMPLES[key]}")
            name = "max_split_size_bytes" if key == "max_split_size_mb" else "max_non_split_rounding_bytes"
            settings[name] = mb * MiB
            i += 2
        elif key == "garbage_collection_threshold":
            colon(i + 1, key)
            word = token(i + 2, f"a value for {key}")
            try:
                value = float(word)
            except ValueError:
                value = -1.0
            if not 0.0 < value < 1.0:
                raise OptionError(f"{key} must be between 0 and 1 (exclusive), not {word!r}, "
                                  f"e.g. {key}:{_EXAMPLES[key]}")
            settings["garbage_collection_threshold"] = value
            i += 2
        elif key == "roundup_power2_divisions":
            colon(i + 1, key)
            settings["roundup_power2_divisions"], i = _parse_divisions(tokens, i + 2, token, integer)
        elif key == "expandable_segments":
            colon(i + 1, key)
            word = token(i + 2, f"True or False for {key}")
            if word not in ("True", "False"):  # ConfigTokenizer::toBool: exactly these two
                raise OptionError(f"{key} takes True or False (capitalised), not {word!r}, "
                                  f"e.g. {key}:True")
            settings["expandable_segments"] = word == "True"
            i += 2
        elif key == "backend":
            colon(i + 1, key)
            word = token(i + 2, f"a value for {key}")
            if word not in _BACKENDS:
                raise OptionError(f"backend must be native or cudaMallocAsync, not {word!r}, e.g. backend:native")
            settings["backend"] = word
            i += 2
        elif key in _IGNORED_KEYS:
            colon(i + 1, key)
            i += 2
            if token(i, f"a value for {key}") == "[":
                while token(i, "']'") != "]":
                    i += 1
        else:
            raise OptionError(f"unknown key {key!r} in {source}={text!r}; the allocator reads "
                              + ", ".join(_KEYS) + ", e.g. expandable_segments:True")
        i += 1
        if i < len(tokens):
            if tokens[i] != ",":
                raise OptionError(f"{source}: expected ',' between settings, not {tokens[i]!r}, "
                                  "e.g. max_split_size_mb:128,expandable_segments:True")
            i += 1
    return AllocatorConfig(**settings)  # type: ignore[arg-type]


_EXAMPLES = {"max_split_size_mb": "128", "max_non_split_rounding_mb": "64",
             "garbage_collection_threshold": "0.6", "roundup_power2_divisions": "[256:1,512:2,>:4]",
             "expandable_segments": "True", "backend": "native"}


def _parse_divisions(tokens: list[str], i: int, token: Callable[[int, str], str],
                     integer: Callable[[str, str], int]) -> tuple[tuple[int, ...], int]:
    """AcceleratorAllocatorConfig::parseRoundUpPower2Divisions; returns (divisions, last index used)."""
    key = "roundup_power2_divisions"
    bad = OptionError(f"{key} takes powers of two (or 0 to switch an interval off), "
                      f"e.g. {key}:4 or {key}:[256:1,512:2,>:4]")
    first = token(i, f"a value for {key}")
    if first != "[":  # one number for every interval
        value = integer(first, key)
        if not _is_power_of_2(value):
            raise bad
        return (value,) * ROUNDUP_INTERVALS, i
    divisions = [0] * ROUNDUP_INTERVALS
    first_value, last_index = True, 0
    i += 1
    while token(i, "']'") != "]":
        bound = tokens[i]
        if token(i + 1, "':'") != ":":
            raise bad
        value = integer(token(i + 2, "a number of divisions"), key)
        if value != 0 and not _is_power_of_2(value):
            raise bad
        if bound == ">":  # every interval after the last one named
            divisions[last_index + 1:] = [value] * (ROUNDUP_INTERVALS - last_index - 1)
        else:
            mb = integer(bound, key)
            if not _is_power_of_2(mb):
                raise OptionError(f"{key}: interval bounds are powers of two in MB, not {bound!r}, "
                                  f"e.g. {key}:[256:1,512:2,>:4]")
            index = min(mb.bit_length() - 1, ROUNDUP_INTERVALS - 1)
            if first_value:  # the first bound also covers every smaller interval
                divisions[:index] = [value] * index
                first_value = False
            divisions[index] = value
            last_index = index
        i += 3
        if token(i, "']'") == ",":
            i += 1
    return tuple(divisions), i
