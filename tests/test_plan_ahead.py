"""auto's rounds with sessions started ahead on an idle process (plan/by_bound.py, plan/workers.py's
Sessions): the rows traced and set aside are those of the rounds without, a session started ahead is
never traced twice, one the rule sets aside is stopped, and with one process nothing starts ahead.

The jobs are stand-ins on 1 GPU: each returns its one row (1 GPU, tokens/s, name) and logs when it
starts and ends; where asked, one waits until another has started (so that a round lasts until a
session has started ahead, whatever the machine's load) or runs until stopped."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from batchfit.errors import OptionError
from batchfit.plan import by_bound, workers

linux = pytest.mark.skipif(sys.platform != "linux", reason="processes are forked on Linux only")

BOUNDS = {"A": 100.0, "B": 90.0, "C": 80.0, "D": 75.0, "E": 70.0, "F": 65.0}
"""Rounds of 2 by hand: A, B (best 50); C, D (best 68 from C: F's 65 is below it, set aside); E alone."""
TOKENS = {"A": 50.0, "B": 40.0, "C": 68.0, "D": 60.0, "E": 66.0, "F": 64.0}


class Standin:
    def __init__(self, log: Path, bounds: dict[str, float], tokens: dict[str, float], *, waits: dict[str, str],
                 lasts: tuple[str, ...] = (), fails: tuple[str, ...] = (), after: dict | None = None) -> None:
        self.log, self.bounds, self.tokens, self.waits = log, dict(bounds), tokens, waits
        self.lasts, self.fails = lasts, fails
        self.after = after or {}
        """Bounds that change once a job's result is learnt: {job: {other: bound}}."""
        self.jobs = [(1, name, ()) for name in bounds]
        self.learnt: list[str] = []
        self.forked = False

    def starts(self, name: str) -> int:
        return self.log.read_text().splitlines().count(f"start {name}") if self.log.exists() else 0

    def _write(self, line: str) -> None:
        with open(self.log, "a") as file:
            file.write(line + "\n")

    def one(self, job, say):
        name = job[1]
        first = self.starts(name) == 0
        self._write(f"start {name}")
        say(f"{name} on 1 GPU: local batch 1")
        if self.forked and name in self.waits:  # the round lasts until a session has started ahead
            deadline = time.monotonic() + 60
            while not self.starts(self.waits[name]) and time.monotonic() < deadline:
                time.sleep(0.01)
        if name in self.fails:
            raise OptionError(f"{name} cannot be traced")
        if self.forked and name in self.lasts and first:
            time.sleep(60)  # until stopped
        self._write(f"end {name}")
        return [(1, self.tokens[name], name)]

    def learn(self, job, rows) -> bool:
        self.learnt.append(job[1])
        self.bounds.update(self.after.get(job[1], {}))
        return True

    def foresee(self, done: list) -> Callable:
        """The bounds once the results ``done`` are learnt too, on a copy."""
        bounds = dict(self.bounds)
        for job, _ in done:
            bounds.update(self.after.get(job[1], {}))
        return lambda job: bounds[job[1]]

    def plan(self, processes: int, foresee: bool = False) -> tuple[list, dict, list[str]]:
        """auto's rounds of 2 over these jobs, their sessions ``processes`` at once."""
        said: list[str] = []
        self.log.unlink(missing_ok=True)
        self.learnt, bounds = [], dict(self.bounds)
        with workers.Sessions(self.one, self.jobs, said.append, processes=processes,
                              label=lambda job: job[1]) as sessions:
            self.forked = sessions.forked
            results, aside = by_bound.rounds_run(sessions, self.jobs, lambda job: self.bounds[job[1]],
                                                 lambda job: job[0], lambda rows: rows, self.learn, processes=2,
                                                 say=said.append, foresee=self.foresee if foresee else None)
        self.bounds = bounds
        return results, aside, said

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines()


def _rows(*names: str) -> list:
    return [[(1, TOKENS[name], name)] if name in names else None for name in BOUNDS]


@linux
def test_sessions_started_ahead_give_the_rows_of_the_rounds_without(tmp_path):
    # round 2: D is done first, so E and then F start ahead on the idle process; C (the round's slowest)
    # ends once F has started. The rule then takes E (70, not below C's 68), done already, and sets F aside
    standin = Standin(tmp_path / "log", BOUNDS, TOKENS, waits={"C": "F"}, lasts=("F",))
    alone = standin.plan(processes=1)
    results, aside, said = standin.plan(processes=2)
    assert (results, aside) == alone[:2]
    assert results == _rows("A", "B", "C", "D", "E") and aside == {5: (68.0, "C", 65.0)}
    assert standin.learnt == ["A", "B", "C", "D", "E"]  # the rule read the rows in the same order
    lines = standin.lines()
    assert lines.count("start E") == 1 and "end E" in lines  # started ahead, used as it is: never traced twice
    assert lines.count("start F") == 1 and "end F" not in lines  # set aside: stopped, not waited for
    assert "E: started ahead of its round on an idle process (used as it is if a round takes it)" in said
    assert "E: this round takes it, started ahead (done)" in said
    assert "F: its session started ahead is stopped (set aside by its bound)" in said
    assert "E on 1 GPU: local batch 1 [started ahead]" in said  # its lines come back meanwhile, tagged


@linux
def test_a_session_started_ahead_that_fails_raises_only_if_a_round_takes_it(tmp_path):
    standin = Standin(tmp_path / "log", BOUNDS, TOKENS, waits={"C": "F"}, fails=("F",))
    results, aside, _ = standin.plan(processes=2)
    assert results == _rows("A", "B", "C", "D", "E") and list(aside) == [5]  # F failed, and was set aside
    assert "start F" in standin.lines()
    standin = Standin(tmp_path / "log", BOUNDS, TOKENS, waits={"C": "F"}, fails=("E",))
    with pytest.raises(OptionError, match="E cannot be traced"):
        standin.plan(processes=2)


@linux
def test_a_session_started_ahead_gives_its_process_to_the_round_that_needs_it(tmp_path):
    # round 1: B is done first, so X (the next by bound) starts ahead, and runs on; A's row brings X's
    # bound below Y's and Z's, so round 2 takes Y and Z: X is stopped for them, and traced again later
    bounds = {"A": 100.0, "B": 90.0, "X": 80.0, "Y": 79.0, "Z": 78.0}
    tokens = {"A": 10.0, "B": 9.0, "X": 5.0, "Y": 6.0, "Z": 7.0}
    standin = Standin(tmp_path / "log", bounds, tokens, waits={"A": "X"}, lasts=("X",), after={"A": {"X": 77.0}})
    alone, learnt_alone = standin.plan(processes=1), standin.learnt
    results, aside, said = standin.plan(processes=2)
    assert (results, aside) == alone[:2] and aside == {}
    assert standin.learnt == learnt_alone == ["A", "B", "Y", "Z", "X"]
    lines = standin.lines()
    assert lines.count("start X") == 2 and lines.count("end X") == 1
    assert any(m.startswith("X: its session started ahead is stopped (this round needs its process") for m in said)


@linux
@pytest.mark.parametrize("foresee", [True, False])
def test_the_guess_reads_the_rows_done_so_far(tmp_path, foresee):
    # round 1: A is done first, and its row brings P's bound (80) to 45, below A's 50: the rule will set P
    # aside. Read by foresee, the guess starts Q ahead; without it, P (the higher bound at the round's start),
    # which round 2 then stops
    bounds, tokens = {"A": 100.0, "B": 90.0, "P": 80.0, "Q": 79.0}, {"A": 50.0, "B": 40.0, "P": 1.0, "Q": 60.0}
    waits = {"B": "Q" if foresee else "P"}
    standin = Standin(tmp_path / "log", bounds, tokens, waits=waits, lasts=("P",), after={"A": {"P": 45.0}})
    alone = standin.plan(processes=1)
    results, aside, said = standin.plan(processes=2, foresee=foresee)
    assert (results, aside) == alone[:2] and aside == {2: (50.0, "A", 45.0)}
    lines = standin.lines()
    assert lines.count("start Q") == 1 and lines.count("start P") == (0 if foresee else 1) and "end P" not in lines
    assert ("P: its session started ahead is stopped (set aside by its bound)" in said) is not foresee


@linux
@pytest.mark.parametrize("how", ["one process", "BATCHFIT_PROCESSES=1"])
def test_with_one_process_nothing_starts_ahead(tmp_path, monkeypatch, how):
    if how == "BATCHFIT_PROCESSES=1":
        monkeypatch.setenv("BATCHFIT_PROCESSES", "1")
    standin = Standin(tmp_path / "log", BOUNDS, TOKENS, waits={"C": "F"}, lasts=("F",))
    results, aside, said = standin.plan(processes=1 if how == "one process" else 2)
    assert results == _rows("A", "B", "C", "D", "E") and list(aside) == [5]
    assert standin.lines() == [f"{when} {name}" for name in "ABCDE" for when in ("start", "end")]  # one by one
    assert not any("ahead" in m for m in said)


@pytest.mark.slow
@linux
def test_an_auto_plan_on_two_processes_is_the_plan_on_one(tmp_path):
    # the real tracer: a 1-layer Llama on 2 GPUs, every candidate's session on the engine's Sessions
    import json

    from typer.testing import CliRunner

    from batchfit.cli.app import app
    from tiny import TINY_LLAMA_FILE

    (tmp_path / "tiny.py").write_text(TINY_LLAMA_FILE)

    def plan(processes: str) -> tuple[dict, str]:
        out = CliRunner().invoke(app, ["plan", f"{tmp_path / 'tiny.py'}:workload", "--gpu", "h100-80gb", "--gpus", "2",
                                       "--strategies", "auto", "--precision", "bf16-mixed", "--batch-sizes", "1,2",
                                       "--max-batch", "2", "--limit", "allocated", "--no-cache", "--processes",
                                       processes, "--json", str(tmp_path / f"{processes}.json"),
                                       "--out", str(tmp_path / processes)])
        assert out.exit_code == 0, out.output
        data = json.loads((tmp_path / f"{processes}.json").read_text())
        del data["created"], data["trace_seconds"]
        return data, out.output

    (two, said), (one, _) = plan("2"), plan("1")
    assert two == one
    assert "tracing 2 strategy sessions, 2 at a time" in said
