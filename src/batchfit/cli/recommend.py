"""``batchfit recommend``: the batch size that trains best for a budget, at a fraction of a sweep."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from batchfit.cli.common import (
    CacheDirOpt,
    DeviceOpt,
    EvalSamplesOpt,
    ExecutorOpt,
    GpuMemoryOpt,
    GpuOpt,
    JsonOpt,
    ModelArg,
    NoiseRepeatsOpt,
    RayAddressOpt,
    SeedOpt,
    SeqLenOpt,
    TextDataOpt,
    TextTokenizerOpt,
    ValFractionOpt,
    WorkersOpt,
    check_outputs,
    flag,
    handle_errors,
    out_option,
    progress_line,
    quiet_if_stdout,
    report_folder,
    write_outputs,
)
from batchfit.cli.sweep import needs_data, sweep_target
from batchfit.config.step import parse_batch_sizes
from batchfit.errors import OptionError, UsageError
from batchfit.runs.budget import parse_count, parse_lrs
from batchfit.specs import load_workload
from batchfit.workload import StepOptions

EXAMPLES = """
Examples:

  batchfit recommend gpt-tinystories-22m --data stories.txt --tokens 327.68M --batch-sizes 1,2,4,8,16,32,64,128,256 --lrs 3e-4

  batchfit recommend my_gpt.py:workload --data corpus/ --tokens 50M --batch-sizes 8,16,32,64,128 --lr-scaling none --gpu t4-16gb
