"""``batchfit sweep``: train at each batch size for the same budget and say which is best."""

from __future__ import annotations

import math
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
    PrecisionOpt,
    RayAddressOpt,
    SeedOpt,
    SeqLenOpt,
    TextDataOpt,
    TextTokenizerOpt,
    ValFractionOpt,
    WorkersOpt,
    check_outputs,
    command_target,
    flag,
    handle_errors,
    out_option,
    progress_line,
    quiet_if_stdout,
    report_folder,
    warn_about_precision,
    write_outputs,
)
from batchfit.config.step import parse_batch_sizes
from batchfit.errors import BatchfitError, OptionError
from batchfit.runs.budget import parse_count, parse_lrs
from batchfit.specs import load_workload
from batchfit.targets import Target
from batchfit.workload import StepOptions

EXAMPLES = """
Examples:

  batchfit sweep gpt-tinystories-22m --data stories.txt --batch-sizes 1,2,4,8,16,32,64,128,256,512 --tokens 327.68M --lrs 1e-4,3e-4,1e-3 --lr-scaling sqrt --store sweep.db --gpu t4-16gb

  batchfit sweep my_model.py:workload --batch-sizes 4,16,64 --samples 200000 --lrs 0.05 --resume --store sweep.db

  batchfit sweep hf:gpt2-124m --data corpus/ --batch-sizes 8,32,128 --tokens 50M --executor ray --workers 4
"""  # noqa: E501 - each example is a command line to copy whole from --help



def sweep_target(gpu: str | None, gpu_memory: str | None, device: str | None) -> tuple[Target, str]:
    """(what a batch must fit, where runs train). With no option: the GPU here, else the
    CPU with no memory limit (a sweep trains for real: a traced GPU cannot train)."""
    import torch  # here: --help does not load it

    if not (gpu or gpu_memory or device):
        if torch.cuda.is_available():
            return command_target(None, None, "cuda"), "cuda"
        return Target("cpu", None, "cpu"), "cpu"
    target = command_target(gpu, gpu_memory, device)
    if target.kind == "cuda":
        return target, str(target.torch_device)
    if target.kind == "cpu":
        return target, "cpu"
    return target, "cuda" if torch.cuda.is_available() else "cpu"


def needs_data(model: str) -> bool:
    """Zoo and hf: models are language models: random tokens would teach them nothing."""
    from batchfit.zoo import ZOO

    return model in ZOO or model.startswith("hf:")


