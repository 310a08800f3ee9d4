"""Probing on CPU: the virtual device, OOM and only OOM, cleanup, isolation, ranks."""

from __future__ import annotations

import gc
import json
import os
import socket
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from batchfit.cli.app import app
from batchfit.errors import OptionError, UsageError
from batchfit.probe.find import find_max_batch, peak_of
from batchfit.probe.runner import probe_isolated, probe_once
from batchfit.specs import load_workload
from batchfit.targets import parse_target
from batchfit.workload import StepOptions, Workload

SMALL = "virtual:2GiB"  # 1.5 GiB usable: 1 GiB leaves too little for the allocator's segments


# gpt-tinystories-22m with one block instead of four: what these tests claim is the search's and
# the probe's, not the depth's, and each trace costs a quarter of the zoo model's.
TINY = f"{Path(__file__).parent / 'cpu_truth.py'}:one_block_tinystories"


def tiny(seq_len: int = 32) -> Workload:
    return load_workload(TINY, seq_len=seq_len)


def test_virtual_device_finds_the_exact_maximum_in_two_probes():
    result = find_max_batch(tiny(), target=parse_target(SMALL), largest=4096)
    best = result.max_batch_size
    assert best > 0 and result.search.exact
    assert [t.batch_size for t in result.search.trials] == [best, best + 1]
    j = result.to_json()
    assert {"policy", "max_batch_size", "trials", "recommendations"} <= set(j)
    assert {"batch_size", "status", "peak_allocated_bytes", "peak_reserved_bytes", "step_time_s", "loss",
            "error"} <= set(j["trials"][0])


def test_tiers_are_predicted_with_at_most_one_extra_probe():
    """On a virtual device the search finds the maximum in two probes; the production and
    conservative tiers come from the measured line, and only one more probe is made."""
    result = find_max_batch(tiny(), target=parse_target("virtual:2GiB"), largest=4096)
    assert len(result.trials) <= len(result.search.trials) + 1
    tiers = {r.name: r for r in result.recommendations}
    capacity = result.capacity_bytes
    for name, util in (("production", 0.9), ("conservative", 0.75)):
        tier = tiers[name]
        assert tier.batch_size < result.max_batch_size
        assert tier.peak_allocated_bytes <= util * capacity  # probed, or predicted by the line
        assert tier.source in ("probed", "predicted")
        assert ("not probed" in tier.why) == (tier.source == "predicted")


@pytest.mark.slow
def test_verify_tiers_probes_every_tier():
    result = find_max_batch(tiny(), target=parse_target("virtual:2GiB"), largest=4096, verify_tiers=True)
    tiers = [r for r in result.recommendations if r.name in ("production", "conservative")]
    assert len(tiers) == 2
    for tier in tiers:
        trial = result.trial(tier.batch_size)
        assert tier.source == "probed" and trial is not None and trial.fits
        util = result.target_util if tier.name == "production" else 0.75
        assert peak_of(trial) <= util * result.capacity_bytes  # reserved: what a GPU runs out of
        above = result.trial(tier.batch_size + result.multiple_of)  # shown to be the largest
        assert above is not None and (not above.fits or peak_of(above) > util * result.capacity_bytes)


def test_isolated_probe_sends_back_the_childs_error():
    trial = probe_isolated("no_such_model_anywhere", None, StepOptions(), parse_target(SMALL), 8)
    assert trial.status == "error" and "unknown model 'no_such_model_anywhere'" in trial.error


def test_isolated_probe_times_out_instead_of_hanging():
    trial = probe_isolated("gpt-tinystories-22m", 32, StepOptions(), parse_target(SMALL), 8, timeout_s=0.01)
    assert trial.status == "error" and "did not answer within 0.01 s" in trial.error


def exploding(limit: int) -> Workload:
    def loss_fn(model, x):
        if x.shape[0] > limit:
            raise ValueError(f"my loss cannot take more than {limit} samples")
        return model(x).pow(2).mean()

    return Workload(name="exploding", build_model=lambda: nn.Linear(64, 64),
                    make_batch=lambda b, device: torch.randn(b, 64, device=device), loss_fn=loss_fn)


