"""Turning a MODEL spec into a Workload.

    gpt2-124m                a zoo name            (batchfit.zoo.ZOO)
    hf:llama-3.1-8b          a shipped transformers config, or hf:path/to/config.json
    my_model.py:workload     a function in a file that returns a Workload
    my_pkg.models:workload   a function in an importable module
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path

from batchfit.errors import ModelSpecError
from batchfit.workload import Workload
from batchfit.zoo import ZOO

SPEC_HELP = "a zoo name (batchfit zoo), hf:<name> or hf:config.json, or file.py:function"


def load_workload(spec: str, *, seq_len: int | None = None) -> Workload:
    """Resolve ``spec``; ``seq_len`` overrides the workload's sequence length."""
    if seq_len is not None and seq_len < 1:
        raise ModelSpecError(f"--seq-len must be 1 or more, got {seq_len}")
    if spec.startswith("hf:"):
        from batchfit.zoo.hf import hf_workload

        return hf_workload(spec[3:], seq_len)
    if spec in ZOO:
        return ZOO[spec](seq_len)
    if ":" in spec:
        return _user_workload(spec, seq_len)
    from batchfit.zoo.hf import CONFIGS

    names = [*ZOO, *(f"hf:{n}" for n in CONFIGS)]
    close = difflib.get_close_matches(spec, names, n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise ModelSpecError(f"unknown model '{spec}': {hint}MODEL is {SPEC_HELP}")


def _user_workload(spec: str, seq_len: int | None) -> Workload:
    target, _, fn_name = spec.rpartition(":")
    if not fn_name.isidentifier():
        raise ModelSpecError(f"'{spec}': after the colon comes a function name, e.g. my_model.py:workload")
    if target.endswith(".py"):
        path = Path(target)
        if not path.exists():
            raise ModelSpecError(f"no file '{target}': give the path of a .py file, e.g. ./my_model.py:workload")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules.setdefault(path.stem, module)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as error:
            raise ModelSpecError(f"cannot import '{target}' ({error}): use file.py:function or module:function") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ModelSpecError(f"'{target}' has no function '{fn_name}'")
    accepts_seq_len = "seq_len" in inspect.signature(fn).parameters
    if seq_len is not None and not accepts_seq_len:
        raise ModelSpecError(f"--seq-len was given but {fn_name}() takes no seq_len argument: add one or drop --seq-len")
    workload = fn(seq_len=seq_len) if accepts_seq_len and seq_len is not None else fn()
    if not isinstance(workload, Workload):
        raise ModelSpecError(f"{spec} returned {type(workload).__name__}, not a batchfit.Workload")
    return workload
