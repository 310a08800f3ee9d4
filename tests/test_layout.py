"""The layering of docs/architecture.md, pinned: each layer imports only the layers below it,
and no engine imports another (what two engines share moves down)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "src" / "batchfit"
LAYERS = [  # bottom to top
    {"errors", "notices", "phases", "tiers", "devices", "options", "workload", "search", "targets", "specs", "zoo"},
    {"train"},
    {"trace"},
    {"distributed"},
    {"runs"},
    {"estimator", "probe", "bench", "plan", "sweep", "recommend"},
    {"report"},
    {"integrations", "lightning", "transformers"},
    {"config"},
    {"cli", "__init__"},
]
ENGINES = LAYERS[5]


def layer_of(part: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if part in names)


def imports(path: Path) -> set[str]:
    """The first part of every ``batchfit.<part>`` this file imports, lazily or not."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names if node.module == "batchfit"]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "batchfit" and len(parts) > 1:
                found.add(parts[1])
    return found


def modules() -> list[tuple[str, Path]]:
    return [(path.relative_to(PACKAGE).parts[0].removesuffix(".py"), path) for path in PACKAGE.rglob("*.py")]


def test_every_module_has_a_layer():
    assert {part for part, _ in modules()} <= set().union(*LAYERS)


def test_each_layer_imports_only_layers_below_it():
    wrong = [f"{path.relative_to(PACKAGE)} imports batchfit.{other}"
             for part, path in modules() for other in imports(path)
             if other in set().union(*LAYERS) and layer_of(other) > layer_of(part)]
    assert wrong == []


def test_no_engine_imports_another():
    wrong = [f"{path.relative_to(PACKAGE)} imports batchfit.{other}"
             for part, path in modules() if part in ENGINES
             for other in imports(path) if other in ENGINES and other != part]
    assert wrong == []


def test_one_optimizer_step_call_site():
    calls = [f"{path.relative_to(PACKAGE)}:{node.lineno}" for _, path in modules()
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "step"
             and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "optimizer"]
    assert calls == ["train/step.py:" + calls[0].split(":")[1]] if calls else False


def file_imports(path: Path, files: set[str]) -> set[str]:
    """The batchfit files this file imports, lazily or not (``from batchfit.zoo import x`` is the
    file ``zoo/x.py`` where there is one, else ``zoo/__init__.py``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                      for a in node.names}
    return found & files


def test_no_files_import_each_other_round_a_circle():
    """A circle hides which file is below which; one inside a function is a circle all the same
    (zoo/enoki.py once imported the zoo that imports it, from inside a function)."""
    def name(path: Path) -> str:
        parts = ("batchfit", *path.relative_to(PACKAGE).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    paths = {name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {module: file_imports(path, set(paths)) for module, path in paths.items()}
    circles, state = [], {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = "open"
        for other in sorted(graph[module]):
            if state.get(other) == "open":
                circles.append(" -> ".join(trail[trail.index(other):] + [other]))
            elif other not in state:
                visit(other, trail + [other])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert circles == []


STRATEGY_PARSER = PACKAGE / "distributed" / "strategy_name.py"
STRATEGY_TOKEN = re.compile(r"\b(?:pp|cp|ep|tp|hsdp)(?:\(|\\d|\d|<)|\b(?:ddp|fsdp|zero[12])\b")
"""What a pattern or a literal that reads a strategy name holds: a degree token (pp(, tp\\d, cp2) or a wrap."""


def token_like(value: object) -> bool:
    """A literal that is (part of) a strategy name: '+' (the joiner), 'pp', 'cp2', 'fsdp', 'zero1', ..."""
    return isinstance(value, str) and (value == "+" or bool(STRATEGY_TOKEN.search(value))
                                       or re.fullmatch(r"(?:pp|cp|ep|tp|hsdp|zero)\d*", value) is not None)


def strategy_text_reads(source: str) -> list[str]:
    """Where ``source`` reads a strategy name as text instead of its typed degrees: a regular expression
    over strategy tokens, a ``.split`` / ``.startswith`` / ``.endswith`` / ``.partition`` / ``.removeprefix``
    of something named strategy, or a ``"cp" in ...strategy...`` test."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = f"line {getattr(node, 'lineno', '?')}"
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "re" and node.args
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
                and STRATEGY_TOKEN.search(node.args[0].value)):
            found.append(f"{line}: re.{node.func.attr}({node.args[0].value!r})")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("split", "startswith", "endswith", "partition", "removeprefix")
              and "strateg" in ast.unparse(node.func.value).lower()
              and any(isinstance(a, ast.Constant) and token_like(a.value) for a in node.args)):
            found.append(f"{line}: {ast.unparse(node)}")
        elif (isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) and token_like(node.left.value)
              and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)
              and any("strateg" in ast.unparse(c).lower() for c in node.comparators)):
            found.append(f"{line}: {ast.unparse(node)}")
    return found


