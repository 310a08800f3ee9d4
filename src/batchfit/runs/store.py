"""The store of runs: one SQLite file (stdlib ``sqlite3``) that every worker writes to, shared
by ``batchfit sweep`` (a run per batch size and rate) and ``batchfit recommend`` (a run per
branch: the same columns, ``branch`` naming its branch point and data window).

    sweep(key, value)   the configuration (JSON) and its hash, written once
    runs                one row per (batch size, learning rate, branch): status, steps, losses, timings
    curve               (run, step, split) -> loss, with tokens and samples at that step

Processes on one machine share it through SQLite's own locking (WAL journal, a busy
timeout): the local executor's workers write to the same file. SQLite's WAL needs shared
memory, so the file must not be on a network filesystem: Ray tasks write to a store of their
own on their node and the driver writes their runs back (``write_back``). A store holding
another sweep is never written to: opening it with a different configuration raises, before
anything changes.

A run is trained by whoever *claims* it (``claim``: one UPDATE that succeeds for one claimer
only), so two sweeps on one store never train the same run; Ctrl-C gives the claimed runs
back (``release``), and ``reclaim_stale`` frees the runs of a sweep process that was killed.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sqlite3
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

from batchfit.errors import OptionError

STATUSES: tuple[str, ...] = ("pending", "running", "done", "oom", "error")
RUN_FIELDS: tuple[str, ...] = (
    "id", "batch_size", "lr", "status", "steps", "steps_done", "micro_batch", "accumulation_steps", "tokens",
    "samples", "initial_val_loss", "final_train_loss", "final_val_loss", "best_val_loss", "seconds", "error",
    "note", "started", "finished", "worker", "owner", "branch")
CLAIMABLE: tuple[str, ...] = ("pending", "oom", "error")
"""A run in one of these states may be (re)trained; 'done' never is, 'running' is someone's."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sweep (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY, batch_size INTEGER NOT NULL, lr REAL NOT NULL, status TEXT NOT NULL,
    steps INTEGER, steps_done INTEGER DEFAULT 0, micro_batch INTEGER, accumulation_steps INTEGER,
    tokens INTEGER, samples INTEGER, initial_val_loss REAL, final_train_loss REAL, final_val_loss REAL,
    best_val_loss REAL, seconds REAL DEFAULT 0, error TEXT, note TEXT, started REAL, finished REAL, worker TEXT,
    owner TEXT, branch TEXT NOT NULL DEFAULT '', UNIQUE (batch_size, lr, branch));
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
        raise OptionError(f"`store` {path} is not a batchfit sweep store ({error}): give a new `store`") from None
    if row is None:
        return
    old = json.loads(row[0])
    differ = _differences(old, config)
    if differ:
        raise OptionError(
            f"`store` {path} holds a different sweep (it differs in {', '.join(differ)}): give a new `store`, "
            "or the options it was made with" + ("" if resume else " and `resume`"))
    if runs and not resume:
        raise OptionError(f"`store` {path} already holds this sweep: add `resume` to finish it (runs that are "
                          "done are kept), or give a new `store`")


def owner_id() -> str:
    """Who claims runs: this machine and process, e.g. 'node7:4242'."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _alive(owner: str) -> bool:
    """Whether the sweep process that claimed a run still runs (unknown: another machine's)."""
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _check_existing(path: Path) -> None:
    if not path.exists():
        raise OptionError(f"`store` {path} does not exist: give the file a sweep wrote (batchfit sweep ... "
                          "`store` sweep.db), e.g. `store` sweep.db")
    try:
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=60)) as db:
            db.execute("SELECT value FROM sweep WHERE key = 'config'").fetchone()
            db.execute("SELECT COUNT(*) FROM runs").fetchone()
    except sqlite3.DatabaseError as error:
        raise OptionError(f"`store` {path} is not a batchfit sweep store ({error}): give the file a sweep "
                          "wrote, e.g. `store` sweep.db") from None


