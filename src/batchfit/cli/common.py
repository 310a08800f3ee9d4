"""What every command shares: error handling, option parsing, the target device."""

from __future__ import annotations

import functools
import os
import re
import sys
from collections.abc import Callable

import typer
from rich.console import Console

from batchfit.devices import CATALOG, Device, custom_device, detect_cuda_device, get_device, parse_size
from batchfit.errors import BatchfitError, OptionError

err = Console(stderr=True)
out = Console()
DEFAULT_GPU = "h100-80gb"


def handle_errors(command: Callable) -> Callable:
    """Known errors become one line and a hint, with exit code 2 (bad input) or 1."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except BatchfitError as error:
            if os.environ.get("BATCHFIT_DEBUG"):
                raise
            err.print(f"[bold red]error:[/] {error}", highlight=False, soft_wrap=True)
            err.print("[dim]set BATCHFIT_DEBUG=1 for a traceback[/]")
            raise typer.Exit(error.exit_code) from None

    return wrapper


def parse_batch_sizes(text: str | None) -> list[int] | None:
    """'8,16,32' -> [8, 16, 32]."""
    if text is None:
        return None
    if not re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*", text):
        raise OptionError(f"cannot read --batch-sizes '{text}': give positive integers separated by commas, e.g. 8,16,32")
    sizes = [int(s) for s in text.split(",")]
    if min(sizes) < 1:
        raise OptionError("--batch-sizes must all be 1 or more, e.g. 8,16,32")
    return sizes


def target_device(gpu: str | None, gpu_memory: str | None) -> Device:
    """--gpu from the catalog, --gpu-memory for any card, else the real GPU, else an H100."""
    if gpu and gpu_memory:
        raise OptionError("give --gpu or --gpu-memory, not both")
    if gpu_memory:
        return custom_device(parse_size(gpu_memory))
    if gpu:
        return get_device(gpu)
    import torch

    if torch.cuda.is_available():
        return detect_cuda_device()
    err.print(f"[dim]no --gpu given and no GPU here: sizing for {DEFAULT_GPU} "
              f"(choose with --gpu, see `batchfit gpus`)[/]")
    return CATALOG[DEFAULT_GPU]


def is_stdout(path: str | None) -> bool:
    return path == "-"


def quiet_if_stdout(path: str | None) -> Console:
    """Human output goes to stderr when JSON goes to stdout."""
    return err if is_stdout(path) else out


def echo_json(text: str) -> None:
    sys.stdout.write(text)