def test_a_non_oom_error_stops_the_search_and_keeps_what_was_measured():
    result = find_max_batch(exploding(40), target=parse_target(SMALL), policy="binsearch", largest=1024)
    stop = result.stopped_by
    assert stop.status == "error" and stop.batch_size == 64
    assert "ValueError: my loss cannot take more than 40 samples" in stop.error
    assert [t.batch_size for t in result.trials if t.fits] == [1, 2, 4, 8, 16, 32]  # kept
    assert all(t.status != "oom" for t in result.trials)


def test_nan_loss_is_an_error_when_asked():
    work = Workload(name="nan", build_model=lambda: nn.Linear(8, 8),
                    make_batch=lambda b, device: torch.randn(b, 8, device=device),
                    loss_fn=lambda model, x: model(x).sum() * float("nan"))
    trial = probe_once(work, StepOptions(), parse_target("cpu"), 4, stop_on_nan=True)
    assert trial.status == "error" and "NonFiniteLoss" in trial.error


def test_cpu_probes_run_real_steps():
    trial = probe_once(tiny(), StepOptions(), parse_target("cpu"), 2)
    assert trial.status == "ok" and trial.step_time_s > 0 and trial.loss > 0
    assert trial.peak_allocated_bytes is None  # no memory figures on the CPU


def test_a_failed_probes_model_and_optimizer_are_garbage_collected():
    refs = []

    def build_model():
        model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
        refs.append(weakref.ref(model))
        return model

    def build_optimizer(params):
        optimizer = torch.optim.AdamW(params)
        refs.append(weakref.ref(optimizer))
        return optimizer

    work = Workload(name="gc", build_model=build_model, build_optimizer=build_optimizer,
                    make_batch=lambda b, device: torch.randn(b, 1024, device=device),
                    loss_fn=lambda model, x: model(x).sum())
    gc.disable()  # prove it is probe_once's own cleanup that frees them
    try:
        trial = probe_once(work, StepOptions(), parse_target("virtual:600MiB"), 64)  # 24 MiB for tensors
    finally:
        gc.enable()
    assert trial.status == "oom"
    assert len(refs) == 2 and all(ref() is None for ref in refs)


def test_isolated_probe_gives_the_same_trial(tmp_path):
    target = parse_target(SMALL)
    inline = probe_once(tiny(), StepOptions(), target, 8)
    isolated = probe_isolated(TINY, 32, StepOptions(), target, 8)
    assert isolated == inline


def test_bad_targets_say_what_to_type():
    with pytest.raises(OptionError, match="virtual:h100-80gb"):
        parse_target("tpu")
    with pytest.raises(UsageError, match="no CUDA device"):
        if torch.cuda.is_available():
            raise UsageError("no CUDA device (skipped: there is one)")
        parse_target("cuda")