@handle_errors
def sweep_command(
    model: ModelArg,
    batch_sizes: Annotated[str, typer.Option(help="Batch sizes to train, e.g. 1,2,4,8,16,32.", show_default=False)],
    tokens: Annotated[str | None, typer.Option(help="Budget per run in tokens, exactly, e.g. 327.68M or 50M.")] = None,
    samples: Annotated[str | None, typer.Option(help="Budget per run in samples instead, e.g. 200k.")] = None,
    data: TextDataOpt = None,
    tokenizer: TextTokenizerOpt = "bpe",
    val_fraction: ValFractionOpt = 0.01,
    seq_len: SeqLenOpt = None,
    lrs: Annotated[str | None, typer.Option(help="Peak learning rates to try at each batch size, e.g. "
                                                 "1e-4,3e-4,1e-3 (default: the optimizer's).")] = None,
    lr_scaling: Annotated[str, typer.Option(help="none, linear or sqrt: scale --lrs from --lr-ref-batch.")] = "none",
    lr_ref_batch: Annotated[int | None, typer.Option(help="The batch size --lrs are right for (default: "
                                                          "the smallest).")] = None,
    warmup: Annotated[str, typer.Option(help="Warmup in tokens (2M) or as a share of the budget (1%).")] = "1%",
    min_lr_ratio: Annotated[float, typer.Option(help="The cosine decays to this x the peak learning rate.")] = 0.1,
    eval_every: Annotated[str, typer.Option(help="Validate every this many tokens (or samples), "
                                                 "or share: 10%.")] = "10%",
    eval_samples: EvalSamplesOpt = 64,
    checkpoint_every: Annotated[str | None, typer.Option(help="Checkpoint every this many tokens or share "
                                                              "(default: at every validation).")] = None,
    seed: SeedOpt = 0,
    grad_clip: Annotated[float, typer.Option(help="Clip the gradient norm to this (0: no clipping).")] = 1.0,
    precision: PrecisionOpt = "fp32",
    store: Annotated[Path, typer.Option(help="The SQLite store of runs and curves.")] = Path("sweep.db"),
    resume: Annotated[bool, flag("--resume", "Finish the sweep in --store: runs that are done are kept.")] = False,
    executor: ExecutorOpt = "local",
    workers: WorkersOpt = 1,
    ray_address: RayAddressOpt = None,
    gpu: GpuOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    device: DeviceOpt = None,
    noise: Annotated[bool, flag("--noise", "Also measure the gradient noise scale and show its prediction.")] = False,
    noise_repeats: NoiseRepeatsOpt = 32,
    target_loss: Annotated[float | None, typer.Option(help="The loss for 'fastest to target' (default: the worst "
                                                           "best-loss over batch sizes).")] = None,
    cache_dir: CacheDirOpt = None,
    json_path: JsonOpt = None,
    out: Annotated[Path | None, out_option("report.md, loss_vs_batch.png, curves.png, sweep.json")] = None,
) -> None:
    """Train the model at each batch size on exactly the same budget, and report which is best.

    Each batch size is tried at each learning rate (--lrs, scaled by --lr-scaling); warmup and
    decay are in tokens, so they mean the same at every size. A batch too big for the GPU runs
    as accumulated micro-batches (sized by the estimator). Runs, curves and checkpoints go to
    --store: after a crash, --resume finishes the sweep with the same numbers.
    """
    from batchfit.report.sweep_markdown import write_sweep_report
    from batchfit.sweep.engine import SweepConfig, plan_sweep, run_sweep
    from batchfit.sweep.result import read_result, save_noise

    check_outputs(json_path, out, ("--store", store), cache_dir=cache_dir)
    if target_loss is not None and not math.isfinite(target_loss):  # nan: no run ever reaches it
        raise OptionError(f"--target-loss must be a number, e.g. --target-loss 3.5; got {target_loss}")
    sizes = parse_batch_sizes(batch_sizes)
    config = SweepConfig(
        model=model, batch_sizes=sizes, tokens=parse_count(tokens, "--tokens") if tokens is not None else None,
        samples=parse_count(samples, "--samples") if samples is not None else None, data=data, tokenizer=tokenizer,
        val_fraction=val_fraction, seq_len=seq_len, lrs=parse_lrs(lrs), lr_scaling=lr_scaling,
        lr_ref_batch=lr_ref_batch, warmup=warmup, min_lr_ratio=min_lr_ratio, eval_every=eval_every,
        eval_samples=eval_samples, checkpoint_every=checkpoint_every, seed=seed, grad_clip=grad_clip or None,
        precision=precision, store=store, resume=resume, executor=executor, workers=workers,
        ray_address=ray_address, cache_dir=cache_dir, require_data=needs_data(model))
    target, train_on = sweep_target(gpu, gpu_memory, device)
    config.device = train_on
    warn_about_precision(target, precision)
    if noise and noise_repeats < 2:
        raise OptionError("--noise-repeats must be 2 or more, e.g. 32")
    workload = load_workload(model, seq_len=seq_len)
    with progress_line() as say:
        plan = plan_sweep(config, workload, largest_fitting=_largest_fitting(workload, target, config),
                          fit_device=target.device, progress=say)
        result = run_sweep(plan, progress=say)
        if noise:
            result = _with_noise(plan, say, noise_repeats, save_noise, read_result) or result
    if target_loss is not None:
        result.target_loss = target_loss
    folder = report_folder(out, "sweep", workload.name, target, StepOptions(precision=precision), seq_len)
    paths = write_outputs(json_path, result.to_json(), lambda files: write_sweep_report(result, folder, files))
    _print_summary(result, quiet_if_stdout(json_path), paths["md"])
    _fail_if_nothing_finished(result)


