"""What every command shares: error handling, option parsing, the target device."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from batchfit.cli.flags import as_flags
from batchfit.devices import precision_warning
from batchfit.errors import BatchfitError, OptionError
from batchfit.report.write import StagedFiles, staged_files, write_text_atomic
from batchfit.specs import SPEC_HELP
from batchfit.targets import DEVICE_HELP, Target, resolve_target
from batchfit.workload import StepOptions, attention_words

T = TypeVar("T")
err = Console(stderr=True)
out = Console()


def handle_errors(command: Callable) -> Callable:
    """Known errors become one line and a hint, with exit code 2 (bad input) or 1; Ctrl-C one
    line and exit code 130, as a shell reports it."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except BatchfitError as error:
            if os.environ.get("BATCHFIT_DEBUG"):
                raise
            # library errors name fields (`seq_len`); a command line types flags (--seq-len)
            err.print(f"[bold red]error:[/] {escape(as_flags(str(error)))}", highlight=False, soft_wrap=True)
            if error.exit_code != 2:  # bad input is the line above; a failure inside may need its traceback
                err.print("[dim]set BATCHFIT_DEBUG=1 for a traceback[/]")
            raise typer.Exit(error.exit_code) from None
        except KeyboardInterrupt:
            err.print("[bold yellow]interrupted[/] (Ctrl-C)")
            raise typer.Exit(130) from None

    return wrapper


def say_dim(message: str) -> None:
    """A line for the user that is not the answer (which device was chosen, how two flags combine), on stderr."""
    err.print(f"[dim]{escape(message)}[/]")


def command_target(gpu: str | None, gpu_memory: str | None, device: str | None) -> Target:
    """The device options every command shares (``batchfit.targets``), saying which device
    was chosen when none was named."""
    return resolve_target(gpu=gpu, gpu_memory=gpu_memory, device=device, say=say_dim)


def is_stdout(path: str | None) -> bool:
    return path == "-"


def quiet_if_stdout(path: str | None) -> Console:
    """Human output goes to stderr when JSON goes to stdout."""
    return err if is_stdout(path) else out


# --- options shared by the commands that run a training step ------------------------------
GpuOpt = Annotated[str | None, typer.Option(help="GPU from the catalog (`batchfit gpus`), traced, e.g. h100-80gb.")]
GpuMemoryOpt = Annotated[str | None, typer.Option(help="Any GPU by its memory, traced, e.g. 24GiB or 80GB.")]
DeviceOpt = Annotated[str | None, typer.Option(help=f"Where to run: {DEVICE_HELP}. Default: the GPU here, else a "
                                                    "traced H100.")]
ModelArg = Annotated[str, typer.Argument(help=f"What to train: {SPEC_HELP}.", show_default=False)]
SeqLenOpt = Annotated[int | None, typer.Option(help="Tokens per sample (default: the model's).")]
DataOpt = Annotated[str | None, typer.Option(help="The run's data (.txt lines, .jsonl / .parquet rows, a folder): "
                                             "answer for its worst batch, not one shape (docs/run.md).")]
BatchingOpt = Annotated[str | None, typer.Option(help="How --data is batched: pad-longest (default), pad-max, "
                                                 "pack:MAXLEN (rows of MAXLEN), tokens:N (one row of up to N "
                                                 "tokens per GPU).")]
LengthColumnOpt = Annotated[str | None, typer.Option(help="A column of token counts in --data's rows.")]
TokenizerOpt = Annotated[str | None, typer.Option(help="Tokenizes --data's text: a tokenizer.json, a cached name, "
                                                  "or bytes (default: the model folder's own).")]
PrecisionOpt = Annotated[str, typer.Option(help="fp32, bf16-mixed, fp16-mixed (autocast, fp32 weights), "
                                                "bf16 (pure), or fp8-tensorwise / fp8-rowwise (torchao float8 linears, "
                                                "the rest bf16-mixed).")]
OptimizerOpt = Annotated[str | None, typer.Option(help="Override the optimizer: adamw, adam, sgd, "
                                                 "sgd-momentum, adafactor, muon (Muon for hidden matrices, AdamW "
                                                 "for the rest); adamw-8bit, paged-adamw-8bit, lion-8bit, "
                                                 "paged-lion-8bit (bitsandbytes), adamw-torchao-8bit, "
                                                 "adamw-torchao-4bit (torchao).")]
