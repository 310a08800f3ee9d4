"""cli/flags.py: a library error names fields, the CLI prints the flags a command line types."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from batchfit.cli.app import app
from batchfit.cli.flags import FIELD_FLAGS, as_flags
from batchfit.errors import OptionError
from batchfit.estimator.batching import parse_batching
from batchfit.workload import StepOptions


def declared_flags() -> set[str]:
    """Every --flag some command of the app declares."""
    group = typer.main.get_command(app)
    return {opt for command in group.commands.values() for param in command.params
            for opt in (*param.opts, *param.secondary_opts) if opt.startswith("--")}


def test_every_flag_in_the_table_is_declared_by_a_command():
    assert set(FIELD_FLAGS.values()) - declared_flags() == set()


def test_as_flags_writes_fields_as_flags():
    assert as_flags("`seq_len` 8 is too long; use `loss` plain") == "--seq-len 8 is too long; use --loss plain"
    assert as_flags("use `checkpointing='full'`, or `resume=True`") == "use --checkpointing full, or --resume"
    assert as_flags("loosen `frozen` or `trainable`") == "loosen --freeze or --train-only"
    # not a field: left as written (a command line, a module's attribute)
    assert as_flags("run `batchfit gpus`; set `Workload.lm_parts`") == "run `batchfit gpus`; set `Workload.lm_parts`"


def test_a_library_error_names_the_field():
    with pytest.raises(OptionError, match=r"`memory_budget` must be a fraction from 0 to 1 \(e.g. 0.5\), got 2"):
        StepOptions(memory_budget=2.0, compile="model")
    with pytest.raises(OptionError, match=r"`batching` pack needs a token count after pack, e.g. `batching` pack:4096"):
        parse_batching("pack")


def test_the_cli_prints_the_flag():
    result = CliRunner().invoke(app, ["estimate", "gpt-tinystories-22m", "--gpu", "h100", "--memory-budget", "2",
                                      "--compile", "model"])
    assert result.exit_code == 2
    assert "--memory-budget must be a fraction from 0 to 1 (e.g. 0.5), got 2" in result.output
    assert "`" not in result.output
