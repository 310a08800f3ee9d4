"""``plan --strategies auto`` traces its candidates in the order of what they could reach, and stops.

Each candidate has a bound on its tokens/s before it is traced (``plan/speed_bound.py``), which the
rows traced so far tighten (their FLOPs per token; TP's collective floor once a TP row held it). The
candidates are traced in rounds of one per process (as many as cores, at once), the highest bounds
first (ties in the order ``plan/candidates.py`` lists them: the data-parallel wraps first). Before each
round, a candidate whose bound is below the best tokens/s traced on its GPU
count cannot be ranked first there, and is not traced: its row says so, with the bound and its
formula. So the bounds never change the answer: the best row is the one a plan that traced every
candidate would rank first. Which rows are traced depends only on the bounds and the traced figures,
never on timing. A candidate without a bound (None) is traced first.

A round waits for its slowest session; meanwhile a process it leaves idle starts ahead the candidate the
next round would take first by what is known then (``plan/workers.py``'s ``Sessions``). The rule alone
still decides each round: a candidate it takes is used as traced ahead (a session depends on its job
only, not on when it starts), one it sets aside is stopped. So timing changes when a session starts,
never which rows are traced.

Each traced row is checked against the floors (``speed_bound.Evidence.learn``): where one falls below a
floor that a candidate was set aside by, nothing is set aside any more, and what was is traced after all.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

from batchfit.plan.workers import Sessions

INFINITY = float("inf")


def rounds_run(sessions: Sessions | Callable[[list], list], jobs: Sequence, bound: Callable[[Any], float | None],
               gpus_of: Callable[[Any], int], best_of: Callable[[Any], list[tuple[int, float, str]]],
               learn: Callable[[Any, Any], bool], *, processes: int, say: Callable[[str], None],
               set_aside: Callable[[Any], None] = lambda job: None,
               foresee: Callable[[list], Callable[[Any], float | None]] | None = None,
               ) -> tuple[list, dict[int, tuple[float, str, float]]]:
    """The jobs run by ``sessions`` (of these ``jobs``) in rounds (the module docstring): each job's result, or
    None for a job set aside, and for each set-aside job's index the best (tokens/s, strategy) on its GPU count
    and its bound then. ``sessions`` may also be ``run(some_jobs) -> their results`` (nothing starts ahead).

    ``bound(job)``: what is known now (re-read before each round); ``gpus_of(job)``;
    ``best_of(result) -> [(gpus, tokens/s, strategy)]`` for each of its rows that fits;
    ``learn(job, result)``: read a result, False once a row broke what the bounds rest on (then every job
    set aside is traced after all); ``set_aside(job)``: a job is set aside now.

    While a round runs, a process it leaves idle starts ahead the job the next round would take first by what
    is known then (``_next_round``): the rows of the round's jobs done so far, and the bounds
    ``foresee([(job, result), ...])`` gives once these are read too (without: this round's bounds). The rule
    above alone still says what the next round takes: it uses such a job as it is (the same session, whenever
    it starts), and one it sets aside is stopped, so the rows traced and set aside are the same as without."""
    if not isinstance(sessions, Sessions):
        sessions = _Batches(sessions, jobs)
    order = list(range(len(jobs)))
    results: list = [None] * len(jobs)
    aside: dict[int, tuple[float, str, float]] = {}
    best: dict[int, tuple[float, str]] = {}
    pruning = True
    while order:
        bounds = {i: bound(jobs[i]) for i in order} if pruning else {}
        order.sort(key=lambda i: -(INFINITY if bounds.get(i) is None else bounds[i]))
        for i in list(order) if pruning else ():
            floor = best.get(gpus_of(jobs[i]))
            if _below(bounds[i], floor):
                aside[i] = (*floor, bounds[i])
                set_aside(jobs[i])
                order.remove(i)
                if sessions.drop(i):
                    say(f"{sessions.label(jobs[i])}: its session started ahead is stopped (set aside by its bound)")
        if not order:
            break
        # one job per process (the rows they trace tighten the others' bounds), all that are left once nothing is
        # set aside any more
        count = processes if pruning else len(order)
        chosen, order = order[:count], order[count:]
        ahead = _next_round(list(order), bounds, dict(best), jobs, gpus_of, best_of, count,
                            foresee) if pruning else None  # once every job is in a round, none is left to start
        for i, result in zip(chosen, sessions.run(chosen, ahead)):
            results[i] = result
            _raise_best(best, result, best_of)
            if not learn(jobs[i], result) and pruning:
                pruning = False
                say(f"{_name(jobs[i])}: a traced row fell below the floor the bounds rest on; "
                    f"every candidate is traced{f', {len(aside)} set aside so far included' if aside else ''}")
                order += sorted(aside)
                aside.clear()
    return results, aside


class _Batches:
    """Rounds run by ``run(some_jobs) -> their results``, as :class:`Sessions` would run them without processes."""

    def __init__(self, run: Callable[[list], list], jobs: Sequence) -> None:
        self._run, self._jobs = run, jobs

    def run(self, indices: list[int], ahead=None) -> list:
        return self._run([self._jobs[i] for i in indices])

    def drop(self, index: int) -> bool:
        return False  # none started ahead


def _below(bound: float | None, floor: tuple[float, str] | None) -> bool:
    """A bound below the best (tokens/s, strategy) traced on its GPU count: it cannot be ranked first."""
    return bound is not None and floor is not None and bound < floor[0]


def _raise_best(best: dict[int, tuple[float, str]], result, best_of: Callable) -> None:
    """The best (tokens/s, strategy) on each GPU count, with ``result``'s rows."""
    for gpus, tokens_per_s, name in best_of(result):
        if tokens_per_s > best.get(gpus, (0.0, ""))[0]:
            best[gpus] = (tokens_per_s, name)


def _next_round(order: list[int], bounds: dict, best: dict, jobs: Sequence, gpus_of: Callable, best_of: Callable,
                count: int, foresee: Callable | None) -> Callable[[dict[int, Any]], list[int]]:
    """``ahead(done)``: the ``count`` jobs of ``order`` the next round would take if this round's results were
    ``done`` (by index, so far): the highest bounds (``foresee``'s once ``done`` is read, else this round's) not
    below the best traced on their GPU count. A guess: the rule decides at the round's end."""

    def ahead(done: dict[int, Any]) -> list[int]:
        known = dict(best)
        for result in done.values():
            _raise_best(known, result, best_of)
        now = bounds
        if foresee is not None:
            guess = foresee([(jobs[i], result) for i, result in done.items()])
            now = {i: guess(jobs[i]) for i in order}
        ranked = sorted(order, key=lambda i: -(INFINITY if now[i] is None else now[i]))
        return [i for i in ranked if not _below(now[i], known.get(gpus_of(jobs[i])))][:count]

    return ahead


def _name(job) -> str:
    return getattr(job[1], "name", job[1])


def run_auto(one: Callable, jobs: list, say: Callable[[str], None], *, sessions: Callable[[Callable, list], Sessions],
             workload, options, device, time_model, experts: int | None, processes: int,
             row: Callable[..., Any]) -> list:
    """``auto``'s jobs (``(world, strategy, derived)``, ``plan/derived.py``), each ``one(job, say) ->
    (rows, params, traces)``, run by ``sessions(one, jobs)`` in bound order (the module docstring);
    a job set aside gives ``([its row], None, 0)``, the row ``row(world, strategy, skipped=..., bound=...)``.
    ``experts``: the model's (``ModelFacts.experts``). Without a FLOPs floor for the model or a peak FLOP/s
    for the GPU, every job is run at once."""
    from batchfit.plan import speed_bound

    peak = device.peak_tflops(options.precision)
    floor = speed_bound.linear_flops(workload, options, experts) if peak else None
    if floor is None:
        with sessions(one, jobs) as started:
            return started.run(range(len(jobs)))
    links = time_model.links(device)
    evidence = speed_bound.Evidence(floor, peak, time_model.mfu,
                                    max(links["intra_node_gb_per_s"], links["inter_node_gb_per_s"]))
    said: dict[int, speed_bound.Bound] = {}

    def bound(job) -> float | None:  # a job that writes other worlds' rows too (derived) is traced
        world, strategy, derived = job
        if derived:
            return None
        said[id(job)] = evidence.bound(strategy, world)
        return said[id(job)].tokens_per_s

    def best_of(result) -> list[tuple[int, float, str]]:
        return [(p.gpus, p.tokens_per_s, p.strategy) for p in result[0] if p.fits and not p.skipped and p.tokens_per_s]

    def learn(job, result) -> bool:
        return all([evidence.learn(job[1], p) for p in result[0]])

    def foresee(done: list) -> Callable[[Any], float | None]:  # the bounds once ``done`` is read too: a guess
        guess = copy.deepcopy(evidence)
        for job, result in done:
            for p in result[0]:
                guess.learn(job[1], p)
        return lambda job: None if job[2] else guess.bound(job[1], job[0]).tokens_per_s

    with sessions(one, jobs) as started:
        results, aside = rounds_run(started, jobs, bound, lambda job: job[0].gpus, best_of, learn, processes=processes,
                                    say=say, set_aside=lambda job: evidence.set_aside(job[1]), foresee=foresee)
    for i, (best, name, value) in aside.items():
        world, strategy, _ = jobs[i]
        why = (f"not traced: at most {value:,.0f} tokens/s, below {name}'s traced {best:,.0f} (bound: "
               f"{said[id(jobs[i])].formula})")
        say(f"{strategy.name} on {world.gpus} GPUs: {why}")
        results[i] = ([row(world, strategy, skipped=why, bound=value)], None, 0)
    return results