def _fail_if_nothing_finished(result) -> None:
    """Every run failed: the report and JSON say how, and the exit code says it too (1)."""
    failed = [r for r in result.runs if r["status"] in ("oom", "error")]
    if failed and not any(r["status"] == "done" for r in result.runs):
        first = failed[0]
        raise BatchfitError(f"no run finished: {len(failed)} of {len(result.runs)} failed; batch "
                            f"{first['batch_size']}, lr {first['lr']:.3g}: {first['status']}: {first['error']}")


def _with_noise(plan, say, repeats: int, save_noise, read_result):
    """The noise scale from the sweep's smallest batch size and the largest multiple of it."""
    import torch

    from batchfit.runs.data import BatchSource
    from batchfit.sweep.noise import gradient_noise_scale

    sizes = plan.config.batch_sizes
    small = sizes[0]
    big = max(b for b in sizes if b % small == 0)
    if big == small:
        big = small * 16
    source = BatchSource(plan.workload, seed=plan.config.seed, tokens=plan.tokens)
    say(f"noise scale from batch sizes {small} and {big}")
    noise = gradient_noise_scale(plan.workload, source, small=small, big=big, steps=0, repeats=repeats,
                                 seed=plan.config.seed, device=torch.device(plan.config.device), progress=say)
    save_noise(plan.config.store, noise.to_json())
    return read_result(plan.config.store)


def _print_summary(result, console, report_path: Path) -> None:
    unit = result.unit
    console.print(f"[bold]{escape(result.workload)}: {result.budget['total']:,} {unit} per run[/]")
    table = Table()
    for column in ("batch", "status", "steps", "time s", "final train", "final val", "best val", "lr"):
        table.add_column(column, justify="left" if column == "status" else "right")
    best = result.best_runs()
    shown = dict(best)
    for r in result.runs:
        shown.setdefault(r["batch_size"], r)
    for b in sorted(shown):
        r = shown[b]
        table.add_row(str(b), r["status"], f"{r['steps']:,}", f"{r['seconds'] or 0:.1f}",
                      *(f"{x:.4f}" if x is not None else "—"
                        for x in (r["final_train_loss"], r["final_val_loss"], r["best_val_loss"])), f"{r['lr']:.3g}")
    console.print(table)
    for r in result.runs:
        if r["status"] in ("oom", "error"):
            console.print(f"[red]batch {r['batch_size']}, lr {r['lr']:.3g} {r['status']}:[/] {escape(str(r['error']))}")
    choice, fastest = result.best_batch_size(), result.fastest_batch_size()
    if choice is not None:
        console.print(f"[bold green]best for quality: batch size {choice}[/] (val {best[choice]['best_val_loss']:.4f})")
    if fastest is not None:
        console.print(f"fastest to val {result.target():.4f}: batch size {fastest}")
    if result.noise and result.noise.get("b_simple") is not None:
        console.print(f"predicted critical batch (noise scale B_simple): {result.noise['b_simple']:,.1f}")
    console.print(f"report: {report_path}", soft_wrap=True)


def _largest_fitting(workload, target, config):
    """The estimator's traced answer for the GPU the sweep's micro-batches must fit (None: no GPU named)."""
    if target.device is None:
        return None

    def largest(max_batch: int) -> int:
        from batchfit.estimator.engine import estimate
        from batchfit.workload import StepOptions

        return estimate(workload, device=target.device, options=StepOptions(precision=config.precision),
                        max_batch=max_batch, suggest=False).max_batch_size

    return largest
