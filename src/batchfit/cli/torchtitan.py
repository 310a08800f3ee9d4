"""``batchfit plan torchtitan:job.toml``: what was read from the job and what became of each key.

Reading the job and taking its settings as plan's defaults is the config layer's
(``config/torchtitan.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.markup import escape

if TYPE_CHECKING:  # batchfit.zoo imports torch: not for --help
    from batchfit.zoo.torchtitan_job import TitanJob


def print_torchtitan(job: TitanJob, console) -> None:
    """What was read from the job and what became of each key (the unused ones counted, listed in the JSON)."""
    from batchfit.zoo.torchtitan_job import TORCHTITAN_VERSION

    console.print(f"[bold]torchtitan job {escape(str(job.path))}[/]: torchtitan {TORCHTITAN_VERSION}'s own {job.model} "
                  f"'{escape(job.flavor)}' and parallelize_llama (TP, activation checkpointing, FSDP2) traced on a "
                  "fake process group")
    used = [(key, how) for key, how in job.mapping if not how.startswith("not used")]
    for key, how in used:
        console.print(f"  {escape(key)}: {escape(how)}")
    unused = [key for key, how in job.mapping if how.startswith("not used")]
    if unused:
        console.print(f"  not used ({len(unused)}, each with why in the JSON 'torchtitan.mapping'): "
                      + escape(", ".join(unused)), soft_wrap=True)
