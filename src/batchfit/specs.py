"""Turning a MODEL spec into a Workload.

    gpt2-124m                a zoo name            (batchfit.zoo.ZOO)
    hf:llama-3.1-8b          a shipped transformers config, hf:path/to/config.json, or
                             hf:path/to/folder (a model folder with a config.json)
    my_model.py:workload     a function in a file that returns a Workload
    my_pkg.models:workload   a function in an importable module
    torchtitan:job.toml      a torchtitan job config: its model and parallelisms, torchtitan's own
                             code (zoo/torchtitan_job.py; the [torchtitan] extra)
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import json
import sys
import traceback
from pathlib import Path
from types import ModuleType

from batchfit.errors import BatchfitError, ModelSpecError
from batchfit.workload import Workload

SPEC_HELP = ("a zoo name (batchfit zoo), hf:<name>, hf:config.json or hf:folder, file.py:function, or "
             "torchtitan:job.toml")


def load_workload(spec: str, *, seq_len: int | None = None, for_plan: bool = False) -> Workload:
    """Resolve ``spec``; ``seq_len`` overrides the workload's sequence length. A ``torchtitan:``
    job only with ``for_plan``: its activation checkpointing and sharding are torchtitan's
    ``parallelize_llama``, which only ``plan`` applies (``Workload.parallelize_all``)."""
    if seq_len is not None and not 1 <= seq_len <= 1 << 24:  # beyond: overflows in the model's own code
        raise ModelSpecError(f"`seq_len` must be from 1 to {1 << 24:,} (2^24 tokens), got {seq_len}")
    from batchfit.zoo import ZOO  # here: the zoo's models load torch

    if spec.startswith("torchtitan:"):
        if not for_plan:
            raise ModelSpecError(f"{spec}: a torchtitan job is planned with its own parallelize_llama (activation "
                                 "checkpointing, FSDP2, TP): use batchfit plan " + spec + " (`gpus` 1 for one GPU)")
        from batchfit.zoo.torchtitan_job import read_job
        from batchfit.zoo.torchtitan_model import torchtitan_workload

        return torchtitan_workload(read_job(spec.removeprefix("torchtitan:")), seq_len)
    if spec.startswith("hf:"):
        from batchfit.zoo.hf import hf_workload

        return _keyed(hf_workload(spec[3:], seq_len), spec, seq_len, Path(spec[3:]).expanduser())
    if spec in ZOO:
        return _keyed(ZOO[spec](seq_len), spec, seq_len, None)
    if ":" in spec:
        workload, file = _user_workload(spec, seq_len)
        return _keyed(workload, spec, seq_len, Path(file))
    from batchfit.zoo.hf import CONFIGS

    names = [*ZOO, *(f"hf:{n}" for n in CONFIGS)]
    close = difflib.get_close_matches(spec, names, n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise ModelSpecError(f"unknown model '{spec}': {hint}MODEL is {SPEC_HELP}")


def rl_workload(spec: str, rollout) -> Workload:
    """``spec``'s model as the policy of the GRPO step (``zoo/grpo.py``) under ``rollout`` (an
    ``options.Rollout``: a TRL GRPOConfig's generation settings): an ``hf:`` causal LM, or the zoo's
    ``grpo-gpt2-124m`` with these settings."""
    from batchfit.zoo.grpo import grpo_workload

    if spec == "grpo-gpt2-124m" and rollout.algorithm == "grpo":
        return _keyed(grpo_workload(rollout=rollout), f"{spec}:{rollout}", None, None)
    if spec.startswith("hf:"):
        from batchfit.zoo.hf_grpo import hf_grpo_workload
        from batchfit.zoo.hf_ppo import ppo_workload

        build = ppo_workload if rollout.algorithm == "ppo" else hf_grpo_workload
        try:
            workload = build(spec[3:], rollout)
        except ModelSpecError as error:  # its words are --seq-len's, which the user did not give
            raise ModelSpecError(f"{rollout.prompt_len:,} prompt and {rollout.new_tokens:,} new tokens: {error}; set "
                                 "max_prompt_length / the completion length in the args to fit") from None
        return _keyed(workload, f"{spec}:{rollout}", None, Path(spec[3:]).expanduser())
    raise ModelSpecError(f"'{spec}' with a {rollout.algorithm.upper()}Config: the step generates with a causal LM, so "
                         "give hf:<name>, hf:config.json or hf:folder" + (" (or grpo-gpt2-124m)"
                                                                          if rollout.algorithm == "grpo" else ""))


def _keyed(workload: Workload, spec: str, seq_len: int | None, path: Path | None) -> Workload:
    """``workload`` with its trace cache key (``spec_key``)."""
    workload.cache_key = spec_key(spec, seq_len, path)
    return workload


def spec_key(spec: str, seq_len: int | None, path: Path | None) -> str:
    """What names a spec's workload in the trace cache: the spec, --seq-len, and the content of the
    file (or the .json files of the folder) the spec names, so an edited model is traced again. Only
    that file: a model file that imports another of the user's files is keyed by its own text alone."""
    digest = hashlib.sha256()
    if path is not None and path.exists():
        for file in sorted(path.glob("*.json")) if path.is_dir() else [path]:
            digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return json.dumps({"spec": spec, "seq_len": seq_len, "content": digest.hexdigest()})


