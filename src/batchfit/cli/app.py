"""The ``batchfit`` app: one line per command, the logic lives in the library."""

from __future__ import annotations

import gc

import typer

from batchfit.cli.bench import EXAMPLES as BENCH_EXAMPLES
from batchfit.cli.bench import bench_command
from batchfit.cli.cache import cache_app
from batchfit.cli.estimate import EXAMPLES, estimate_command
from batchfit.cli.gpus import gpus_command, zoo_command
from batchfit.cli.noise import EXAMPLES as NOISE_EXAMPLES
from batchfit.cli.noise import noise_command
from batchfit.cli.plan import EXAMPLES as PLAN_EXAMPLES
from batchfit.cli.plan import plan_command
from batchfit.cli.probe import EXAMPLES as PROBE_EXAMPLES
from batchfit.cli.probe import probe_command
from batchfit.cli.recommend import EXAMPLES as RECOMMEND_EXAMPLES
from batchfit.cli.recommend import recommend_command
from batchfit.cli.sweep import EXAMPLES as SWEEP_EXAMPLES
from batchfit.cli.sweep import sweep_command

app = typer.Typer(
    name="batchfit",
    help="Which batch size should I train with? Traced, measured and reported.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        from batchfit import __version__

        print(f"batchfit {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Which batch size should I train with? Traced, measured and reported.

    estimate: predict without a GPU. probe: find the largest batch that runs. bench: time it.
    """


app.command("estimate", epilog=EXAMPLES)(estimate_command)
app.command("probe", epilog=PROBE_EXAMPLES)(probe_command)
app.command("bench", epilog=BENCH_EXAMPLES)(bench_command)
app.command("plan", epilog=PLAN_EXAMPLES)(plan_command)
app.command("sweep", epilog=SWEEP_EXAMPLES)(sweep_command)
app.command("noise", epilog=NOISE_EXAMPLES)(noise_command)
app.command("recommend", epilog=RECOMMEND_EXAMPLES)(recommend_command)
app.command("gpus")(gpus_command)
app.command("zoo")(zoo_command)
app.add_typer(cache_app)


def _plain_help(typer_app: typer.Typer) -> None:
    """Help texts are plain text. Typer's rich help reads them as rich markup, where a bracketed
    word is a style tag: "Needs batchfit[quant]." printed as "Needs batchfit.", torchtitan's
    [training] section as nothing. Escape every command's docstring, epilog and parameters' help
    once (a parameter's help object is shared by the commands that use it)."""
    import inspect

    from rich.markup import escape
    from typer.models import ParameterInfo

    done: set[int] = set()
    for info in typer_app.registered_commands:
        info.help = escape(info.help if info.help is not None else inspect.getdoc(info.callback) or "")
        info.epilog = escape(info.epilog) if info.epilog else info.epilog
        function = inspect.unwrap(info.callback)
        for param in inspect.signature(function, eval_str=True).parameters.values():
            # the annotations are strings (``from __future__ import annotations``), evaluated anew
            # each time they are read: keep the evaluated ones, whose help is escaped here
            if param.annotation is not param.empty:
                function.__annotations__[param.name] = param.annotation
            for meta in (*getattr(param.annotation, "__metadata__", ()), param.default):
                if isinstance(meta, ParameterInfo) and meta.help and id(meta) not in done:
                    done.add(id(meta))
                    meta.help = escape(meta.help)


_plain_help(app)


def main() -> None:
    """The command, then its exit without the interpreter's teardown: once the outputs are written and the
    exit handlers have run (``multiprocessing``'s join of the sessions, ``weakref.finalize``'s temporary
    folders), freeing every module and object one by one changes nothing a user sees and took 1.6-2.1 s after
    a plan of Llama-3.1-70B (its traced modules and fake tensors).

    The cyclic garbage collector runs less often: a trace makes and frees a great many small objects (fake
    tensors, their metadata, dispatch cache keys), few in cycles, and at Python's default threshold (700) the
    collections of a Llama-3.1-70B fsdp+cp8 session took 2.35 s of its 28 CPU-s; at 50,000 0.97 s, with the
    same peak memory (555 MB) (timed with ``gc.callbacks``)."""
    gc.set_threshold(50_000, 50, 100)
    try:
        app()
        code = 0
    except SystemExit as done:
        code = done.code
    _exit(code)


def _exit(code) -> None:
    """Exit as ``sys.exit(code)`` would, skipping the teardown (:func:`main`); under a profiler or a tracer
    (``python -m cProfile``, a debugger, coverage) as ``sys.exit`` does: they write what they saw after it."""
    import atexit
    import os
    import sys

    if sys.getprofile() is not None or sys.gettrace() is not None:
        sys.exit(code)
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to write there
            pass
    os._exit(code or 0)


if __name__ == "__main__":
    main()
