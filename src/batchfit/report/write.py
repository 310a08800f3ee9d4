"""Writing outputs all together or not at all: each file goes to a temporary name in its own
folder and is renamed over the old one (``os.replace``, atomic on one filesystem) only once
every file is written, JSON files last.

A kill or Ctrl-C while a report is written then leaves the previous run's files (or none)
and at most a hidden ``.<name>.tmp-<pid>`` file, never a new estimate.json beside an old
report.md or a truncated PNG; a JSON file that is new says every other output is new too.

    with staged_files() as files:
        files.text(folder / "report.md", markdown)
        files.write(folder / "memory.png", lambda path: fig.savefig(path))
        files.text(folder / "estimate.json", text)   # renamed last, whatever the order here
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path


class StagedFiles:
    """Files written to temporary names, renamed into place by :meth:`commit`."""

    def __init__(self) -> None:
        self._staged: list[tuple[Path, Path]] = []  # (temporary, final)

    def write(self, path: Path, writer: Callable[[Path], None]) -> Path:
        """``writer(temporary_path)`` writes the file; the temporary name keeps the suffix
        (matplotlib picks the format from it)."""
        path = Path(path)
        temporary = path.with_name(f".{path.stem}.tmp-{os.getpid()}-{len(self._staged)}{path.suffix}")
        self._staged.append((temporary, path))
        writer(temporary)
        return path

    def text(self, path: Path, text: str) -> Path:
        return self.write(path, lambda temporary: temporary.write_text(text))

    def commit(self) -> None:
        """Rename every file into place, JSON last."""
        for temporary, path in sorted(self._staged, key=lambda pair: pair[1].suffix == ".json"):
            os.replace(temporary, path)
        self._staged.clear()

    def discard(self) -> None:
        for temporary, _ in self._staged:
            with contextlib.suppress(OSError):
                temporary.unlink()
        self._staged.clear()


@contextlib.contextmanager
def staged_files() -> Iterator[StagedFiles]:
    """Every file written in the block is renamed into place at its end; if the block raises
    (an error, Ctrl-C), none is and the temporary files are removed."""
    files = StagedFiles()
    try:
        yield files
        files.commit()
    finally:
        files.discard()


def write_text_atomic(path: Path, text: str) -> Path:
    """One file, written whole or not at all."""
    with staged_files() as files:
        return files.text(path, text)