def test_one_parser_of_strategy_names():
    """Strategy names are read in distributed/strategy_name.py alone; everything else reads the typed
    degrees (Strategy.tp, .cp, .pp, StrategyPlan.cp, ...), as torchtitan's ParallelDims holds them."""
    assert strategy_text_reads('_PP = re.compile(r"^pp(\\d+)(?:\\+(.+))?$")\nif p.strategy.startswith("pp"): pass\n'
                               'cp = "cp" in plan.strategy\nparts = strategy.name.split("+")')  # the rule sees them
    wrong = [f"{path.relative_to(PACKAGE)} {where}" for _, path in modules() if path != STRATEGY_PARSER
             for where in strategy_text_reads(path.read_text())]
    assert wrong == []


PLAN_STILL_IMPORTS = {  # a parallelism's module that plan/ still imports by name, and why (issue 31 item 1)
    "distributed/strategy.py": "the typed Strategy and apply_strategy: every strategy's, not one parallelism's",
    "distributed/pipeline.py": "plan/pipeline.py is the pipeline's own session: it traces each pipeline rank "
                               "(build_rank's stages) through plan/sharded.py's ShardedSession, a layer above "
                               "distributed/; reaching build_rank through the entry would hide that one caller's "
                               "dependency, not remove it",
}


def test_plan_reaches_each_parallelism_through_the_registry():
    """Each parallelism's code lives in its one distributed/ module, which its registry entry names
    (``Parallelism.module``, distributed/parallelisms.py): plan/ imports none of those modules by name, so
    auto's rules (plan/candidates.py), the code around rank 0's step on the fake mesh (plan/sharded.py: cp's
    sharded sequence and ring, ep's experts and all-to-alls) and the approximations reach them through the
    entry, and a new parallelism's module joins plan without an edit there."""
    from batchfit.distributed.parallelisms import registered

    files = {".".join(("batchfit", *path.relative_to(PACKAGE).with_suffix("").parts)) for path in PACKAGE.rglob("*.py")}
    own = {"batchfit." + p.module.removesuffix(".py").replace("/", "."): p.key for p in registered()
           if p.module not in PLAN_STILL_IMPORTS}
    assert {"batchfit.distributed.context_parallel", "batchfit.distributed.expert_parallel",
            "batchfit.distributed.tp_plans", "batchfit.distributed.zero"} <= set(own)
    wrong = [f"{path.relative_to(PACKAGE)} imports {module} ({own[module]}'s)"
             for path in (PACKAGE / "plan").glob("*.py") for module in sorted(file_imports(path, files))
             if module in own]
    assert wrong == []


REGISTRY_ONLY = ("cp", "ep")
"""Parallelisms plan/ reaches through their registry entries alone (tp and pp still have plan code of their
own: plan/pipeline.py, the TP loss of plan/sharded.py)."""
READS_THEM_STILL = {
    "result.py": "StrategyPlan's own cp / ep fields, as its JSON names them",
    "bound.py": "floor_bytes's rule that pp, tp and ep spread the state (helper planspeed's file this round)",
}