class Store:
    """The open store; short transactions so that many processes can write."""

    def __init__(self, path: Path | str, *, create: bool = True) -> None:
        """Open (``create``: or make) the store at ``path``; without ``create`` a path that holds
        no sweep store raises OptionError, so a typo is not a new, empty store."""
        self.path = Path(path)
        if not create:
            _check_existing(self.path)
        self.db = sqlite3.connect(self.path, timeout=120, isolation_level=None)
        self.db.execute("PRAGMA busy_timeout = 120000")
        self.db.execute("PRAGMA journal_mode = WAL")
        self.db.executescript(_SCHEMA)
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(runs)")}
        if "owner" not in columns:  # a store made before runs were claimed
            self.db.execute("ALTER TABLE runs ADD COLUMN owner TEXT")
        if "branch" not in columns:  # a sweep's store made before branches shared it: sweep runs only
            self.db.execute("ALTER TABLE runs ADD COLUMN branch TEXT NOT NULL DEFAULT ''")

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
    def add_run(self, batch_size: int, lr: float, steps: int, branch: str = "") -> int:
        """The run's id, creating it as pending if it is new; ``branch`` names a recommend
        branch ('' for a sweep's run)."""
        with self._write() as db:
            db.execute("INSERT OR IGNORE INTO runs (batch_size, lr, status, steps, branch) VALUES (?, ?, "
                       "'pending', ?, ?)",
                       (batch_size, lr, steps, branch))
            return db.execute("SELECT id FROM runs WHERE batch_size = ? AND lr = ? AND branch = ?",
                              (batch_size, lr, branch)).fetchone()[0]

    def update_run(self, run_id: int, **fields) -> None:
        unknown = set(fields) - set(RUN_FIELDS)
        if unknown:
            raise ValueError(f"unknown run fields {unknown}")
        columns = ", ".join(f"{k} = ?" for k in fields)
        with self._write() as db:
            db.execute(f"UPDATE runs SET {columns} WHERE id = ?", (*fields.values(), run_id))

    def claim(self, run_id: int, owner: str) -> bool:
        """Take the run for ``owner`` (this process: ``owner_id()``): True for exactly one of
        any number of claimers, False when it is done or another sweep is training it."""
        marks = ", ".join("?" * len(CLAIMABLE))
        with self._write() as db:
            cursor = db.execute(f"UPDATE runs SET status = 'running', owner = ? WHERE id = ? AND status IN ({marks})",
                                (owner, run_id, *CLAIMABLE))
            return cursor.rowcount == 1

    def release(self, run_ids: list[int], owner: str) -> int:
        """Give back runs ``owner`` claimed and did not finish (Ctrl-C): they are pending again,
        and --resume continues them from their checkpoints. Returns how many."""
        if not run_ids:
            return 0
        marks = ", ".join("?" * len(run_ids))
        with self._write() as db:
            return db.execute(f"UPDATE runs SET status = 'pending', owner = NULL WHERE status = 'running' AND "
                              f"owner = ? AND id IN ({marks})", (owner, *run_ids)).rowcount

    def reclaim_stale(self) -> list[int]:
        """Runs left 'running' by a sweep process of this machine that is gone (``kill -9``, a
        crash), or by a store of an older batchfit (no owner): pending again. Returns their ids."""
        stale = []
        with self._write() as db:
            for run_id, owner in db.execute("SELECT id, owner FROM runs WHERE status = 'running'").fetchall():
                if owner is None or not _alive(owner):
                    stale.append(run_id)
            for run_id in stale:
                db.execute("UPDATE runs SET status = 'pending', owner = NULL WHERE id = ?", (run_id,))
        return stale

    def write_back(self, row: dict, points: list[dict]) -> None:
        """A run trained elsewhere (a Ray task's own store): its row and its whole curve, in
        one transaction."""
        fields = {k: v for k, v in row.items() if k in RUN_FIELDS and k not in ("id", "owner", "branch")}
        columns = ", ".join(f"{k} = ?" for k in fields)
        with self._write() as db:
            db.execute(f"UPDATE runs SET {columns} WHERE id = ?", (*fields.values(), row["id"]))
            db.execute("DELETE FROM curve WHERE run_id = ?", (row["id"],))
            db.executemany("INSERT INTO curve VALUES (?, ?, ?, ?, ?, ?, ?)",
                           [(row["id"], p["step"], p["split"], p["tokens"], p["samples"], p["loss"], p["lr"])
                            for p in points])

    def points(self, run_id: int) -> list[dict]:
        """Every curve point of a run, both splits."""
        rows = self.db.execute("SELECT step, split, samples, tokens, loss, lr FROM curve WHERE run_id = ? "
                               "ORDER BY step, split", (run_id,)).fetchall()
        return [dict(zip(("step", "split", "samples", "tokens", "loss", "lr"), r)) for r in rows]

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