ParamGroupsOpt = Annotated[str, typer.Option(help="The optimizer's parameter groups: one (every trainable "
                                                   "parameter) or decay:WD (the HF Trainer's two: weight decay WD "
                                                   "on the weights, none on biases and norms; --trainer sets it). "
                                                   "Each group's foreach temporaries are freed before the next.")]
CheckpointingOpt = Annotated[str, typer.Option(help="Activation checkpointing: none, full (every block), selective "
                                                    "(torchtitan's per-op policy) or every:N (every N-th block).")]
LossOpt = Annotated[str, typer.Option(help="Language-model loss: plain (the model's), chunked:N (cross-entropy over N "
                                           "chunks of the sequence, torchtune's) or fused-linear (Liger's "
                                           "fused linear + cross-entropy: never the whole logits).")]
CompileOpt = Annotated[str, typer.Option("--compile", help="torch.compile: none, model (whole model) or blocks "
                                          "(each block, as torchtitan does). Traced as compiled (AOTAutograd's min-cut "
                                          "partition); where it cannot be, the output says so.")]
FreezeOpt = Annotated[list[str] | None, typer.Option(help="Freeze parameters matching this glob (repeatable), e.g. "
                                                          "'model.layers.*'.")]
TrainOnlyOpt = Annotated[list[str] | None, typer.Option(help="Train only parameters matching this glob (repeatable), "
                                                             "e.g. '*lora*'.")]
AccumulationOpt = Annotated[int, typer.Option(help="Micro-batches per optimizer step.")]
QuantizeOpt = Annotated[str, typer.Option(help="Quantize the frozen base's linear layers with bitsandbytes "
                                                 "(QLoRA): none, nf4, nf4-dq, fp4, fp4-dq (4-bit; -dq: double "
                                                 "quantization; compute dtype from --precision) or int8. Needs "
                                                 "batchfit[quant].")]
LoraOpt = Annotated[str, typer.Option(help="PEFT LoRA adapters: none or r=16[,alpha=32][,dora][,targets=q_proj+v_proj] "
                                            "(default targets: every linear layer but the output head). Needs "
                                            "batchfit[quant].")]
TargetUtilOpt = Annotated[float, typer.Option(help="Fraction of usable memory to plan for.")]
MultipleOfOpt = Annotated[int, typer.Option(help="Batch sizes must be multiples of this, e.g. 8.")]
NoCacheOpt = Annotated[bool, typer.Option("--no-cache", help="Trace again: neither read nor write the trace cache "
                                          "($BATCHFIT_CACHE/traces, else ~/.cache/batchfit/traces; "
                                          "`batchfit cache clear` empties it).", metavar="")]
JsonOpt = Annotated[str | None, typer.Option("--json", help="Write the JSON result here too ('-' for stdout).")]
LimitOpt = Annotated[str, typer.Option(help="What must fit: reserved (what a GPU runs out of: the caching allocator's "
                                            "segments, fragmentation included) or allocated (tensors only).")]
OffloadOpt = Annotated[str, typer.Option(help="Move to pinned host memory: none, activations (torchtune's / TRL's "
                                              "saved-tensor hooks), params (FSDP2's CPUOffloadPolicy: parameters, "
                                              "gradients, optimizer state; plan with fsdp) or activations+params.")]
HostMemoryOpt = Annotated[str | None, typer.Option(help="Host memory the offloaded bytes must fit, e.g. 512GiB "
                                                        "(default: not checked, the host figure is only reported).")]
RoutingOpt = Annotated[str, typer.Option(help="MoE routing assumed on fake tensors: balanced (tokens x top_k / experts "
                                              "each), capacity:F (experts filled to ceil(F x tokens x top_k / experts) "
                                              "in turn, the rest dropped) or worst (every token to the same top_k "
                                              "experts: the bound). Named in every output. With estimate --data "
                                              "--replay-steps K, one per step: R or R*N joined by commas "
                                              "(balanced*20,worst; the last holds after).")]
