"""The store: a path that holds no sweep is an error, never a new, empty store."""

from __future__ import annotations

import pytest

from batchfit.errors import OptionError
from batchfit.runs.store import Store
from batchfit.sweep.result import read_result


def test_reading_a_store_that_does_not_exist_is_an_error_and_creates_nothing(tmp_path):
    typo = tmp_path / "sweeep.db"
    with pytest.raises(OptionError, match=r"`store` .*sweeep.db does not exist: give the file a sweep wrote"):
        read_result(typo)
    assert list(tmp_path.iterdir()) == []


def test_reading_a_file_that_is_not_a_store_is_an_error(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a database\n" * 100)
    with pytest.raises(OptionError, match="is not a batchfit sweep store"):
        read_result(notes)
    assert notes.read_text() == "not a database\n" * 100


def test_a_store_a_sweep_wrote_reads_back(tmp_path):
    with Store(tmp_path / "sweep.db") as store:
        store.set_config({"model": "m"}, {"budget": {"unit": "samples", "total": 8}, "workload": "m"})
        store.add_run(2, 0.1, 4)
    result = read_result(tmp_path / "sweep.db")
    assert [(r["batch_size"], r["status"], r["steps"]) for r in result.runs] == [(2, "pending", 4)]