def degree_reads(source: str, keys: tuple[str, ...] = REGISTRY_ONLY) -> list[str]:
    """Where ``source`` reads a degree of ``keys`` by name: ``x.cp``, ``getattr(x, "ep", 1)``,
    ``degrees.get("cp")``, ``c.group == "cp"`` (any string literal that is the key)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and node.attr in keys) or (
                isinstance(node, ast.Constant) and node.value in keys):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_plan_reads_cp_and_ep_through_the_registry():
    """plan/ reads cp's and ep's degrees through their entries (``Parallelism.used_by``, ``degree_of``,
    ``strategy_name.field_degrees``) and their rules through its hooks (emit keys, the shard group, the
    pipeline's refusal, the ring's bytes, auto's bounds), never by name."""
    assert len(degree_reads('a = s.cp\nb = getattr(s, "ep", 1)\nc = d.get("cp", 1)\nok = s.tp\n')) == 3
    wrong = [f"plan/{path.name} {where}" for path in sorted((PACKAGE / "plan").glob("*.py"))
             if path.name not in READS_THEM_STILL for where in degree_reads(path.read_text())]
    assert wrong == []


TESTS = Path(__file__).parent


def test_no_test_module_imports_another():
    """What two test modules share lives in tests/tiny.py, tests/cpu_truth.py (pipeline_truth.py for the
    pipelines) or tests/conftest.py: a test module imported by another runs its module-level code twice and
    hides where a helper is."""
    found = set()
    for path in TESTS.glob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            found |= {(path.stem, name.removeprefix("tests.")) for name in names
                      if name.removeprefix("tests.").startswith("test_")}
    assert found == set(), sorted(found)


OPTIONS_MODULE = PACKAGE / "options.py"
OPTION_FIELDS = ("precision", "checkpointing", "loss", "offload", "quantize", "lora", "routing")
"""StepOptions' text fields whose grammar options.py parses (``StepOptions.checkpointing_spec`` ...)."""
OPTION_MARKS = ("every:", "chunked:", "capacity:", "fp8", "bf16", "-dq", "r=", "alpha=", "targets=")
"""The pieces of those grammars a text test would look for."""
TEXT_TESTS = ("split", "rsplit", "partition", "rpartition", "startswith", "endswith", "removeprefix", "removesuffix")


def option_text_reads(source: str) -> list[str]:
    """Where ``source`` reads an option's grammar from its text instead of its parsed value: a
    ``.split`` / ``.startswith`` / ``.removeprefix`` ... of something named after an option field
    (``options.checkpointing``, ``routing``), or of anything with a grammar's piece (``"every:"``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in TEXT_TESTS):
            continue
        receiver = node.func.value
        name = receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", None)
        marked = any(isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith(OPTION_MARKS)
                     for a in node.args)
        if name in OPTION_FIELDS or marked:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_option_grammar_is_parsed_outside_its_dataclass():
    """The option grammars (every:N, chunked:N, capacity:F, r=N,..., a+b, fp8-<recipe>, <kind>-dq) are
    parsed in options.py alone, once, by StepOptions.__post_init__; everything else reads the fields
    (``options.checkpointing_spec.every``, ``options.offload_spec.params``, ``.precision_spec.fp8_recipe``)."""
    old = ('every = options.checkpointing.startswith("every:")\nfactor = float(routing.removeprefix("capacity:"))\n'
           'parts = offload.split("+")\nkind = options.quantize.removesuffix("-dq")\n'
           'recipe = result.options.precision.removeprefix("fp8-")\nn = policy.removeprefix("every:")')
    assert len(option_text_reads(old)) == 6  # the code before options.py: the rule sees each
    wrong = [f"{path.relative_to(PACKAGE)} {where}" for _, path in modules() if path != OPTIONS_MODULE
             for where in option_text_reads(path.read_text())]
    assert wrong == []


FLAG = re.compile(r"(?<![\w`-])--[a-z][a-z0-9-]*")
"""A CLI flag in a message (``--seq-len``)."""
QUOTED_COMMANDS = re.compile(r"`batchfit [^`]*`|torchrun .*")
"""A command line a message quotes whole (`batchfit bench --device cuda`, torchrun --nproc-per-node 2 ...):
its flags are the command's own, what the user types into a shell, not a library field."""
NAMED_FIELD = re.compile(r"`([a-z][a-z0-9_]*)(?:=[^`]*)?`")


def _message(part: ast.JoinedStr) -> str:
    """An f-string as its message reads, each interpolated value ``{}``: a command line it quotes whole with a
    value inside (`batchfit estimate MODEL --trainer {spec}`) is one text, not pieces cut at the value."""
    return "".join(piece.value if isinstance(piece, ast.Constant) else "{}" for piece in part.values)


def error_texts(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string a library error message is built from: the strings and f-strings of a
    ``raise`` statement and of an ``...Error(...)`` made outside one (a string inside an f-string's
    interpolated value is its own text)."""
    found = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Raise) and node.exc is not None:
            node = node.exc
        elif not (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("Error")):
            continue
        pieces = {id(piece) for part in ast.walk(node) if isinstance(part, ast.JoinedStr) for piece in part.values}
        found |= {id(part): (part.lineno, _message(part)) for part in ast.walk(node) if isinstance(part, ast.JoinedStr)}
        found |= {id(part): (part.lineno, part.value) for part in ast.walk(node)
                  if isinstance(part, ast.Constant) and isinstance(part.value, str) and id(part) not in pieces}
    return sorted(found.values())


def library_error_texts() -> list[tuple[str, int, str]]:
    return [(str(path.relative_to(PACKAGE)), line, text) for part, path in modules() if part != "cli"
            for line, text in error_texts(path.read_text())]


def flags_named(texts: list[tuple[int, str]]) -> list[str]:
    """``line: flag`` of each CLI flag in ``texts``, outside a command line they quote whole."""
    return [f"{line}: {flag}" for line, text in texts for flag in FLAG.findall(QUOTED_COMMANDS.sub("", text))]


def test_no_library_error_names_a_cli_flag():
    """A library user calling ``estimate(...)`` or ``StepOptions(...)`` typed no flag: a library error
    names the field in backticks (``seq_len``, ``checkpointing='full'``, see batchfit/errors.py), and
    the CLI prints it as the flag (cli/flags.py). Only a whole command line a message quotes keeps its flags."""
    old = ('raise OptionError(f"--seq-len {n} is too long")\nbad = OptionError("use --loss plain")\n'
           'raise OptionError("run `batchfit probe --device cuda`, or torchrun --nproc-per-node 2")')
    assert flags_named(error_texts(old)) == ["1: --seq-len", "2: --loss"]  # the rule sees them
    wrong = [f"{path}:{where}" for path, line, text in library_error_texts() for where in flags_named([(line, text)])]
    assert wrong == []


def test_every_field_a_library_error_names_has_a_flag():
    """Each backticked field of a library error is in cli/flags.py's table, so a CLI user reads its flag."""
    from batchfit.cli.flags import FIELD_FLAGS

    named = {field for _, _, text in library_error_texts() for field in NAMED_FIELD.findall(text)}
    assert named - set(FIELD_FLAGS) == set()
    assert len(named) > 50  # the rule reads the messages (the fields they name)


CLI = PACKAGE / "cli"
CLI_FUNCTION_LINES = 60
"""The most lines a function of cli/ may have, its docstring and signature not counted (issue 31): a command
parses its flags through config/, calls one engine and writes the outputs; the merging lives in config/."""


def long_functions(source: str, most: int = CLI_FUNCTION_LINES) -> list[str]:
    """The top-level functions of ``source`` whose body (after the docstring) runs over ``most`` lines."""
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body[1:] if ast.get_docstring(node) is not None else node.body
            lines = body[-1].end_lineno - body[0].lineno + 1 if body else 0
            if lines > most:
                found.append(f"{node.name}: {lines} lines")
    return found


def test_cli_functions_are_thin():
    """No function of cli/ is over 60 lines: plan_command was 89 (and 44 parameters, merged by hand)."""
    assert long_functions("def f():\n    '''doc'''\n" + "    x = 1\n" * 61) == ["f: 61 lines"]  # the rule sees one
    assert long_functions("def f():\n    '''doc'''\n" + "    x = 1\n" * 60) == []
    wrong = [f"cli/{path.name} {where}" for path in sorted(CLI.glob("*.py"))
             for where in long_functions(path.read_text())]
    assert wrong == []


MEASURES = ("profiled_step_peak", "profiled_peak", "profiled_phase_peaks", "profiled_workload_peak",
            "agreed_profiled_peak", "profiled_rank_peak", "rank0_profiled_peaks", "spawn_profiled_gloo",
            "measure_pipeline")
"""The measurements of tests/cpu_truth.py, tiny.py and pipeline_truth.py: a test module that calls one holds a truth."""
WHOSE = re.compile(r"Checked against\s.*?\b\w+'s? own\b", re.DOTALL)
"""'Checked against torch's own ...', '... batchfit's own ...', '... transformers' own ...'."""


def test_every_truth_says_what_it_checks_against():
    """A test module that measures a real step (the profiler, a gloo run) says in its docstring whose code the
    measured step ran (issue 31): a library's own (torch's, torchtitan's: the trace's fidelity is checked) or
    batchfit's own implementation of a library's behaviour (only the counting is)."""
    measuring, unsaid = [], []
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        called = {node.func.id for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
        if called & set(MEASURES):
            measuring.append(path.name)
            if not WHOSE.search(ast.get_docstring(tree) or ""):
                unsaid.append(path.name)
    assert len(measuring) > 20 and "test_plan_trace.py" in measuring  # the rule sees the truths
    assert WHOSE.search("Checked against\ntorch's own DDP") and not WHOSE.search("Checked against the profiler")
    assert unsaid == []
