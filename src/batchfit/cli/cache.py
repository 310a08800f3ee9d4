"""``batchfit cache clear``: empty the trace cache (``trace/cache.py``)."""

from __future__ import annotations

import typer

from batchfit.cli.common import handle_errors

cache_app = typer.Typer(name="cache", help="The trace cache: traced steps kept on disk, so a model asked again "
                                           "is not traced again.", no_args_is_help=True)


@cache_app.command("clear")
@handle_errors
def clear_command() -> None:
    """Remove every cached trace ($BATCHFIT_CACHE/traces, else ~/.cache/batchfit/traces)."""
    from batchfit.trace.cache import clear, traces_dir  # torch: only when the command runs

    entries, freed_bytes = clear()
    typer.echo(f"removed {entries} cached traces ({freed_bytes / 2**20:.1f} MiB) from {traces_dir()}")
