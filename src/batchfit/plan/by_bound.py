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

Each traced row is checked against the floors (``speed_bound.Evidence.learn``): where one falls below a
floor that a candidate was set aside by, nothing is set aside any more, and what was is traced after all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

INFINITY = float("inf")


def rounds_run(run: Callable[[list], list], jobs: Sequence, bound: Callable[[Any], float | None],
               gpus_of: Callable[[Any], int], best_of: Callable[[Any], list[tuple[int, float, str]]],
               learn: Callable[[Any, Any], bool], *, processes: int, say: Callable[[str], None],
               set_aside: Callable[[Any], None] = lambda job: None) -> tuple[list, dict[int, tuple[float, str, float]]]:
    """``run(jobs)`` in rounds (the module docstring): each job's result, or None for a job set aside,
    and for each set-aside job's index the best (tokens/s, strategy) on its GPU count and its bound then.

    ``run(some_jobs) -> their results``; ``bound(job)``: what is known now (re-read before each round);
    ``gpus_of(job)``; ``best_of(result) -> [(gpus, tokens/s, strategy)]`` for each of its rows that fits;
    ``learn(job, result)``: read a result, False once a row broke what the bounds rest on (then every job
    set aside is traced after all); ``set_aside(job)``: a job is set aside now."""
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
            if bounds[i] is not None and floor is not None and bounds[i] < floor[0]:
                aside[i] = (*floor, bounds[i])
                set_aside(jobs[i])
                order.remove(i)
        if not order:
            break
        # one job per process (the rows they trace tighten the others' bounds), all that are left once nothing is
        # set aside any more
        count = processes if pruning else len(order)
        chosen, order = order[:count], order[count:]
        for i, result in zip(chosen, run([jobs[i] for i in chosen])):
            results[i] = result
            for gpus, tokens_per_s, name in best_of(result):
                if tokens_per_s > best.get(gpus, (0.0, ""))[0]:
                    best[gpus] = (tokens_per_s, name)
            if not learn(jobs[i], result) and pruning:
                pruning = False
                say(f"{getattr(jobs[i][1], 'name', jobs[i][1])}: a traced row fell below the floor the bounds rest on; "
                    f"every candidate is traced{f', {len(aside)} set aside so far included' if aside else ''}")
                order += sorted(aside)
                aside.clear()
    return results, aside


def run_auto(one: Callable, jobs: list, say: Callable[[str], None], *, run: Callable[[Callable, list], list],
             workload, options, device, time_model, experts: int | None, processes: int,
             row: Callable[..., Any]) -> list:
    """``auto``'s jobs (``(world, strategy, derived)``, ``plan/derived.py``), each ``one(job, say) ->
    (rows, params, traces)``, run by ``run(one, some_jobs)`` in bound order (the module docstring);
    a job set aside gives ``([its row], None, 0)``, the row ``row(world, strategy, skipped=..., bound=...)``.
    ``experts``: the model's (``ModelFacts.experts``). Without a FLOPs floor for the model or a peak FLOP/s
    for the GPU, every job is run at once."""
    from batchfit.plan import speed_bound

    peak = device.peak_tflops(options.precision)
    floor = speed_bound.linear_flops(workload, options, experts) if peak else None
    if floor is None:
        return run(one, jobs)
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

    results, aside = rounds_run(lambda some: run(one, some), jobs, bound, lambda job: job[0].gpus, best_of, learn,
                                processes=processes, say=say, set_aside=lambda job: evidence.set_aside(job[1]))
    for i, (best, name, value) in aside.items():
        world, strategy, _ = jobs[i]
        why = (f"not traced: at most {value:,.0f} tokens/s, below {name}'s traced {best:,.0f} (bound: "
               f"{said[id(jobs[i])].formula})")
        say(f"{strategy.name} on {world.gpus} GPUs: {why}")
        results[i] = ([row(world, strategy, skipped=why, bound=value)], None, 0)
    return results
