"""The package's layers, read from its own imports (docs/architecture.md).

Each folder of ``src/batchfit`` is one floor; a file imports only its own floor and the floors
below it, engines never import each other, and no two files import each other round a circle.
Read with ``ast`` (imports inside functions count too), so nothing of the package runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "batchfit"

# top to bottom; the engines share one floor and never import each other
FLOORS = [("cli",), ("integrations",), ("report",),
          ("estimator", "probe", "bench", "plan", "sweep", "recommend"),
          ("distributed",), ("trace",), ("train",), ("ground", "zoo")]
ENGINES = set(FLOORS[3])
# the public names users import stay at the package root as re-exports of the floors above
PUBLIC_REEXPORTS = {"batchfit", "batchfit.lightning", "batchfit.transformers"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Every batchfit module this file imports, at module level or inside a function
    (``from . import x`` imports the file x when there is one, else its package)."""
    here = _module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("batchfit")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if target.startswith("batchfit"):
                found |= {f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names}
    return found


def _room(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()):
        return parts[1]
    return "ground"


def _floor(room: str) -> int:
    return next(i for i, rooms in enumerate(FLOORS) if room in rooms)


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in _imports(path, set(files)) if m in files} for name, path in files.items()}


def test_every_folder_is_a_floor_of_the_layout():
    rooms = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms <= {room for floor in FLOORS for room in floor}


def test_no_import_runs_up_a_floor_and_no_engine_imports_another():
    wrong = []
    for module, imported in _graph().items():
        if module in PUBLIC_REEXPORTS:
            continue
        for other in imported:
            here, there = _room(module), _room(other)
            if _floor(there) < _floor(here) or (here in ENGINES and there in ENGINES and here != there):
                wrong.append(f"{module} -> {other}")
    assert wrong == []


def test_no_two_files_import_each_other_round_a_circle():
    graph = _graph()
    circles, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for other in sorted(graph[module]):
            if state.get(other) == "open":
                circles.append(path[path.index(other):] + [other])
            elif other not in state:
                visit(other, path + [other])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert circles == []
