"""``plan --strategies auto`` traces its candidates in the order of what they could reach, and stops.

Each candidate has a bound on its tokens/s before it is traced (``plan/speed_bound.py``). The
candidates are traced in rounds, the highest bounds first: a round is the untraced candidates of the
highest bound and every one tied with it (all of them at once, as many processes as cores), and at
least one per process. After each round, a candidate whose bound is below the best tokens/s traced
on its GPU count cannot be ranked first there, and is not traced: its row says so, with the bound.
So the answer never depends on the bounds: the best row is the one a plan that traced every
candidate would rank first. Which rows are traced depends only on the bounds and the traced figures,
never on timing. A candidate without a bound (None) is traced, in the first round.

Each traced row's FLOPs are checked against the floor the bounds rest on (``speed_bound.below_floor``):
where one falls below it, no candidate is set aside any more (they are all traced).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

INFINITY = float("inf")


def rounds_run(run: Callable[[list], list], jobs: Sequence, bounds: Sequence[float | None], gpus_of: Callable[[Any], int],
               best_of: Callable[[Any], list[tuple[int, float, str]]], holds: Callable[[Any, Any], bool], *,
               processes: int, say: Callable[[str], None]) -> tuple[list, dict[int, tuple[float, str]]]:
    """``[run(jobs)...]`` in rounds (the module docstring): each job's result, or None for a job set
    aside, and for each set-aside job's index the best (tokens/s, strategy) on its GPU count.

    ``run(some_jobs) -> their results``; ``gpus_of(job)``; ``best_of(result) -> [(gpus, tokens/s,
    strategy)]`` for each of its rows that fits; ``holds(job, result)``: the floor held for its rows."""
    order = sorted(range(len(jobs)), key=lambda i: -(INFINITY if bounds[i] is None else bounds[i]))
    results: list = [None] * len(jobs)
    aside: dict[int, tuple[float, str]] = {}
    best: dict[int, tuple[float, str]] = {}
    pruning = True
    while order:
        if pruning:
            for i in [i for i in order if bounds[i] is not None and bounds[i] < best.get(gpus_of(jobs[i]), (0.0,))[0]]:
                aside[i] = best[gpus_of(jobs[i])]
                order.remove(i)
        if not order:
            break
        top = bounds[order[0]]
        # every job tied with the highest bound (all that are left once nothing is set aside), one per process at least
        count = max(processes, sum(1 for i in order if bounds[i] == top)) if pruning else len(order)
        chosen, order = order[:count], order[count:]
        for i, result in zip(chosen, run([jobs[i] for i in chosen])):
            results[i] = result
            if pruning and not holds(jobs[i], result):
                pruning = False
                say(f"{getattr(jobs[i][1], 'name', jobs[i])}: fewer FLOPs traced than the linear layers' floor; "
                    "every candidate is traced")
            for gpus, tokens_per_s, name in best_of(result):
                if tokens_per_s > best.get(gpus, (0.0, ""))[0]:
                    best[gpus] = (tokens_per_s, name)
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
    mfu = time_model.mfu

    def bound(job) -> float | None:  # a job that writes other worlds' rows too (derived) is traced
        world, strategy, derived = job
        return None if derived else speed_bound.tokens_per_s_bound(floor, strategy, world, peak, mfu)

    def best_of(result) -> list[tuple[int, float, str]]:
        return [(p.gpus, p.tokens_per_s, p.strategy) for p in result[0] if p.fits and not p.skipped and p.tokens_per_s]

    def holds(job, result) -> bool:
        return not any(p.time and speed_bound.below_floor(floor, job[1], p.micro_batch, p.time.flops)
                       for p in result[0])

    bounds = [bound(job) for job in jobs]
    results, aside = rounds_run(lambda some: run(one, some), jobs, bounds, lambda job: job[0].gpus, best_of, holds,
                                processes=processes, say=say)
    for i, (best, name) in aside.items():
        world, strategy, _ = jobs[i]
        why = speed_bound.why_bounded(floor, strategy, world, peak, mfu, best, name)
        say(f"{strategy.name} on {world.gpus} GPUs: {why}")
        results[i] = ([row(world, strategy, skipped=why, bound=bounds[i])], None, 0)
    return results
