"""The trace cache: traced steps kept on disk, so the same model asked again is not traced again.

A traced point does not depend on the GPU asked about, its target or the limit: only on the
model, the step's options, the batch size, and the code that traced it. So each traced batch
size (its points at each depth, with their allocation streams) and each reserved replay (for a
given usable memory, cuBLAS workspace and allocator configuration) is written under
``$BATCHFIT_CACHE/traces/<key>/`` (the token cache's root, ``~/.cache/batchfit`` by default),
where the key digests everything the trace depends on: the model spec with the content of the
file it names, the options, the versions of batchfit, torch and transformers, and batchfit's own
source (a changed tracer never reads an old trace).

An entry is trusted only when it unpickles to the header it was written with (format, key,
name); anything else (a truncated file, another version's layout) is deleted and traced again.
Writes go to a temporary file in the same folder, then ``os.replace``: a reader sees the old
entry or the new one, never half of one, and two processes writing the same entry write the
same bytes. The folder is kept under ``MAX_BYTES``, the least recently read entries first.
Entries are pickles, read back only from the user's own cache folder (the trust of any file
there). Only workloads loaded from a spec (``Workload.cache_key``) are cached: a Python callable has no
content to key. ``batchfit cache clear`` empties it; ``--no-cache`` neither reads nor writes it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pickle
import re
import shutil
import sys
import tempfile
import time
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

FORMAT = 1
"""Bumped when an entry's layout changes (the source digest changes with it anyway)."""
MAX_BYTES = 2 << 30
"""The most the trace cache holds (2 GiB: a GRPO step's streams take about 5 MB a batch size)."""
_STALE_TMP_S = 3600
"""A temporary file this old was left by a killed writer."""


def cache_root() -> Path:
    """Where batchfit keeps what it computed once (traces here, tokens in ``runs/data.py``):
    $BATCHFIT_CACHE, else (unset or empty: ``BATCHFIT_CACHE=$d`` with ``d`` unset) ~/.cache/batchfit, not
    the working directory."""
    return Path(os.environ.get("BATCHFIT_CACHE", "").strip() or Path.home() / ".cache" / "batchfit")


def traces_dir() -> Path:
    return cache_root() / "traces"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


@lru_cache(maxsize=1)
def source_digest() -> str:
    """A digest of batchfit's own source files: any change to the tracer is a new key."""
    package = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


@lru_cache(maxsize=1)
def torch_version() -> str:
    """``torch.__version__``, read without importing torch where it is not imported yet (1-2 s):
    from torch/version.py, the file that sets it, else the installed package's metadata."""
    if "torch" in sys.modules:
        return str(sys.modules["torch"].__version__)
    spec = importlib.util.find_spec("torch")  # finds the package without running it
    folders = (spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", _read(Path(folder) / "version.py"), re.MULTILINE)
        if found:
            return found.group(1)
    return _version("torch") or "unknown"


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def versions() -> dict[str, str | None]:
    return {"python": sys.version.split()[0], "batchfit": _version("batchfit"), "torch": torch_version(),
            "transformers": _version("transformers"), "source": source_digest()}


class TraceCache:
    """The entries of one traced model under one set of options (one key)."""

    def __init__(self, key_material: dict[str, Any], folder: Path | None = None, max_bytes: int = MAX_BYTES) -> None:
        material = {"format": FORMAT, **key_material, "versions": versions()}
        self.key = hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:32]
        self.root = folder if folder is not None else traces_dir()
        self.folder = self.root / self.key
        self.max_bytes = max_bytes

    def _path(self, name: str) -> Path:
        return self.folder / f"{name}.pkl"

    def get(self, name: str) -> Any | None:
        """The entry ``name``, or None when there is none or it cannot be trusted (then it is removed)."""
        path = self._path(name)
        try:
            with path.open("rb") as file:
                header, value = pickle.load(file)
            if header != (FORMAT, self.key, name):
                raise ValueError(f"{path}: written for another key")
        except FileNotFoundError:
            return None
        except Exception:  # noqa: BLE001 - truncated, corrupted, another layout: never trusted
            path.unlink(missing_ok=True)
            return None
        try:
            os.utime(path)  # recently read: pruned last
        except OSError:  # pruned or cleared meanwhile by another process: the value read stands
            pass
        return value

    def put(self, name: str, value: Any) -> None:
        """Write the entry atomically; a cache that cannot be written (read-only, full) or a value
        that does not pickle is skipped: the answer is the same, only not kept."""
        temporary = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.folder, prefix=f".{name}.", suffix=".tmp", delete=False) as file:
                temporary = file.name
                pickle.dump(((FORMAT, self.key, name), value), file, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(temporary, self._path(name))
        except (OSError, pickle.PicklingError, TypeError, AttributeError):
            if temporary is not None:
                Path(temporary).unlink(missing_ok=True)
            return
        prune(self.root, self.max_bytes)


def prune(root: Path, max_bytes: int) -> None:
    """Remove the least recently read entries until the cache holds at most ``max_bytes``, and
    temporary files that killed writers left."""
    entries = []
    now = time.time()
    for path in root.glob("*/*"):
        try:
            stat = path.stat()
        except OSError:
            continue
        if path.suffix == ".tmp":
            if now - stat.st_mtime > _STALE_TMP_S:
                path.unlink(missing_ok=True)
            continue
        entries.append((stat.st_mtime, stat.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= max_bytes:
            break
        path.unlink(missing_ok=True)
        total -= size


def clear(root: Path | None = None) -> tuple[int, int]:
    """Empty the trace cache: (entries removed, bytes freed)."""
    root = root if root is not None else traces_dir()
    files = [p for p in root.glob("*/*") if p.is_file()]
    freed = sum(p.stat().st_size for p in files)
    shutil.rmtree(root, ignore_errors=True)
    return len(files), freed


def for_curve(cache_key: str | None, options_json: dict, *, by_depth: bool) -> TraceCache | None:
    """The cache of a single-device traced curve (estimate, probe's traced search); None when the
    workload has no key (built in Python) or ``--compile`` (what a compiled trace reports depends
    on dynamo's state, not only on the model)."""
    if cache_key is None or options_json.get("compile", "none") != "none":
        return None
    return TraceCache({"engine": "curve", "workload": cache_key, "options": options_json, "by_depth": by_depth,
                       "strategy": None})
