"""``batchfit gpus`` and ``batchfit zoo``: what batchfit knows about."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from batchfit.cli.common import out
from batchfit.devices import CATALOG, GiB


def gpus_command(
    as_json: Annotated[bool, typer.Option("--json", help="Print the catalog as JSON.", metavar="")] = False,
) -> None:
    """List the GPU catalog: names for --gpu, memory, dense fp32 and bf16 TFLOP/s, bandwidth.

    Aliases: a name without its memory (t4, h100, rtx4090) or without 'rtx' (4090), in any case.
    """
    if as_json:
        print(json.dumps([d.to_json() for d in CATALOG.values()], indent=2))
        return
    table = Table(title="GPU catalog (use the name with --gpu)", title_justify="left")
    table.add_column("name", no_wrap=True)  # copied into --gpu: never wrapped
    table.add_column("GPU")
    for column in ("total GiB", "usable GiB", "fp32 TFLOP/s", "bf16 TFLOP/s", "GB/s"):
        table.add_column(column, justify="right")
    for d in CATALOG.values():
        tensor = f"{d.bf16_tflops:g}" if d.supports_bf16 else f"{d.bf16_tflops:g} (fp16; no bf16)"
        table.add_row(d.name, d.display_name, f"{d.total_bytes / GiB:.1f}", f"{d.usable_bytes / GiB:.1f}",
                      f"{d.fp32_tflops:g}", tensor, f"{d.bandwidth_gb_per_s:g}")
    out.print(table)
    out.print("usable = total - 512 MiB CUDA context (assumed); dense datasheet peaks; "
              "aliases: t4, h100, rtx4090, 4090; any other GPU: --gpu-memory 24GiB")


def zoo_command() -> None:
    """List the built-in models (and the hf: configs shipped with batchfit)."""
    from batchfit.errors import ModelSpecError
    from batchfit.zoo import ZOO
    from batchfit.zoo.hf import CONFIGS

    table = Table(title="Built-in models (MODEL argument)", title_justify="left")
    table.add_column("name", no_wrap=True)
    table.add_column("what")
    for name, factory in ZOO.items():
        try:
            description = factory().description
        except ModelSpecError:  # built on transformers, not installed: list it, say what it needs
            description = "built on transformers, not installed here: pip install 'batchfit[hf]'"
        table.add_row(name, escape(description))
    for name in CONFIGS:
        table.add_row(f"hf:{name}", escape("transformers config shipped with batchfit (needs batchfit[hf])"))
    out.print(table)
    out.print("your own: my_model.py:function returning a batchfit.Workload; hf:path/to/config.json")