def _rank_main(rank: int, port: int, capacities: list[str], out_dir: str) -> None:
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    result = find_max_batch(tiny(), target=parse_target(f"virtual:{capacities[rank]}"), largest=4096)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"max": result.max_batch_size, "probes": [t.batch_size for t in result.trials]}, f)
    torch.distributed.barrier()  # neither rank tears the group down while the other still uses it
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_ranks_agree_one_ranks_oom_is_everyones(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    capacities = ["2GiB", "1GiB"]  # rank 1 runs out first
    torch.multiprocessing.spawn(_rank_main, args=(port, capacities, str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    alone = find_max_batch(tiny(), target=parse_target("virtual:1GiB"), largest=4096).max_batch_size
    assert ranks[0] == ranks[1] and ranks[0]["max"] == alone


runner = CliRunner()


def test_probe_cli_writes_the_report(tmp_path):
    result = runner.invoke(app, ["probe", TINY, "--seq-len", "32", "--device", SMALL,
                                 "--multiple-of", "8", "--global-batch", "256", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert {p.name for p in tmp_path.iterdir()} == {"report.md", "memory.png", "probe.json"}
    data = json.loads((tmp_path / "probe.json").read_text())
    assert data["max_batch_size"] % 8 == 0 and data["exact"]
    assert any(r["name"] == "global batch" for r in data["recommendations"])


def test_probe_cli_reports_a_stopping_error_with_exit_code_1(tmp_path):
    (tmp_path / "boom.py").write_text(
        "import torch\nfrom torch import nn\nfrom batchfit import Workload\n"
        "def workload():\n"
        "    def loss(m, x):\n"
        "        if x.shape[0] > 4: raise RuntimeError('CUDA error: invalid configuration argument')\n"
        "        return m(x).sum()\n"
        "    return Workload(name='boom', build_model=lambda: nn.Linear(8, 8),\n"
        "                    make_batch=lambda b, d: torch.randn(b, 8, device=d), loss_fn=loss)\n")
    result = runner.invoke(app, ["probe", f"{tmp_path}/boom.py:workload", "--device", SMALL, "--policy", "power",
                                 "--out", str(tmp_path / "r")])
    assert result.exit_code == 1
    assert "invalid configuration argument" in result.output and "not out of memory" in result.output
    assert json.loads((tmp_path / "r" / "probe.json").read_text())["stopped_by"]["batch_size"] == 8


@pytest.mark.parametrize("args,message", [
    (["--device", "tpu"], "virtual:h100-80gb"),
    (["--device", "virtual:h10-80gb"], "did you mean"),
    (["--policy", "fast"], "guided"),
    (["--min", "10", "--max", "5"], "--min"),
    (["--steps", "1"], "at least 2"),
])
def test_probe_bad_input_exit_code_2(args, message, tmp_path):
    result = runner.invoke(app, ["probe", "gpt-tinystories-22m", *args, "--out", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_probe_takes_the_same_device_options_as_estimate(tmp_path):
    """--gpu t4-16gb is --device virtual:t4-16gb: the same search, the same answer."""
    answers = []
    for args in (["--gpu", "t4-16gb"], ["--device", "virtual:t4-16gb"]):
        result = runner.invoke(app, ["probe", TINY, "--seq-len", "32", *args, "--max", "64",
                                     "--out", str(tmp_path / args[1]), "--json", "-"])
        assert result.exit_code == 0, result.output
        data = json.loads(result.stdout)
        answers.append((data["max_batch_size"], data["device"]["name"], data["capacity_bytes"]))
    assert answers[0] == answers[1] and answers[0][1] == "t4-16gb" and answers[0][0] == 64


def test_global_batch_accumulation_respects_the_granularity():
    from batchfit.probe.find import _recommend
    from batchfit.search import SearchResult, Trial

    trials = [Trial(b, "ok" if b <= 96 else "oom", peak_allocated_bytes=b * 10 if b <= 96 else None) for b in (96, 104)]
    result = SearchResult(96, trials, 104, capped=False, multiple_of=8)
    no_probe = lambda b: pytest.fail("nothing needs probing")  # noqa: E731
    space = {"lo": 8, "hi": 4096, "multiple_of": 8}
    recs = {r.name: r for r in _recommend(result, no_probe, trials, None, 0.9, 512, space)[0]}
    assert (recs["global batch"].batch_size, recs["global batch"].accumulation_steps) == (64, 8)  # 64 | 512, <= 96
    recs = {r.name: r for r in _recommend(result, no_probe, trials, None, 0.9, 100, space)[0]}
    assert recs["global batch"].batch_size == 0 and "multiple of 8" in recs["global batch"].why


def test_guided_on_cpu_grows_from_the_smallest_size():
    result = find_max_batch(tiny(8), target=parse_target("cpu"), largest=4)
    assert [t.batch_size for t in result.trials] == [1, 2, 4]  # never starts at the cap on a CPU
    assert result.max_batch_size == 4 and result.search.capped


def test_a_tier_probe_that_fails_keeps_what_was_measured():
    """Peaks on the line 40 + 20 b bytes, 2000 usable: the maximum 96 ran, 97 did not. The one
    extra probe checks the production tier, (0.9 x 2000 - 40) / 20 = 88, and fails with an error:
    the maximum stays, the tiers stay predicted from the line (88; 75%: (1500 - 40) / 20 = 73),
    and the error is reported."""
    from batchfit.probe.find import SearchStopped, _recommend
    from batchfit.search import SearchResult, Trial

    trials = [Trial(b, "ok", peak_allocated_bytes=40 + 20 * b) for b in (64, 96)] + [Trial(97, "oom")]

    def probe(b):
        trials.append(Trial(b, "error", error="ValueError: boom"))
        raise SearchStopped(trials[-1])

    result = SearchResult(96, trials[:], 97, capped=False, multiple_of=1)
    recs, stopped = _recommend(result, probe, trials, 2000, 0.9, None, {"lo": 1, "hi": 4096, "multiple_of": 1})
    assert stopped.batch_size == 88 and [t.batch_size for t in trials] == [64, 96, 97, 88]  # one probe only
    assert [(r.name, r.batch_size, r.source) for r in recs] == [
        ("maximum", 96, "probed"), ("production", 88, "predicted"), ("conservative", 73, "predicted")]


def linear_failing_at(bad: int | None) -> Workload:
    def loss_fn(model, x):
        if x.shape[0] == bad:
            raise ValueError(f"my loss cannot take {bad} samples")
        return model(x).pow(2).mean()

    return Workload(name="linear", build_model=lambda: nn.Sequential(nn.Linear(256, 1024), nn.Linear(1024, 256)),
                    make_batch=lambda b, device: torch.randn(b, 256, device=device), loss_fn=loss_fn)


def test_probe_keeps_the_maximum_when_the_tier_probe_fails():
    """The same on the virtual device: the extra probe's size is learnt from a clean run, then a
    workload that fails at exactly that size must keep the maximum and report the error."""
    target = parse_target("virtual:1GiB")
    clean = find_max_batch(linear_failing_at(None), target=target, largest=1 << 16)
    extra = clean.trials[len(clean.search.trials):]
    assert len(extra) == 1  # the production tier's check
    failing = find_max_batch(linear_failing_at(extra[0].batch_size), target=target, largest=1 << 16)
    assert failing.stopped_by.batch_size == extra[0].batch_size and "my loss" in failing.stopped_by.error
    assert failing.max_batch_size == clean.max_batch_size > 0
    names = {r.name: r for r in failing.recommendations}
    assert names["maximum"].batch_size == clean.max_batch_size
    assert names["production"].source == "predicted"  # the probe that would have confirmed it failed
    from batchfit.report.probe_markdown import probe_markdown

    assert f"Maximum batch size: {clean.max_batch_size}**" in probe_markdown(failing)
    assert "The maximum below ran; the tiers are predicted" in probe_markdown(failing)


def test_probe_on_a_bare_cpu_is_refused_before_torch_loads():
    """--device cpu alone has no memory to run out of: the search would double the batch with
    real CPU steps up to --max. Refused in one line that says what to add, before torch loads."""
    import subprocess
    import sys

    script = ("import sys\nfrom typer.testing import CliRunner\nfrom batchfit.cli.app import app\n"
              "r = CliRunner().invoke(app, ['probe', 'gpt-tinystories-22m', '--device', 'cpu'])\n"
              "print(r.exit_code, 'torch' in sys.modules)\nprint(r.output)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    status, output = out.split("\n", 1)
    assert status == "2 False", out
    assert "has no memory to run out of" in output and "--gpu t4-16gb" in output and "--max N" in output
    assert len([line for line in output.splitlines() if line.startswith("error:")]) == 1


def test_a_bare_cpu_target_needs_a_cap_in_python_too():
    with pytest.raises(OptionError, match="largest=N"):
        find_max_batch(tiny(8), target=parse_target("cpu"))


def test_cpu_sized_for_a_gpu_stops_where_the_gpu_runs_out():
    """--device cpu --gpu-memory 600MiB: each probe's memory is traced for that GPU (the virtual
    device's answer, probe for probe), and the CPU runs the steps that fit for their time."""
    from batchfit.targets import resolve_target

    work = linear_failing_at(None)
    virtual = find_max_batch(work, target=parse_target("virtual:600MiB"), largest=1 << 16)
    cpu = find_max_batch(work, target=resolve_target(device="cpu", gpu_memory="600MiB"), largest=1 << 16)
    assert cpu.max_batch_size == virtual.max_batch_size and cpu.search.exact
    assert [(t.batch_size, t.status, t.peak_allocated_bytes) for t in cpu.trials] == \
        [(t.batch_size, t.status, t.peak_allocated_bytes) for t in virtual.trials]
    assert all(t.step_time_s > 0 for t in cpu.trials if t.fits)  # really ran on the CPU
    assert cpu.to_json()["source"] == "cpu time, traced memory"


def test_an_isolated_probe_keeps_the_gpu_a_cpu_target_is_sized_for():
    """The child gets the Target itself (pickled): 'cpu' sized for a GPU has the GPU only in the
    object, not in its spec ('cpu'), so a spec-rebuilt target would lose the memory limit. The
    child's function, run here on a pipe, traces memory for that GPU."""
    import multiprocessing
    import pickle

    from batchfit.probe.runner import _isolated_child
    from batchfit.targets import resolve_target

    target = resolve_target(device="cpu", gpu_memory="2GiB")
    assert pickle.loads(pickle.dumps(target)) == target and target.spec == "cpu"
    receive, send = multiprocessing.Pipe(duplex=False)
    _isolated_child(send, TINY, 32, StepOptions().to_json(), target, 2, 2, False, "reserved")
    child = receive.recv()
    inline = probe_once(tiny(), StepOptions(), parse_target(SMALL), 2)  # the same GPU, traced
    assert child["status"] == "ok" and child["step_time_s"] > 0
    assert (child["peak_allocated_bytes"], child["peak_reserved_bytes"]) == \
        (inline.peak_allocated_bytes, inline.peak_reserved_bytes)


def test_the_report_has_one_memory_per_sample_and_the_headroom_of_the_limit():
    """One line, stated: per sample = (peak(b2) - peak(b1)) / (b2 - b1) through the two largest
    batches that fit, with peak the reserved figure that --limit reserved compares; the same in
    the JSON, the Memory per sample section and the predicted tiers. Headroom = usable - reserved."""
    from batchfit.devices import format_bytes
    from batchfit.report.probe_markdown import probe_markdown

    result = find_max_batch(linear_failing_at(None), target=parse_target("virtual:1GiB"), largest=1 << 16)
    fit = sorted((t.batch_size, t.peak_reserved_bytes) for t in result.trials if t.fits)
    (b1, p1), (b2, p2) = fit[-2:]
    per_sample = (p2 - p1) / (b2 - b1)
    assert result.to_json()["memory_per_sample_bytes"] == round(per_sample)
    text = probe_markdown(result)
    assert f"**{format_bytes(per_sample)} per sample** on top of {format_bytes(p2 - per_sample * b2)} fixed" in text
    predicted = [r for r in result.recommendations if r.source == "predicted"]
    assert predicted and all(f"({format_bytes(per_sample)} per sample)" in r.why for r in predicted)
    best = result.trial(result.max_batch_size)
    headroom = (result.capacity_bytes - best.peak_reserved_bytes) / 2**30
    assert f"reserved must fit (`--limit reserved`): {best.peak_reserved_bytes / result.capacity_bytes:.1%} used, " \
           f"headroom {headroom:.2f} GiB" in text
