"""`pip install batchfit` with no extras must work: every import of a package that
pyproject's `dependencies` does not declare sits behind the extra that declares it, and
says which (`pip install 'batchfit[hf]'`). .ci/run checks the real thing in a clean venv;
these tests catch the next undeclared import in seconds."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
IMPORT_NAMES = {"pyyaml": "yaml", "pytest-xdist": "xdist"}
"""Distributions whose import name is not their own name."""


def _import_name(requirement: str) -> str:
    dist = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()
    return IMPORT_NAMES.get(dist, dist.replace("-", "_"))


BASE = {_import_name(r) for r in PROJECT["dependencies"]}
EXTRAS = {extra: {_import_name(r) for r in reqs} for extra, reqs in PROJECT["optional-dependencies"].items()
          if extra != "test"}
OPTIONAL = set().union(*EXTRAS.values())

UNGUARDED_BY_DESIGN = {
    ("runs/executors.py", "ray"): "run_ray runs only after check_executor said pip install 'batchfit[ray]'",
    ("trace/bnb_fake.py", "bitsandbytes"): "runs only after train/quantize.py's load_bitsandbytes said "
                                           "pip install 'batchfit[quant]'",
    ("config/trainer.py", "click"): "imported only where typer has no copy of click of its own (typer._click, 0.2x); "
                                 "an older typer depends on click, so it is installed with typer",
}


def _third_party_imports():
    """(file, top-level module, the try statements around the import) for every import in src/."""
    for path in sorted((ROOT / "src" / "batchfit").rglob("*.py")):
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            tries, up = [], node
            while up in parents:
                up = parents[up]
                if isinstance(up, ast.Try):
                    tries.append(up)
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "batchfit":
                    yield path.relative_to(ROOT / "src" / "batchfit").as_posix(), top, tries


def _says_which_extra(tries: list[ast.Try], module: str) -> bool:
    """An `except ImportError` (or ModuleNotFoundError) around the import whose handler names an
    extra that declares ``module``."""
    for t in tries:
        for handler in t.handlers:
            caught = ast.unparse(handler.type) if handler.type else ""
            text = ast.unparse(handler)
            if ("ImportError" in caught or "ModuleNotFoundError" in caught) and any(
                    f"batchfit[{extra}]" in text or ("{extra}" in text and "batchfit[" in text)
                    for extra, modules in EXTRAS.items() if module in modules):
                return True
    return False


def test_every_import_is_declared_or_behind_its_extra():
    undeclared, unguarded = [], []
    for file, module, tries in _third_party_imports():
        if module in BASE or (file, module) in UNGUARDED_BY_DESIGN:
            continue
        if module not in OPTIONAL:
            undeclared.append(f"{file}: {module}")
        elif not _says_which_extra(tries, module):
            unguarded.append(f"{file}: {module}")
    assert not undeclared, f"imports no dependency or extra declares (add them to pyproject.toml): {undeclared}"
    assert not unguarded, f"optional imports with no 'pip install batchfit[extra]' error around them: {unguarded}"


BLOCKED = sorted(OPTIONAL | {"yaml"})
COMMANDS = ["estimate", "probe", "bench", "plan", "sweep", "noise", "recommend", "gpus", "zoo"]
NO_EXTRAS = f"""
import sys
for name in {BLOCKED!r}:
    sys.modules[name] = None  # import raises ImportError, as in a base install
from typer.testing import CliRunner
import batchfit
from batchfit.cli.app import app
runner = CliRunner()
for args in [["--help"]] + [[command, "--help"] for command in {COMMANDS!r}]:
    result = runner.invoke(app, args)
    assert result.exit_code == 0, (args, result.output, result.exception)
print("ok")
"""


def test_help_of_every_command_works_without_any_extra():
    out = subprocess.run([sys.executable, "-c", NO_EXTRAS], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stdout + out.stderr


def test_the_command_list_is_complete():
    from batchfit.cli.app import app

    assert sorted(c.name for c in app.registered_commands) == sorted(COMMANDS)
