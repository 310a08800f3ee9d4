"""``batchfit noise``: the gradient noise scale, a prediction of the critical batch size."""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from batchfit.cli.common import (
    CacheDirOpt,
    DeviceOpt,
    GpuMemoryOpt,
    GpuOpt,
    JsonOpt,
    ModelArg,
    SeedOpt,
    SeqLenOpt,
    TextDataOpt,
    TextTokenizerOpt,
    ValFractionOpt,
    check_outputs,
    handle_errors,
    out_option,
    progress_line,
    quiet_if_stdout,
    report_folder,
    write_outputs,
)
from batchfit.cli.sweep import needs_data, sweep_target
from batchfit.config.step import parse_batch_sizes
from batchfit.errors import BatchfitError, OptionError, UsageError
from batchfit.specs import load_workload
from batchfit.targets import Target
from batchfit.workload import StepOptions

EXAMPLES = """
Examples:

  batchfit noise gpt-tinystories-22m --data stories.txt --batch-sizes 8,128 --steps 300

  batchfit noise my_model.py:workload --batch-sizes 8,128 --steps 0 --repeats 200
"""


@handle_errors
def noise_command(
    model: ModelArg,
    batch_sizes: Annotated[str, typer.Option(help="Two batch sizes, small then big (a multiple of small), e.g. 8,128.",
                                             show_default=False)],
    steps: Annotated[int, typer.Option(help="Training steps to track it over (EMA); 0: at the "
                                            "initial parameters.")] = 0,
    repeats: Annotated[int, typer.Option(help="With --steps 0: measurements to average.")] = 100,
    ema: Annotated[float, typer.Option(help="EMA factor over steps (the interval uses the last "
                                            "1/(1-ema) steps).")] = 0.95,
    lr: Annotated[float | None, typer.Option(help="Learning rate of the tracking run (default: the "
                                                  "optimizer's).")] = None,
    data: TextDataOpt = None,
    tokenizer: TextTokenizerOpt = "bpe",
    val_fraction: ValFractionOpt = 0.01,
    seq_len: SeqLenOpt = None,
    seed: SeedOpt = 0,
    device: DeviceOpt = None,
    gpu: GpuOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    cache_dir: CacheDirOpt = None,
    json_path: JsonOpt = None,
    out: Annotated[Path | None, out_option("report.md, noise.json")] = None,
) -> None:
    """Measure the gradient noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018).

    Squared gradient norms at a small and a big batch give unbiased estimates of |G|^2 and
    tr(Sigma); their averages over --repeats measurements (or an EMA over --steps training
    steps) give B_simple, a prediction of the batch size beyond which bigger batches stop
    paying for themselves. Minutes instead of a sweep's hours; a prediction, not a training run.
    The gradients are real: they are computed on the GPU here (--device cuda) or the CPU; --gpu
    / --gpu-memory (traced) check that a micro-batch of the small size fits that GPU.
    """
    from batchfit.report.sweep_markdown import write_noise_report
    from batchfit.runs.data import BatchSource, lm_format, tokenize
    from batchfit.sweep.noise import check_noise_options, gradient_noise_scale

    check_outputs(json_path, out, cache_dir=cache_dir)
    sizes = parse_batch_sizes(batch_sizes)
    if len(sizes) != 2:
        raise OptionError(f"--batch-sizes takes two sizes for noise, small then big, e.g. 8,128; got {batch_sizes}")
    import torch  # here: --help does not load it

    check_noise_options(sizes[0], sizes[1], steps, repeats, ema, lr)  # before any data is read

    target, train_on = sweep_target(gpu, gpu_memory, device)
    workload = load_workload(model, seq_len=seq_len)
    tokens = None
    if data is not None:
        fmt = lm_format(workload)
        if fmt is None:
            raise UsageError(f"--data gives text, but {workload.name} is not a token language model: drop --data")
    elif needs_data(model):
        raise UsageError(f"{workload.name} is a language model: give --data (a text file, a folder or a datasets "
                         "name), e.g. --data stories.txt")
    with progress_line() as say:
        if data is not None:
            tokens = tokenize(data, tokenizer=tokenizer, vocab_size=fmt.vocab_size, val_fraction=val_fraction,
                              cache_dir=cache_dir, progress=say)
        source = BatchSource(workload, seed=seed, tokens=tokens)
        if target.device is not None and target.kind != "cuda":
            _check_fits(workload, target, sizes[0], say)
        try:
            result = gradient_noise_scale(workload, source, small=sizes[0], big=sizes[1], steps=steps,
                                          repeats=repeats, ema_beta=ema, lr=lr, seed=seed,
                                          device=torch.device(train_on), progress=say)
        except BatchfitError:
            raise
        except Exception as error:  # the workload's own code (or the device) failed: one line, as elsewhere
            raise _failed(workload.name, sizes[0], train_on, error) from error
    data_json = result.to_json()
    folder = report_folder(out, "noise", workload.name, Target(target.kind, None, target.spec), StepOptions(), seq_len)
    paths = write_outputs(json_path, data_json, lambda files: write_noise_report(data_json, folder, files))
    console = quiet_if_stdout(json_path)
    low, high = data_json["b_simple_interval"]
    if data_json["b_simple"] is not None:
        interval = (f" (90% interval {low:,.1f} to {high:,.1f})" if low is not None and high is not None
                    else " (90% interval unbounded: see the note)")
        console.print(f"[bold green]B_simple = {data_json['b_simple']:,.1f} samples[/]{interval}: the predicted "
                      f"critical batch size")
    for note in result.notes:
        console.print(f"[yellow]note:[/] {escape(note)}")
    console.print(f"report: {paths['md']}", soft_wrap=True)


def _check_fits(workload, target: Target, small: int, say) -> None:
    """--gpu / --gpu-memory: the measurement runs micro-batches of the small size; refuse one
    that would not fit that GPU (traced), before any gradient is computed."""
    from batchfit.estimator.engine import estimate

    say(f"checking that batch {small} fits {target.device.display_name} (traced)")
    fits = estimate(workload, device=target.device, max_batch=small, suggest=False).max_batch_size
    if not fits:
        raise OptionError(f"not even one sample fits {target.device.display_name} (traced): the noise scale needs "
                          "a micro-batch on it; give a GPU with more memory (--gpu, --gpu-memory)")
    if fits < small:
        raise OptionError(f"a micro-batch of {small} does not fit {target.device.display_name} (traced: the largest "
                          f"is {fits}): give a smaller small batch size, e.g. --batch-sizes {fits},{fits * 16}")


def _failed(name: str, small: int, device: str, error: Exception) -> BatchfitError:
    from batchfit.train.oom import classify, describe

    frames = [f for f in traceback.extract_tb(error.__traceback__) if "/batchfit/" not in f.filename.replace("\\", "/")]
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    if classify(error) == "oom":
        return BatchfitError(f"out of memory on {device} at micro-batch {small} while measuring the noise scale of "
                             f"{name}: give a smaller small batch size (--batch-sizes)")
    return BatchfitError(f"{name} failed while measuring the noise scale{where}: {describe(error)}")
