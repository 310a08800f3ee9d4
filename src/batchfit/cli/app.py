"""The ``batchfit`` app: one line per command, the logic lives in the library."""

from __future__ import annotations

import typer

from batchfit.cli.bench import EXAMPLES as BENCH_EXAMPLES
from batchfit.cli.bench import bench_command
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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
