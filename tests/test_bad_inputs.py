"""Bad input, over every command (issue 19, as the newcomer's 147 inputs did): a wrong model
spec, GPU name, size or option value exits 1 or 2 with ONE line that says what to type
instead, and no traceback. Each row names the words the line must hold."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from batchfit.cli.app import app

runner = CliRunner()
TINY = ["gpt-tinystories-22m", "--seq-len", "16"]
HUGE = "99999999999999999999"
DATA = Path(__file__).resolve().parent / "data"
TITAN = DATA / "torchtitan"  # torchtitan job tomls (tests/test_torchtitan.py)
README = str(Path(__file__).resolve().parents[1] / "README.md")  # a regular file
TEXT = ["--data", str(Path(__file__).resolve().parents[1] / "README.md"), "--tokenizer", "bytes",
        "--cache-dir", "cache"]  # past int64: overflowed inside torch

ROWS = {
    "estimate": [
        (["gpt-tinystorie", "--gpu", "t4"], "did you mean 'gpt-tinystories-22m'"),
        ([*TINY, "--gpu", "h100-8gb"], "did you mean"),
        ([*TINY, "--gpu-memory", "24QB"], "24GiB"),
        ([*TINY, "--gpu", "t4", "--precision", "fp8x"], "bf16-mixed"),
        ([*TINY, "--gpu", "t4", "--precision", "bf16-mix"], "unknown precision"),  # not a bf16 warning first
        ([*TINY, "--gpu", "t4", "--precision", "fp8"], "fp8-tensorwise"),
        ([*TINY, "--gpu", "t4", "--checkpointing", "some"], "full"),
        ([*TINY, "--gpu", "t4", "--batch-sizes", HUGE], "from 1 to 16,777,216"),
        (["gpt-tinystories-22m", "--gpu", "t4", "--seq-len", HUGE], "from 1 to 16,777,216"),
        ([*TINY, "--gpu", "t4", "--accumulation-steps", HUGE], "from 1 to 16,777,216"),
        ([*TINY, "--gpu", "t4", "--max-batch", "0"], "--max-batch"),
        ([*TINY, "--gpu", "t4", "--multiple-of", "0"], "--multiple-of"),
        ([*TINY, "--gpu", "t4", "--max-batch", HUGE], "at most 16,777,216"),
        ([*TINY, "--gpu", "t4", "--multiple-of", HUGE], "at most 16,777,216"),
        ([*TINY, "--gpu", "t4", "--offload", "optimizer"], "activations+params"),
        ([*TINY, "--gpu", "t4", "--offload", "params"], "--strategies fsdp"),
        ([*TINY, "--gpu", "t4", "--offload", "activations", "--host-memory", "lots"], "512GiB"),
        ([*TINY, "--gpu", "t4", "--offload", "activations", "--host-memory", "0GiB"], "512GiB"),
        ([*TINY, "--gpu", "t4", "--quantize", "nf5"], "nf4-dq"),
        ([*TINY, "--gpu", "t4", "--quantize", "nf4"], "nothing would train: add --lora, e.g. --lora r=16"),
        ([*TINY, "--gpu", "t4", "--lora", "rank=8"], "r=16"),
        ([*TINY, "--gpu", "t4", "--optimizer", "adamw-torchao-8bit"], "adamw-8bit"),
        ([*TINY, "--gpu", "t4", "--trainer", "args.json"], "no such file"),
        ([*TINY, "--gpu", "t4", "--trainer", str(DATA / "latin1_args.json")],
         "is not UTF-8 text (byte 0xe9 on line 1)"),
        ([*TINY, "--gpu", "t4", "--emit", "trainer:fitted.json"], "--trainer args.json"),
        ([*TINY, "--gpu", "t4", "--memory-budget", "0.5"], "add --compile model"),
        ([*TINY, "--gpu", "t4", "--compile", "model", "--memory-budget", "1.5"], "from 0 to 1"),
        ([*TINY, "--gpu", "t4", "--compile", "model", "--memory-budget", "half"], "--memory-budget"),
        ([*TINY, "--gpu", "t4", "--routing", "even"], "capacity:F"),
        ([f"torchtitan:{TITAN / 'debug_model.toml'}", "--gpu", "t4"], "use batchfit plan torchtitan:"),
        ([*TINY, "--gpu", "t4", "--global-batch", "0"], "1 or more"),
        ([*TINY, "--gpu", "t4", "--global-batch", HUGE], "at most 16,777,216"),
        ([*TINY, "--gpu", "t4", "--global-batch", "63", "--multiple-of", "2"], "--global-batch 64"),
        ([*TINY, "--gpu", "t4", "--global-batch", "64", "--accumulation-steps", "4"], "drop --accumulation-steps"),
    ],
    "probe": [
        (["gpt-tinystorie", "--device", "virtual:t4"], "did you mean 'gpt-tinystories-22m'"),
        ([*TINY, "--device", "virtual:h100-8gb"], "did you mean"),
        ([*TINY, "--device", "tpu"], "cuda"),
        ([*TINY, "--device", "virtual:t4", "--min", "0"], "--min"),
        ([*TINY, "--device", "virtual:t4", "--min", "8", "--max", "4"], "--max"),
        ([*TINY, "--device", "virtual:t4", "--policy", "fast"], "guided"),
        ([*TINY, "--device", "virtual:t4", "--multiple-of", HUGE], "at most 16,777,216"),
        ([*TINY, "--device", "virtual:t4", "--global-batch", HUGE], "at most 16,777,216"),
        ([*TINY, "--device", "virtual:t4", "--offload", "activation"], "activations+params"),
        ([*TINY, "--device", "virtual:t4", "--routing", "capacity:0"], "capacity:1.25"),
    ],
    "bench": [
        (["gpt-tinystorie", "--device", "virtual:t4"], "did you mean 'gpt-tinystories-22m'"),
        ([*TINY, "--device", "virtual:h100-8gb"], "did you mean"),
        ([*TINY, "--device", "virtual:t4", "--batch-sizes", "0"], "from 1 to"),
        ([*TINY, "--device", "virtual:t4", "--batch-sizes", HUGE], "from 1 to 16,777,216"),
        ([*TINY, "--device", "virtual:t4", "--steps", "0"], "--steps 10"),
        ([*TINY, "--device", "virtual:t4", "--accumulation-steps", HUGE], "from 1 to 16,777,216"),
        (["gpt-tinystories-22m", "--device", "virtual:t4", "--seq-len", HUGE], "from 1 to 16,777,216"),
        ([*TINY, "--device", "virtual:t4", "--offload", "none+activations"], "activations+params"),
        ([*TINY, "--device", "virtual:t4", "--trainer", "args.py"], "no such file"),
        ([*TINY, "--device", "virtual:t4", "--routing", "capacity:x"], "capacity:1.25"),
    ],
    "plan": [
        (["gpt-tinystorie", "--gpu", "h100", "--gpus", "2"], "did you mean 'gpt-tinystories-22m'"),
        ([*TINY, "--gpu", "h100-8gb", "--gpus", "2"], "did you mean"),
        ([*TINY, "--gpu", "h100", "--gpus", HUGE], "--gpus"),
        ([*TINY, "--gpu", "h100", "--gpus", "2", "--strategies", "zero9"], "fsdp"),
        ([*TINY, "--gpu", "h100", "--gpus", "2", "--strategies", "zero3"], "zero1, zero2"),
        ([*TINY, "--gpu", "h100", "--gpus", "2", "--optimizer", "muon2"], "muon"),
        ([*TINY, "--gpu", "h100", "--gpus", "2", "--tokens", "lots"], "chinchilla"),
        ([*TINY, "--gpu", "h100", "--gpus", "2", "--tokens", "1e999"], "not a finite count"),
        ([*TINY, "--gpu", "h100", "--nodes", HUGE, "--gpus-per-node", "8"], "at most 1,048,576 GPUs"),
        ([*TINY, "--gpu", "h100", "--gpus", "2", "--batch-sizes", HUGE], "from 1 to 16,777,216"),
        ([*TINY, "--gpu", "h100", "--gpus", "2", "--limit", "reservd"],
         "use reserved (what a GPU runs out of) or allocated"),
        ([*TINY, "--gpu", "h100", "--gpus", "2", "--strategies", "tp2", "--tp-loss", "split"], "gathered"),
        ([*TINY, "--gpu", "h100", "--gpus", "2", "--strategies", "tp2", "--loss", "chunked:4"],
         "does not run under tensor parallelism"),
        ([*TINY, "--gpu", "h100", "--gpus", "2", "--offload", "params+params"], "activations+params"),
        ([*TINY, "--gpu", "h100", "--gpus", "2", "--strategies", "ddp,fsdp", "--offload", "params"],
         "ddp on 2 GPUs has no FSDP"),
        ([*TINY, "--gpu", "h100", "--gpus", "2", "--host-memory", "512"], "512GiB"),
        ([*TINY, "--gpu", "h100", "--gpus", "2", "--emit", "trainer:fitted.json"], "--trainer args.json"),
        ([*TINY, "--gpu", "h100", "--gpus", "3", "--strategies", "pp2"], "must equal the GPU count"),
        ([*TINY, "--gpu", "h100", "--gpus", "4", "--strategies", "pp4", "--microbatches", "2"],
         "at least 4 micro-batches"),
        ([*TINY, "--gpu", "h100", "--gpus", "2", "--strategies", "pp2", "--pp-schedule", "zb"], "interleaved-1f1b"),
        ([*TINY, "--gpu", "h100", "--gpus", "3", "--strategies", "pp3"], "do not split into 3 equal stages"),
        ([*TINY, "--gpu", "h100", "--gpus", "2", "--routing", "best"], "worst"),
        ([*TINY, "--gpu", "h100", "--gpus", "3", "--strategies", "fsdp+cp2"], "must equal the GPU count"),
        ([*TINY, "--gpu", "h100", "--gpus", "2", "--strategies", "cp2"], "data-parallel wrap"),
        (["gpt-tinystories-22m", "--seq-len", "20", "--gpu", "h100", "--gpus", "4", "--strategies", "fsdp+cp4"],
         "must divide by 2 x cp = 8"),
        ([*TINY, "--gpu", "h100", "--gpus", "4", "--strategies", "pp2+fsdp+cp2"], "inside a pipeline"),
        (["byte-elman-400m", "--seq-len", "16", "--gpu", "h100", "--gpus", "2", "--strategies", "fsdp+cp2"],
         "no attention through"),
        ([f"torchtitan:{TITAN / 'unknown_model.toml'}", "--gpu", "h100", "--gpus", "2"], "for other models use hf:"),
        ([f"torchtitan:{TITAN / 'malformed.toml'}", "--gpu", "h100", "--gpus", "2"], "is not valid TOML"),
        ([f"torchtitan:{TITAN / 'unknown_section.toml'}", "--gpu", "h100", "--gpus", "2"], "unknown section [trainer]"),
        ([f"torchtitan:{TITAN / 'latin1.toml'}", "--gpu", "h100", "--gpus", "2"],
         "is not UTF-8 text (byte 0xe9 on line 1)"),
        ([f"torchtitan:{TITAN / 'debug_model.toml'}", "--gpu", "h100"], "give --gpus N"),
        ([f"torchtitan:{TITAN / 'debug_model.toml'}", "--gpu", "h100", "--gpus", "2", "--checkpointing", "full"],
         "set [activation_checkpoint] mode"),
        ([f"torchtitan:{TITAN / 'missing.toml'}", "--gpu", "h100", "--gpus", "2"], "cannot read torchtitan job"),
        (["torchtitan:config_registry.py:llama3_debug", "--gpu", "h100", "--gpus", "2"],
         "give a torchtitan 0.2.x job .toml"),
        ([*TINY, "--gpu", "h100", "--gpus", "2", "--emit", "torchtitan:nofolder/job.toml"], "does not exist"),
        ([*TINY, "--gpu", "h100", "--gpus", "8", "--strategies", "ep3+fsdp"], "must divide their 8"),
        ([*TINY, "--gpu", "h100", "--gpus", "8", "--strategies", "ep2+ddp"], "composes with fsdp"),
        ([*TINY, "--gpu", "h100", "--gpus", "2", "--strategies", "ep2+fsdp"], "no mixture-of-experts layers"),
        (["hf:qwen3-moe-30b-a3b", "--seq-len", "16", "--gpu", "h100", "--gpus", "256", "--strategies", "ep256+fsdp"],
         "do not split over ep256"),
    ],
    "sweep": [
        (["gpt-tinystorie", "--batch-sizes", "2,4", "--samples", "8"], "did you mean 'gpt-tinystories-22m'"),
        ([*TINY, "--batch-sizes", "2;4", "--samples", "8"], "8,16,32"),
        ([*TINY, "--batch-sizes", HUGE, "--samples", "8"], "from 1 to 16,777,216"),
        ([*TINY, "--batch-sizes", "2,4", "--tokens", "5Q"], "--tokens"),
        ([*TINY, "--batch-sizes", "2,4", "--tokens", "1e99"], "at most 9,007,199,254,740,992"),  # past SQLite's int64
        ([*TINY, "--batch-sizes", "2,4", "--samples", "8", "--cache-dir", f"{README}/cache"],
         "is a file, not a folder"),
        ([*TINY, "--batch-sizes", "2,4", "--samples", "8", "--lr-scaling", "cube"], "sqrt"),
        ([*TINY, "--batch-sizes", "2,4", "--samples", "8", "--gpu", "h100-8gb"], "did you mean"),
        ([*TINY, "--batch-sizes", "2,4", "--samples", "8", "--target-loss", "nan"], "--target-loss 3.5"),
        ([*TINY, "--batch-sizes", "2,4", "--samples", "8", "--grad-clip", "-1"], "--grad-clip 1.0; got -1"),
        ([*TINY, "--batch-sizes", "2,4", "--samples", "8", "--grad-clip", "nan"], "--grad-clip 1.0; got nan"),
    ],
    "noise": [
        (["gpt-tinystorie", "--batch-sizes", "2,8"], "did you mean 'gpt-tinystories-22m'"),
        ([*TINY, "--batch-sizes", "8"], "8,128"),
        ([*TINY, "--batch-sizes", "2,8", "--cache-dir", README], "--cache-dir takes a folder for token ids"),
        ([*TINY, "--batch-sizes", HUGE + ",8"], "from 1 to 16,777,216"),
        ([*TINY, "--batch-sizes", "2,8", "--device", "tpu"], "cuda"),
        ([*TINY, "--batch-sizes", "2,8", "--gpu", "t4"], "give --data"),  # --gpu sizes, the CPU trains
        ([*TINY, "--batch-sizes", "2,8", "--steps", "3", "--lr", "nan", *TEXT], "--lr 3e-4; got nan"),
        ([*TINY, "--batch-sizes", "2,8", "--steps", "3", "--lr", "-1", *TEXT], "--lr 3e-4; got -1"),
    ],
    "recommend": [
        (["gpt-tinystorie", "--batch-sizes", "1,2", "--tokens", "1M"], "did you mean 'gpt-tinystories-22m'"),
        ([*TINY, "--batch-sizes", "1,2", "--tokens", "1M", "--lr-scaling", "cube"], "sqrt"),
        ([*TINY, "--batch-sizes", "1,2", "--tokens", "1M", "--branch-at", "150%"], "10%,25%"),
        ([*TINY, "--batch-sizes", "4", "--tokens", "1M"], "at least two"),
        ([*TINY, "--batch-sizes", "1,2"], "--tokens"),
        ([*TINY, "--batch-sizes", "1,2", "--tokens", "1M", "--cache-dir", f"{README}/c"], "is a file, not a folder"),
        ([*TINY, "--batch-sizes", "1,64", "--tokens", "16384", "--max-share", "0"], "e.g. 20%"),
        ([*TINY, *TEXT, "--batch-sizes", "1,2", "--tokens", "16M"], "data too short for the budget"),
        ([*TINY, *TEXT, "--batch-sizes", "1,2", "--tokens", "16384", "--gpu-memory", "600MiB"],
         "even at micro-batch 1"),
        ([*TINY, "--batch-sizes", "1,2", "--tokens", "1M", "--cooldown", "100%"], "e.g. 75%"),
        ([*TINY, "--batch-sizes", "1,2", "--tokens", "1M", "--executor", "slurm"], "local"),
        ([*TINY, "--batch-sizes", "1,2", "--tokens", "1M", "--workers", "0"], "--workers must be 1 or more"),
    ],
    "gpus": [
        (["--gpu", "t4"], "No such option"),
    ],
    "zoo": [
        (["gpt2"], "unexpected extra argument"),
    ],
}
CASES = [pytest.param(command, args, words, id=f"{command}:{' '.join(args)[:60]}")
         for command, rows in ROWS.items() for args, words in rows]


@pytest.mark.parametrize("command,args,words", CASES)
def test_bad_input_is_one_line_that_says_what_to_type(command, args, words, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a row that slipped through writes its report here, not in the repository
    result = runner.invoke(app, [command, *args])
    assert result.exit_code in (1, 2), result.output
    assert "Traceback" not in result.output and result.exception is None or isinstance(result.exception, SystemExit)
    said = [line for line in result.output.splitlines()
            if line.startswith("error:") or "Invalid value" in line or "No such option" in line
            or "unexpected extra argument" in line]
    assert len(said) == 1, result.output
    assert words in said[0], result.output