AttentionOpt = Annotated[str | None, typer.Option(
    help="A transformers model's attention: eager (holds the [B, H, T, T] scores), sdpa (torch's fused kernels) or "
         "flash (flash_attn's FlashAttention-2: fp16/bf16, traced as its kernel saves). Default: the config's "
         "attn_implementation, else sdpa where the family supports it, else eager. Named in every output.",
    show_default=False)]


MemoryBudgetOpt = Annotated[float | None, typer.Option(
    "--memory-budget", metavar="F", help="With --compile: torch.compile's activation memory budget (0 to 1, "
    "torch._functorch.config.activation_memory_budget); the partitioner recomputes the rest. Traced, not assumed.")]


# --- options shared by the commands that train many runs (sweep, recommend, noise) --------
TextDataOpt = Annotated[str | None, typer.Option(help="Text: a .txt file, a folder of .txt/.jsonl/.parquet, or a "
                                                      "datasets name or path. Needed by a language model (zoo, "
                                                      "hf:); a file.py:function model without it trains on its "
                                                      "workload's own batches.")]
TextTokenizerOpt = Annotated[str, typer.Option(help="bpe (byte-level BPE trained on the train split at the model's "
                                                    "vocabulary size), bytes, or a tokenizer.json / cached name.")]
ValFractionOpt = Annotated[float, typer.Option(help="Share of the text kept for validation (the end of it).")]
CacheDirOpt = Annotated[Path | None, typer.Option(help="Where token ids are cached (default "
                                                       "$BATCHFIT_CACHE/tokens, else ~/.cache/batchfit/tokens).")]
SeedOpt = Annotated[int, typer.Option(help="Fixes the initial model and the data order.")]
ExecutorOpt = Annotated[str, typer.Option(help="Where runs train: local (--workers processes here) or ray (pip install "
                                               "'batchfit[ray]').")]
WorkersOpt = Annotated[int, typer.Option(help="Runs at once (local: processes, one per GPU; ray: tasks).")]
RayAddressOpt = Annotated[str | None, typer.Option(help="A Ray cluster's address (default: a local cluster).")]
NoiseRepeatsOpt = Annotated[int, typer.Option(help="With --noise: measurements at the initial parameters.")]
EvalSamplesOpt = Annotated[int, typer.Option(help="Validation samples (the same fixed set for every run).")]


def out_option(files: str) -> object:
    """--out, naming the files this command writes."""
    return typer.Option(help=f"Report folder ({files}); default reports/<command>-<model>-<device>[-<options>]/.")


def flag(name: str, help: str) -> object:
    """A plain on/off flag (no '<bool>' in --help)."""
    return typer.Option(name, help=help, metavar="")


def warn_about_approximations(result) -> None:
    """One warning line per approximation a traced result carries (``trace/approximation.py``)."""
    for approximation in getattr(result, "approximations", []):
        err.print(f"[yellow]warning: approximated:[/] {escape(approximation.line())}", soft_wrap=True)
    say_notices(getattr(result, "notices", []))


def say_notices(notices: list[str]) -> None:
    """One line per option that changes nothing for the model (``trace/noops.py``)."""
    for notice in notices:
        err.print(f"[yellow]notice:[/] {escape(notice)}", soft_wrap=True)


def sequence_words(tokens_per_sample: int | None) -> str:
    """', sequence 2,048 tokens' for a command's header line: the length every figure below is at
    (the model's own or --seq-len); nothing for a model without tokens."""
    return f", sequence {tokens_per_sample:,} tokens" if tokens_per_sample else ""


def capped_words(cap: int) -> str:
    """Why an answer equal to --max-batch is not memory's limit, and what finds that limit."""
    return (f"{cap:,} is --max-batch's cap, not where memory runs out: larger sizes were not traced "
            "(raise --max-batch to find the limit)")


def say_attention(options: StepOptions, console: Console) -> None:
    """The attention implementation the step ran (``StepOptions.with_attention_of``), one line; none for
    a model whose attention is its own code."""
    if options.attention is not None:
        console.print(f"attention: {escape(attention_words(options.attention))}", soft_wrap=True, highlight=False)