"""  # noqa: E501 - each example is a command line to copy whole from --help


def parse_shares(text: str, option: str) -> list[float]:
    """'10%,25%' or '0.1,0.25' -> [0.1, 0.25]."""
    shares = []
    for part in str(text).split(","):
        part = part.strip()
        try:
            shares.append(float(part[:-1]) / 100 if part.endswith("%") else float(part))
        except ValueError:
            raise OptionError(f"cannot read {option} '{text}': give shares of the budget, e.g. "
                              "10%,25% or 0.1,0.25") from None
    return shares


@handle_errors
def recommend_command(
    model: ModelArg,
    tokens: Annotated[str | None, typer.Option(help="The training budget in tokens, e.g. 327.68M.")] = None,
    samples: Annotated[str | None, typer.Option(help="The budget in samples instead, e.g. 200k.")] = None,
    batch_sizes: Annotated[str, typer.Option(help="The batch sizes a sweep would try, e.g. "
                                                  "1,2,4,8,16,32.")] = "1,2,4,8,16,32,64",
    lrs: Annotated[str | None, typer.Option(help="Peak learning rates at the smallest batch size, e.g. 3e-4 "
                                                 "(default: the optimizer's).")] = None,
    lr_scaling: Annotated[str, typer.Option(help="How a branch at k x the batch scales its rate: sqrt (Adam, the "
                                                 "paper's rule), linear or none (a fixed rate).")] = "sqrt",
    data: TextDataOpt = None,
    tokenizer: TextTokenizerOpt = "bpe",
    val_fraction: ValFractionOpt = 0.01,
    seq_len: SeqLenOpt = None,
    branch_at: Annotated[str, typer.Option(help="Where the parent run branches, as shares of the budget.")] = "10%,25%",
    window: Annotated[str, typer.Option(help="How long each branch trains, as a share of the budget (longer where "
                                             "that holds fewer than 2 steps of the largest batch).")] = "4%",
    cooldown: Annotated[str, typer.Option(help="The last share of each window in which the rate decays to the "
                                               "schedule's final rate (0: none).")] = "75%",
    epsilon: Annotated[float, typer.Option(help="Relative loss tolerance: within it, a batch loses nothing.")] = 0.01,
    seeds: Annotated[int, typer.Option(help="Data windows at the last branch point (the interval).")] = 2,
    max_share: Annotated[str, typer.Option(help="Aim to train at most this share of the sweep's tokens: fewer branch "
                                                "points, then fewer of the largest batch sizes; where no branch plan "
                                                "costs less than the sweep, the sweep runs.")] = "20%",
    noise: Annotated[bool, flag("--noise/--no-noise", "Also measure the gradient noise scale (shown, biased).")] = True,
    noise_repeats: NoiseRepeatsOpt = 8,
    eval_samples: EvalSamplesOpt = 64,
    seed: SeedOpt = 0,
    gpu: GpuOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    device: DeviceOpt = None,
    cache_dir: CacheDirOpt = None,
    store: Annotated[Path | None, typer.Option(help="The SQLite store of branches (the sweep's kind; branch points "
                                                   "beside it): run the same command again after a crash to "
                                                   "resume.")] = None,
    executor: ExecutorOpt = "local",
    workers: WorkersOpt = 1,
    ray_address: RayAddressOpt = None,
    json_path: JsonOpt = None,
    out: Annotated[Path | None, out_option("report.md, branches.png, sources.png, recommend.json")] = None,
) -> None:
    """Recommend a batch size and learning rate for a budget, from branched training.

    One run at the smallest batch size; at --branch-at, exact copies (model, optimizer, RNG,
    data position) train a --window at each larger batch with the rate scaled by
    --lr-scaling (Merrill et al. 2025). Prints the recommendation with its interval, the
    critical batch size, the evidence (formula priors and the noise scale shown on their own)
    and what it cost as a share of the sweep it replaces.
    """
    import torch  # here: --help does not load it

    from batchfit.recommend.engine import RecommendConfig, plan_recommend, run_recommend
    from batchfit.report.recommend_markdown import write_recommend_report
    from batchfit.runs.data import BatchSource, lm_format, tokenize
    from batchfit.runs.executors import check_executor

    check_outputs(json_path, out, *([("--store", store)] if store is not None else []), cache_dir=cache_dir)
    if noise and noise_repeats < 2:
        raise OptionError("--noise-repeats must be 2 or more, e.g. 8")
    points = parse_shares(branch_at, "--branch-at")
    config = RecommendConfig(
        batch_sizes=parse_batch_sizes(batch_sizes), tokens=parse_count(tokens, "--tokens") if tokens else None,
        samples=parse_count(samples, "--samples") if samples else None, lrs=parse_lrs(lrs), lr_scaling=lr_scaling,
        branch_points=tuple(points), window=parse_shares(window, "--window")[0],
        cooldown=parse_shares(cooldown, "--cooldown")[0], epsilon=epsilon, seeds=seeds, eval_samples=eval_samples,
        seed=seed, max_share=parse_shares(max_share, "--max-share")[0])
    check_executor(executor, workers)
    target, train_on = sweep_target(gpu, gpu_memory, device)
    workload = load_workload(model, seq_len=seq_len)
    token_data = None
    with progress_line() as say:
        if data is not None:
            fmt = lm_format(workload)
            if fmt is None:
                raise UsageError(f"--data gives text, but {workload.name} is not a token language model: drop --data")
            token_data = tokenize(data, tokenizer=tokenizer, vocab_size=fmt.vocab_size, val_fraction=val_fraction,
                                  cache_dir=cache_dir, progress=say)
        elif needs_data(model):
            raise UsageError(f"{workload.name} is a language model: give --data (a text file, a folder or a datasets "
                             "name), e.g. --data stories.txt")
        plan = plan_recommend(config, workload, token_data, largest_fitting=_largest_fitting(workload, target),
                              fit_device_name=target.device.display_name if target.device else "the GPU")
        for note in plan.notes:
            say(f"plan: {note}")
        source = BatchSource(workload, seed=seed, tokens=token_data, eval_samples=eval_samples)
        result = run_recommend(plan, workload, token_data, device=torch.device(train_on), progress=say, store=store,
                               executor=executor, workers=workers, ray_address=ray_address, model=model)
        if noise:
            from batchfit.sweep.noise import gradient_noise_scale

            small, big = config.batch_sizes[0], config.batch_sizes[-1]
            noise_cost = noise_repeats * big * plan.budget.per_sample
            if result.cost + noise_cost > max(config.max_share, result.cost_share) * result.sweep_equivalent:
                result.notes.append(f"noise scale not measured: its {noise_cost:,} {plan.budget.unit} would take the "
                                    f"cost past {max(config.max_share, result.cost_share):.0%} of the sweep's")
            elif big % small == 0 and big > small:
                say(f"noise scale from batch sizes {small} and {big}")
                measured = gradient_noise_scale(workload, source, small=small, big=big, repeats=noise_repeats,
                                                seed=seed, device=torch.device(train_on), progress=say)
                result.noise = measured.to_json()
                result.noise_cost = noise_cost
    folder = report_folder(out, "recommend", workload.name, target, StepOptions(), seq_len)
    data_json = result.to_json()
    paths = write_outputs(json_path, data_json, lambda files: write_recommend_report(data_json, folder, files))
    _print(result, data_json, quiet_if_stdout(json_path), paths["md"])


def _largest_fitting(workload, target):
    if target.device is None:
        return None

    def largest(max_batch: int) -> int:
        from batchfit.estimator.engine import estimate

        return estimate(workload, device=target.device, options=StepOptions(), max_batch=max_batch,
                        suggest=False).max_batch_size

    return largest


def _print(result, data: dict, console, report_path: Path) -> None:
    low, high = result.interval
    for note in result.notes:
        if note.startswith(("ran the sweep itself", "batch sizes", "no branch plan")):
            console.print(f"plan: {escape(note)}")
    console.print(f"[bold green]recommended: batch size {result.recommended_batch_size}[/] (interval {low}-{high}), "
                  f"lr {result.lr:.3g}, for {result.budget:,} {result.unit}; critical batch size "
                  f"{result.critical_batch_size}")
    if result.choice_rule:
        console.print(f"chosen: {escape(result.choice_rule)}")
    table = Table()
    for column in ("source", "batch size", "lr", "kind"):
        table.add_column(column, justify="left" if column in ("source", "kind") else "right")
    for row in result.evidence():
        table.add_row(escape(row["source"]), "—" if row["batch_size"] is None else f"{row['batch_size']:,.0f}",
                      "—" if row["lr"] is None else f"{row['lr']:.3g}", row["kind"])
    console.print(table)
    for prior in result.priors:
        if prior.get("weight_decay") is not None:
            console.print(f"weight decay {prior['weight_decay']:.3g} at this batch and rate: {escape(prior['source'])} "
                          "(a formula's answer, not measured)")
    console.print(f"cost: {result.total_cost:,} {result.unit}, {result.cost_share:.1%} of a sweep of the same batch "
                  f"sizes at the same budget ({result.sweep_equivalent:,})")
    console.print(f"report: {report_path}", soft_wrap=True)
