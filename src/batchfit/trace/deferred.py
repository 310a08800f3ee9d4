"""A workload asked about again, known from the trace cache without loading it.

Loading a zoo model or an ``hf:`` config imports torch (1-2 s of a 2-core machine) before
anything is traced; a question whose traces are all in the cache (``trace/cache.py``) needs
none of it. So ``load_deferred`` keeps, beside the traces, what the engines read of a loaded
workload without calling it (its name, description, tokens per sample, group size, attention,
and which of its functions it has), and, asked for the same spec again, returns a Workload
with those figures whose functions load the real one on their first call. ``TracedCurve``
opens the real one (``resolved``) before it traces anything, so every trace runs the
workload's own functions, not stand-ins.

Deferred: zoo names and ``hf:`` specs, whose key needs no loading (``specs.spec_key``); a
``file.py:function`` is loaded as before (its module is the user's code, which imports torch anyway).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchfit.specs import load_workload, spec_key
from batchfit.trace import cache as trace_cache
from batchfit.workload import Workload

_PLAIN = (str, int, float, bool, type(None))


class _Deferred:
    """A workload function that loads the workload on its first call, then calls its own."""

    def __init__(self, load: Callable[[], Workload], name: str) -> None:
        self.load, self.name = load, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.load(), self.name)(*args, **kwargs)


def _key_path(spec: str) -> Path | None | bool:
    """The file ``spec_key`` digests for ``spec``; False when the spec is not deferred."""
    if spec.startswith("hf:"):
        return Path(spec[3:]).expanduser()
    return None if ":" not in spec else False


def load_deferred(spec: str, *, seq_len: int | None = None, cache: bool = True) -> Workload:
    """``load_workload(spec, seq_len=seq_len)``, deferred where the trace cache knows its figures
    (written on the first load; ``cache=False``, ``--no-cache``, neither reads nor writes them)."""
    path = _key_path(spec)
    if not cache or path is False:
        return load_workload(spec, seq_len=seq_len)
    store = trace_cache.TraceCache({"engine": "workload", "workload": spec_key(spec, seq_len, path)})
    facts = store.get("facts")
    if facts is None:
        workload = load_workload(spec, seq_len=seq_len)
        facts = _facts(workload)
        if facts is not None:
            store.put("facts", facts)
        return workload
    loaded: list[Workload] = []

    def load() -> Workload:
        if not loaded:
            loaded.append(load_workload(spec, seq_len=seq_len))
        return loaded[0]

    plain, functions = facts
    return Workload(**plain, **{name: _Deferred(load, name) for name in functions})


def _facts(workload: Workload) -> tuple[dict[str, Any], list[str]] | None:
    """(its plain fields, the names of the functions it has), or None when a field is neither
    (nothing to keep: it is loaded each time)."""
    plain, functions = {}, []
    for field in dataclasses.fields(workload):
        value = getattr(workload, field.name)
        if isinstance(value, _PLAIN):
            plain[field.name] = value
        elif callable(value):
            functions.append(field.name)
        else:
            return None
    return plain, functions


def resolved(workload: Workload) -> Workload:
    """The loaded workload behind a deferred one, with every field set on it since (a copy made by
    ``dataclasses.replace`` too: ``trace.depth.at_depth``'s), else ``workload`` itself."""
    values = {field.name: getattr(workload, field.name) for field in dataclasses.fields(workload)}
    deferred = [value for value in values.values() if isinstance(value, _Deferred)]
    if not deferred:
        return workload
    kept = {name: value for name, value in values.items() if not isinstance(value, _Deferred)}
    return dataclasses.replace(deferred[0].load(), **kept)
