"""Where a recommendation keeps what it has done, so a killed run resumes with the same numbers.

A folder: ``config.json`` (what decides the numbers: a folder made with other settings is
refused), ``point-<n>.pt`` (the parent's whole state at branch point n: model, optimizer, RNG,
data position, its curve so far) and ``branch-<point>-<window>-<batch>-<lr>.json`` (a finished
branch's curve). Every file is written whole to a temporary name and renamed, so a ``kill -9``
leaves the old file or the new one. A resumed run starts from the last saved point, restores it
exactly and trains only the branches that have no file; on a CPU the result is the same as a
run that was never stopped (``tests/test_recommend.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from batchfit.errors import UsageError
from batchfit.recommend.branch import Curve, Snapshot


class BranchStore:
    def __init__(self, folder: Path | str, identity: dict) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / "config.json"
        if path.exists():
            saved = json.loads(path.read_text())
            if saved != identity:
                changed = sorted(k for k in set(saved) | set(identity) if saved.get(k) != identity.get(k))
                raise UsageError(f"--store {self.folder} holds a recommendation with other settings "
                                 f"({', '.join(changed)}): give another --store, or the same settings to resume")
        else:
            self._write_text(path, json.dumps(identity, indent=2, sort_keys=True))

    def _write_text(self, path: Path, text: str) -> None:
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)

    def save_point(self, n: int, snap: Snapshot, parent: Curve) -> None:
        path = self.folder / f"point-{n}.pt"
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save({"samples": snap.samples, "model": snap.model, "optimizer": snap.optimizer, "rng": snap.rng,
                    "parent": parent.__dict__}, tmp)
        os.replace(tmp, path)

    def last_point(self) -> tuple[int, Snapshot, Curve] | None:
        saved = sorted(self.folder.glob("point-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
        if not saved:
            return None
        data = torch.load(saved[-1], map_location="cpu", weights_only=False)
        parent = Curve(**data["parent"])
        snap = Snapshot(samples=data["samples"], model=data["model"], optimizer=data["optimizer"], rng=data["rng"])
        return int(saved[-1].stem.split("-")[1]), snap, parent

    def _branch_path(self, point: int, seed: int, b: int, lr: float) -> Path:
        return self.folder / f"branch-{point}-{seed}-{b}-{lr!r}.json"

    def branch(self, point: int, seed: int, b: int, lr: float) -> Curve | None:
        path = self._branch_path(point, seed, b, lr)
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        return Curve(batch_size=data["batch_size"], lr=data["lr"], start_samples=data["start_samples"],
                     train=[tuple(x) for x in data["train"]], val=[tuple(x) for x in data["val"]])

    def save_branch(self, point: int, seed: int, curve: Curve) -> None:
        self._write_text(self._branch_path(point, seed, curve.batch_size, curve.lr), json.dumps(curve.__dict__))