def _user_workload(spec: str, seq_len: int | None) -> tuple[Workload, str]:
    target, _, fn_name = spec.rpartition(":")
    if not fn_name.isidentifier():
        raise ModelSpecError(f"'{spec}': after the colon comes a function name, e.g. my_model.py:workload")
    module, file = _load_module(target)
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ModelSpecError(f"'{target}' has no function '{fn_name}'")
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C function: call it and see
        parameters = {}
    accepts_seq_len = "seq_len" in parameters
    if seq_len is not None and not accepts_seq_len:
        raise ModelSpecError(f"`seq_len` was given but {fn_name}() takes no seq_len argument: add one or "
                             "drop `seq_len`")
    passed = {"seq_len"} if accepts_seq_len and seq_len is not None else set()
    required = [p.name for p in parameters.values()
                if p.default is p.empty and p.name not in passed
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if required:
        line = getattr(getattr(fn, "__code__", None), "co_firstlineno", "?")
        raise ModelSpecError(
            f"{file}:{line}: {fn_name}() needs the argument '{required[0]}', but batchfit calls it "
            f"with none (seq_len only with `seq_len`): give '{required[0]}' a default"
        )
    try:
        workload = fn(seq_len=seq_len) if passed else fn()
    except BatchfitError:
        raise
    except Exception as error:  # the user's code failed: point at their line, not ours
        raise ModelSpecError(
            f"{_where(error, file)}: {_first_line(error)} (raised in {fn_name}()): fix that line"
        ) from error
    if not isinstance(workload, Workload):
        raise ModelSpecError(f"{spec} returned {type(workload).__name__}, not a batchfit.Workload")
    return workload, file


def _load_module(target: str) -> tuple[ModuleType, str]:
    """Import ``target`` (a .py path or a module name); returns the module and its file."""
    if target.endswith(".py"):
        path = Path(target)
        if not path.exists():
            raise ModelSpecError(f"no file '{target}': give the path of a .py file, e.g. ./my_model.py:workload")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        added = sys.modules.setdefault(path.stem, module) is module
        try:
            module_spec.loader.exec_module(module)
        except Exception as error:
            if added:  # as Python's import does: no half-run module left behind
                sys.modules.pop(path.stem, None)
            raise _load_error(error, target, target) from error
        return module, target
    try:
        module_spec = importlib.util.find_spec(target)  # imports the parent packages
    except ModuleNotFoundError as error:
        if error.name and (target + ".").startswith(error.name + "."):  # a package on the path is missing
            raise ModelSpecError(
                f"cannot import '{target}' ({error}): use file.py:function or module:function"
            ) from None
        raise _load_error(error, target, target) from error
    except ValueError as error:
        raise ModelSpecError(f"cannot import '{target}' ({error}): use file.py:function or module:function") from None
    except Exception as error:  # a parent package's __init__ failed
        raise _load_error(error, target, target) from error
    if module_spec is None:
        raise ModelSpecError(f"cannot import '{target}': no such module; use file.py:function or module:function")
    file = module_spec.origin or target
    try:
        return importlib.import_module(target), file
    except Exception as error:
        raise _load_error(error, file, target) from error


def _load_error(error: Exception, file: str, target: str) -> ModelSpecError:
    """A failure while running the user's module, as one line that names their file and line."""
    if isinstance(error, SyntaxError):  # compile() raised it: the place is on the error, not the traceback
        name = error.filename or file
        if Path(name).resolve() == Path(file).resolve():
            name = file  # as the user typed it
        where = f"{name}:{error.lineno or '?'}"
        return ModelSpecError(f"{where}: SyntaxError: {error.msg}: fix that line")
    fix = "install that module or fix the import" if isinstance(error, ImportError) else "fix that line"
    return ModelSpecError(f"{_where(error, file)}: {_first_line(error)} (raised while importing "
                          f"{target}): {fix}")


def _where(error: BaseException, file: str) -> str:
    """file:line of the innermost traceback frame in ``file`` (the user's line, even when the
    error came from a library it called), else of the innermost frame outside importlib."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith("<")]
    wanted = Path(file).resolve()
    mine = [f for f in frames if Path(f.filename).resolve() == wanted]
    if mine:
        return f"{file}:{mine[-1].lineno}"
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else file


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