def warn_about_precision(target: Target, precision: str) -> None:
    """bf16 on a card without bf16 tensor cores runs, emulated and slowly: say so once (after
    the options are checked: no warning about a value that will not run)."""
    warning = precision_warning(target.device, precision) if target.device else None
    if warning:
        err.print(f"[yellow]warning:[/] {escape(warning)}")


def _first_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (the folder a mkdir would create under)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _unwritable(folder: Path) -> str | None:
    """Why nothing can be created in ``folder`` (None: it can). Tried, not guessed from the
    mode bits: root may write a chmod 555 folder, and nobody can write /proc or a read-only
    mount, whatever ``os.access`` says."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return "read-only: permission denied"
    try:
        handle, name = tempfile.mkstemp(dir=folder, prefix=".batchfit-check-")
    except OSError as error:
        return f"read-only: creating a file there fails: {error.strerror or error}"
    os.close(handle)
    with contextlib.suppress(OSError):
        os.unlink(name)
    return None


def check_writable_file(option: str, path: Path | str, example: str) -> None:
    """Refuse, before any work, a file path that cannot be written, with the reason: a folder,
    a path under a file, a folder that does not exist, a read-only folder. ``example`` is
    what to type instead (e.g. '--json result.json')."""
    path = Path(path)
    if path.is_dir():
        raise OptionError(f"{option} {path} is a folder: give a file name, e.g. {option} "
                          f"{path / example.split()[-1]}")
    existing = _first_existing(path.parent)
    if not existing.is_dir():
        raise OptionError(f"{option} {path}: '{existing}' is a file, not a folder; write elsewhere, e.g. {example}")
    if existing != Path(os.path.abspath(path.parent)):
        raise OptionError(f"{option} {path}: the folder '{path.parent}' does not exist; create it or write "
                          f"elsewhere, e.g. {example}")
    reason = _unwritable(existing)
    if reason:
        raise OptionError(f"{option} {path}: cannot write in '{path.parent}' ({reason}); write elsewhere, "
                          f"e.g. {example}")


def check_writable_folder(option: str, folder: Path | str, example: str, holds: str = "the report") -> None:
    """Refuse, before any work, a folder (for ``holds``) that cannot be created or written in."""
    folder = Path(folder)
    existing = _first_existing(folder)
    if existing == Path(os.path.abspath(folder)) and not folder.is_dir():
        raise OptionError(f"{option} {folder} is a file: {option} takes a folder for {holds}, e.g. {example}")
    if not existing.is_dir():
        raise OptionError(f"{option} {folder}: '{existing}' is a file, not a folder; write elsewhere, e.g. {example}")
    reason = _unwritable(existing)
    if reason:
        raise OptionError(f"{option} {folder}: cannot write in '{existing}' ({reason}); write elsewhere, "
                          f"e.g. {example}")


def check_outputs(json_path: str | None, out: Path | None, *files: tuple[str, Path | str],
                  cache_dir: Path | None = None) -> None:
    """Refuse output paths that cannot be written *before* any work, so no result is lost:
    --json, --out (or the default reports/ folder), ``files``: (option, path) pairs such
    as ("--emit", "config.yaml") or ("--store", "sweep.db"), and the --cache-dir of token ids."""
    if cache_dir is not None:
        check_writable_folder("--cache-dir", cache_dir, "--cache-dir ~/.cache/batchfit/tokens", holds="token ids")
    if json_path and not is_stdout(json_path):
        check_writable_file("--json", json_path, "--json result.json")
    if out is not None:
        check_writable_folder("--out", out, "--out report/")
    else:
        default = Path("reports")
        if default.exists() and not default.is_dir():
            raise OptionError("'reports' here is a file, and reports go to reports/<command>-...: give --out, "
                              "e.g. --out report/")
        reason = _unwritable(_first_existing(default))
        if reason:
            raise OptionError(f"cannot write the report in '{os.path.abspath(default)}' ({reason}): give --out a "
                              "folder you can write, e.g. --out /tmp/report")
    for option, path in files:
        check_writable_file(option, path, f"{option} {Path(path).name}")


def report_folder(out: Path | None, command: str, workload: str, target: Target, options: StepOptions,
                  seq_len: int | None = None, rollout=None) -> Path:
    """--out, or reports/<command>-<model>-<device>[-<what differs from the defaults>]/.

    Runs that differ only in options get their own folder (an fp16-mixed run does not
    overwrite the fp32 one); the device is named as typed (``24GiB``, ``t4-16gb``, ``cuda``).
    So do two --trainer GRPOConfigs of one model (``rollout``: its lengths and group, then a digest of
    every setting, sampling included).
    """
    if out is not None:
        return out
    default = StepOptions()
    parts = [command, workload, target.spec.removeprefix("virtual:")]
    if seq_len:
        parts.append(f"seq{seq_len}")
    for name in ("precision", "optimizer", "checkpointing", "compile", "loss", "tp_loss", "offload", "routing",
                 "attention"):
        value = getattr(options, name)
        if value != getattr(default, name):
            parts.append({"checkpointing": f"ckpt-{value}", "compile": f"compile-{value}",
                          "loss": f"loss-{value}", "tp_loss": f"tp-loss-{value}", "offload": f"offload-{value}",
                          "routing": f"routing-{value}", "attention": f"attn-{value}"}.get(name, str(value)))
    if options.param_groups != default.param_groups:
        parts.append(f"groups-{options.param_groups}")
    if options.memory_budget is not None:
        parts.append(f"budget{options.memory_budget:g}")
    if options.accumulation_steps != 1:
        parts.append(f"accum{options.accumulation_steps}")
    if options.quantize != "none":
        parts.append(options.quantize)
    if options.lora != "none":
        parts.append("lora-" + options.lora.replace(",", "-").replace("=", "").replace("+", "-"))
    if options.frozen:
        parts.append("freeze-" + "+".join(options.frozen))
    if options.trainable:
        parts.append("train-" + "+".join(options.trainable))
    if rollout is not None:
        digest = hashlib.sha256(repr(rollout).encode()).hexdigest()[:8]
        parts.append(f"rl-p{rollout.prompt_len}-c{rollout.new_tokens}-g{rollout.group_size}-{digest}")
    return Path("reports") / re.sub(r"[^A-Za-z0-9_.+-]+", "_", "-".join(parts))


def write_json(json_path: str | None, data: dict) -> None:
    """--json PATH writes the result there (whole or not at all); --json - prints it (and
    nothing else) on stdout."""
    if json_path is None:
        return
    text = json.dumps(data, indent=2) + "\n"
    if is_stdout(json_path):
        sys.stdout.write(text)
    else:
        write_text_atomic(Path(json_path), text)


def write_outputs(json_path: str | None, data: dict, write_files: Callable[[StagedFiles], T]) -> T:
    """Every output of a command, all or none: ``write_files`` stages the report (and --emit's
    files), --json joins them, and they are renamed into place together, JSON last
    (``batchfit.report.write``); --json - is printed once they are."""
    with staged_files() as files:
        written = write_files(files)
        if json_path is not None and not is_stdout(json_path):
            files.text(Path(json_path), json.dumps(data, indent=2) + "\n")
    if is_stdout(json_path):
        write_json(json_path, data)
    return written


@contextlib.contextmanager
def progress_line(total: int | None = None, stream: Console | None = None) -> Iterator[Callable[[str], None]]:
    """What the engine is doing, on stderr: a spinner in a terminal; one plain line per stage
    when stderr is a pipe or a log (so a CI log shows progress as it happens). With ``total``
    (stages the command knows it will run), each stage shows '[k/total, ETA s]'."""
    console = stream or err
    started = time.perf_counter()
    done = 0

    def counted(message: str) -> str:
        nonlocal done
        if total is None:
            return message
        done += 1
        elapsed = time.perf_counter() - started
        eta = f", ETA {elapsed / (done - 1) * (total - done + 1):.0f} s" if done > 1 else ""
        return f"{message} [{done}/{total}{eta}]"

    if not console.is_terminal:
        def say(message: str) -> None:
            console.print(f"[{time.perf_counter() - started:6.1f} s] {escape(counted(message))}",
                          highlight=False, soft_wrap=True)

        yield say
        return
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("starting", total=None)
        yield lambda message: progress.update(task, description=escape(counted(message)))
