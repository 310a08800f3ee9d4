"""The sweep's store: one SQLite file (stdlib ``sqlite3``) that every worker writes to.

    sweep(key, value)   the configuration (JSON) and its hash, written once
    runs                one row per (batch size, learning rate): status, steps, losses, timings
    curve               (run, step, split) -> loss, with tokens and samples at that step

Processes share it through SQLite's own locking (WAL journal, a busy timeout), so the local
executor's workers and Ray's tasks on this machine write to the same file. A store holding
another sweep is never written to: opening it with a different configuration raises, before
anything changes.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from batchfit.errors import OptionError

STATUSES: tuple[str, ...] = ("pending", "running", "done", "oom", "error")
RUN_FIELDS: tuple[str, ...] = (
    "id", "batch_size", "lr", "status", "steps", "steps_done", "micro_batch", "accumulation_steps", "tokens",
    "samples", "initial_val_loss", "final_train_loss", "final_val_loss", "best_val_loss", "seconds", "error",
    "note", "started", "finished", "worker")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sweep (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY, batch_size INTEGER NOT NULL, lr REAL NOT NULL, status TEXT NOT NULL,
    steps INTEGER, steps_done INTEGER DEFAULT 0, micro_batch INTEGER, accumulation_steps INTEGER,
    tokens INTEGER, samples INTEGER, initial_val_loss REAL, final_train_loss REAL, final_val_loss REAL,
    best_val_loss REAL, seconds REAL DEFAULT 0, error TEXT, note TEXT, started REAL, finished REAL, worker TEXT,
    UNIQUE (batch_size, lr));
CREATE TABLE IF NOT EXISTS curve (
    run_id INTEGER NOT NULL REFERENCES runs(id), step INTEGER NOT NULL, split TEXT NOT NULL,
    tokens INTEGER, samples INTEGER NOT NULL, loss REAL NOT NULL, lr REAL,
    PRIMARY KEY (run_id, step, split));
"""


def config_hash(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def _differences(old: dict, new: dict) -> list[str]:
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def check_store(path: Path, config: dict, *, resume: bool) -> None:
    """Refuse, before writing anything, a store that holds another sweep.

    ``config`` is what decides a run's numbers (model, data, budget, schedule, seed...):
    with ``resume`` it must equal the stored one (new batch sizes or learning rates may be
    added); without ``resume`` a store that already holds runs is refused.
    """
    if not path.exists():
        return
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=60) as db:
            row = db.execute("SELECT value FROM sweep WHERE key = 'config'").fetchone()
            runs = db.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
    except sqlite3.DatabaseError as error:
        raise OptionError(f"--store {path} is not a batchfit sweep store ({error}): give a new --store") from None
    if row is None:
        return
    old = json.loads(row[0])
    differ = _differences(old, config)
    if differ:
        raise OptionError(
            f"--store {path} holds a different sweep (it differs in {', '.join(differ)}): give a new --store, "
            "or the options it was made with" + ("" if resume else " and --resume"))
    if runs and not resume:
        raise OptionError(f"--store {path} already holds this sweep: add --resume to finish it (runs that are "
                          "done are kept), or give a new --store")


class Store:
    """The open store; short transactions so that many processes can write."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.db = sqlite3.connect(self.path, timeout=120, isolation_level=None)
        self.db.execute("PRAGMA busy_timeout = 120000")
        self.db.execute("PRAGMA journal_mode = WAL")
        self.db.executescript(_SCHEMA)

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    # --- the sweep's configuration ---------------------------------------------------------
    def set_config(self, config: dict, extra: dict | None = None) -> None:
        """Write the configuration the first time (``check_store`` has refused any other)."""
        with self._write() as db:
            db.execute("INSERT OR IGNORE INTO sweep VALUES ('config', ?)", (json.dumps(config, sort_keys=True),))
            db.execute("INSERT OR IGNORE INTO sweep VALUES ('created', ?)", (str(time.time()),))
            for key, value in (extra or {}).items():
                db.execute("INSERT OR REPLACE INTO sweep VALUES (?, ?)", (key, json.dumps(value)))

    def meta(self, key: str) -> object | None:
        row = self.db.execute("SELECT value FROM sweep WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0]) if key != "created" else float(row[0])

    # --- runs --------------------------------------------------------------------------------
    def add_run(self, batch_size: int, lr: float, steps: int) -> int:
        """The run's id, creating it as pending if it is new."""
        with self._write() as db:
            db.execute("INSERT OR IGNORE INTO runs (batch_size, lr, status, steps) VALUES (?, ?, 'pending', ?)",
                       (batch_size, lr, steps))
            return db.execute("SELECT id FROM runs WHERE batch_size = ? AND lr = ?", (batch_size, lr)).fetchone()[0]

    def update_run(self, run_id: int, **fields) -> None:
        unknown = set(fields) - set(RUN_FIELDS)
        if unknown:
            raise ValueError(f"unknown run fields {unknown}")
        columns = ", ".join(f"{k} = ?" for k in fields)
        with self._write() as db:
            db.execute(f"UPDATE runs SET {columns} WHERE id = ?", (*fields.values(), run_id))

    def run(self, run_id: int) -> dict:
        row = self.db.execute(f"SELECT {', '.join(RUN_FIELDS)} FROM runs WHERE id = ?", (run_id,)).fetchone()
        return dict(zip(RUN_FIELDS, row))

    def runs(self) -> list[dict]:
        rows = self.db.execute(f"SELECT {', '.join(RUN_FIELDS)} FROM runs ORDER BY batch_size, lr").fetchall()
        return [dict(zip(RUN_FIELDS, r)) for r in rows]

    # --- curves --------------------------------------------------------------------------------
    def add_point(self, run_id: int, step: int, split: str, samples: int, tokens: int | None, loss: float,
                  lr: float | None = None) -> None:
        with self._write() as db:
            db.execute("INSERT OR REPLACE INTO curve VALUES (?, ?, ?, ?, ?, ?, ?)",
                       (run_id, step, split, tokens, samples, loss, lr))

    def drop_points_after(self, run_id: int, step: int) -> None:
        """Forget what a killed run recorded after its last checkpoint (it is recomputed)."""
        with self._write() as db:
            db.execute("DELETE FROM curve WHERE run_id = ? AND step > ?", (run_id, step))

    def curve(self, run_id: int, split: str = "val") -> list[dict]:
        rows = self.db.execute("SELECT step, samples, tokens, loss, lr FROM curve WHERE run_id = ? AND split = ? "
                               "ORDER BY step", (run_id, split)).fetchall()
        return [dict(zip(("step", "samples", "tokens", "loss", "lr"), r)) for r in rows]
