"""The exceptions batchfit raises, as a tree.

    BatchfitError                 anything batchfit reports as one line (exit code 1)
    ├── UsageError                the user typed something we cannot use (exit code 2)
    │   ├── ModelSpecError        MODEL is not a zoo name, hf:<name|config.json>, or file.py:fn
    │   ├── UnknownGPUError       --gpu is not in the catalog (a close match is suggested)
    │   ├── SizeError             '48GiB' style sizes that do not parse
    │   └── OptionError           a value out of range or options that contradict each other
    └── TraceError                the training step cannot run on fake tensors (names the op)

Every message says what to type instead; the CLI prints it on one line.

Fields, not flags: a message names a setting as the field a library user passes (the keyword of
estimate, plan, StepOptions, resolve_target ...) in backticks, the value after it where it helps:
    "`seq_len` 9000 is longer than gpt2 allows (1024)", "use `checkpointing` full",
    or as one Python keyword: "use `checkpointing='full'`".
The CLI writes each backticked field as its flag when it prints the error (cli/flags.py, one
table): "--seq-len 9000 ...", "use --checkpointing full". A whole command line a message quotes
("`batchfit gpus`", "torchrun --nproc-per-node 2 ...") keeps its flags; tests/test_layout.py checks
that no other library error names a flag.
"""

from __future__ import annotations

from pathlib import Path


class BatchfitError(Exception):
    """Base class: a problem batchfit can explain in one line."""

    exit_code = 1


class UsageError(BatchfitError):
    """Bad input from the user: the message says what to type instead."""

    exit_code = 2


class ModelSpecError(UsageError):
    """MODEL could not be resolved to a Workload."""


class UnknownGPUError(UsageError):
    """The GPU name is not in the catalog."""


class SizeError(UsageError):
    """A memory size such as '48GiB' could not be parsed."""


class OptionError(UsageError):
    """An option value is out of range, or two options contradict each other."""


class TraceError(BatchfitError):
    """The training step could not run on fake tensors."""


def read_text(path: Path | str, what: str, error: type[UsageError] = OptionError) -> str:
    """The text of a file the user named (JSON, TOML, .jsonl: UTF-8 by their specifications),
    decoded as UTF-8; a file in another encoding is ``error``, one line that says where (as the
    user gave ``what``, e.g. '`trainer` args.json') and what to do, not a UnicodeDecodeError."""
    raw = Path(path).read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as bad:
        line = raw.count(b"\n", 0, bad.start) + 1
        raise error(f"{what} is not UTF-8 text (byte 0x{raw[bad.start]:02x} on line {line}): save it as UTF-8 "
                    "(e.g. iconv -f latin1 -t utf-8, if it is Latin-1)") from None
