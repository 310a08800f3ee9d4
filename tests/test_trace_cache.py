"""trace/cache.py: a second question about the same model is answered from the trace cache,
with the result a run that traces everything (--no-cache) gives; a corrupted entry is
ignored and rewritten. Every test has its own $BATCHFIT_CACHE (conftest's ``_own_cache``).

Checked against batchfit's own traces run again with --no-cache (checks the cache, not the fidelity to a GPU)."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys

import pytest

from batchfit import load_workload
from batchfit.devices import Device
from batchfit.estimator.engine import estimate
from batchfit.trace import cache as trace_cache

# A llama of 10 tiny blocks (depth.MIN_BLOCKS): traced at depths 2, 3 and 4, its reserved
# stream written at full depth and replayed, as a large model is.
TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=10, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
MiB = 1 << 20


def _gpu(usable_mib: int, workspace_mib: int = 8) -> Device:
    """A GPU of ``usable_mib``: 34 MiB holds 5 of TINY's samples (reserved; batch 1 reserves 30 MiB)."""
    return Device(name=f"tiny-{usable_mib}", display_name=f"a {usable_mib} MiB GPU", total_bytes=usable_mib * MiB,
                  context_bytes=0, workspace_bytes=workspace_mib * MiB)


def _answer(spec: str, gpu: Device, *, cache: bool, said: list[str] | None = None, target_util: float = 0.9) -> dict:
    result = estimate(load_workload(spec, seq_len=32), device=gpu, cache=cache, max_batch=6, target_util=target_util,
                      suggest=False, progress=(said if said is not None else []).append)
    data = result.to_json()
    del data["created"], data["trace_seconds"]  # when, and how long: the rest must be the same
    return data


def _entries() -> list:
    return sorted(p for p in trace_cache.traces_dir().glob("*/*.pkl"))


@pytest.fixture
def spec(tmp_path) -> str:
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    return f"hf:{path}"


@pytest.mark.slow
def test_asked_again_answers_from_the_cache_as_no_cache_does(spec):
    gpu = _gpu(34)
    traced = _answer(spec, gpu, cache=False)
    assert _entries() == []  # --no-cache writes nothing
    assert traced["traced_by_depth"]["blocks"] == 10
    # the reserved search replayed sizes that fit and one that cannot reserve its memory
    assert 0 < traced["max_batch_size"] < 6 and any(p["reserved_oom"] for p in traced["points"])
    assert _answer(spec, gpu, cache=True) == traced
    said: list[str] = []
    assert _answer(spec, gpu, cache=True, said=said) == traced
    assert not any(m.startswith(("building", "tracing")) for m in said)  # nothing built or traced
    # another target, another GPU: identical to their own runs without the cache
    assert _answer(spec, gpu, cache=True, target_util=0.5) == _answer(spec, gpu, cache=False, target_util=0.5)
    other = _gpu(36, workspace_mib=4)
    assert _answer(spec, other, cache=True) == _answer(spec, other, cache=False)


@pytest.mark.slow
def test_a_corrupted_entry_is_ignored_and_rewritten(spec):
    gpu = _gpu(34)
    traced = _answer(spec, gpu, cache=True)
    entries = _entries()
    assert any(p.name.startswith("replay-") for p in entries) and any(p.name == "model.pkl" for p in entries)
    for path in entries:  # every entry: truncated, garbage, or a valid pickle of another key
        data = path.read_bytes()
        path.write_bytes(data[:len(data) // 2] if "depths" in path.name
                         else pickle.dumps(((trace_cache.FORMAT, "another key", path.stem), 0)) if "replay" in path.name
                         else b"not a pickle")
    said: list[str] = []
    assert _answer(spec, gpu, cache=True, said=said) == traced
    assert any(m.startswith("building") for m in said)  # traced again
    for path in _entries():  # and written again, whole
        with path.open("rb") as file:
            assert pickle.load(file)[0][2] == path.stem


def test_the_key_holds_the_model_file_options_and_versions(tmp_path, spec):
    def key(spec: str, **options) -> str:
        workload = load_workload(spec, seq_len=32)
        return trace_cache.for_curve(workload.cache_key, {"precision": "fp32", **options}, by_depth=True).key

    first = key(spec)
    assert key(spec) == first
    assert key(spec, precision="bf16") != first
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps({**TINY, "intermediate_size": 256}))  # the same spec, another model
    assert key(spec) != first
    assert trace_cache.for_curve(None, {}, by_depth=True) is None  # a Workload built in Python
    assert trace_cache.for_curve("zoo", {"compile": "model"}, by_depth=True) is None


def test_entries_are_atomic_bounded_and_cleared(tmp_path):
    cache = trace_cache.TraceCache({"workload": "w"}, folder=tmp_path, max_bytes=3000)
    assert cache.get("a") is None
    cache.put("a", list(range(100)))
    assert cache.get("a") == list(range(100))
    assert [p.name for p in cache.folder.iterdir()] == ["a.pkl"]  # no temporary file left
    other = trace_cache.TraceCache({"workload": "other"}, folder=tmp_path)
    other.folder.mkdir()
    os.replace(cache.folder / "a.pkl", other.folder / "a.pkl")
    assert other.get("a") is None and not (other.folder / "a.pkl").exists()  # another key's entry: removed
    for name in "bcdef":
        cache.put(name, bytes(1000))  # ~1 KB each: only the latest ones stay under 3000 bytes
    sizes = [p.stat().st_size for p in cache.folder.iterdir()]
    assert sum(sizes) <= 3000 and cache.get("f") == bytes(1000)
    assert trace_cache.clear(tmp_path) == (len(sizes), sum(sizes))
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_cli_cache_clear_and_no_cache(spec):
    from typer.testing import CliRunner

    from batchfit.cli.app import app

    cache = trace_cache.TraceCache({"workload": "w"})
    cache.put("a", 1)
    out = CliRunner().invoke(app, ["cache", "clear"])
    assert out.exit_code == 0 and "removed 1 cached traces" in out.output
    assert cache.get("a") is None
    assert "--no-cache" in CliRunner().invoke(app, ["estimate", "--help"]).output


def test_dataclass_results_survive_the_cache(tmp_path):
    # what a traced point holds (dataclasses of the tracer) comes back equal
    from batchfit.trace.approximation import Approximation

    cache = trace_cache.TraceCache({"workload": "w"}, folder=tmp_path)
    value = [Approximation(what="w", may_differ_by="m", source="s")]
    cache.put("approximations", value)
    assert cache.get("approximations") == value and dataclasses.is_dataclass(value[0])


def test_a_value_that_does_not_pickle_is_not_kept(tmp_path):
    cache = trace_cache.TraceCache({"workload": "w"}, folder=tmp_path)
    cache.put("f", lambda: 0)  # a lambda does not pickle: skipped, no temporary file left
    assert cache.get("f") is None and list(cache.folder.iterdir()) == []


ASKED_AGAIN = """
import json, sys
from typer.testing import CliRunner
from batchfit.cli.app import app
result = CliRunner().invoke(app, sys.argv[1:])
assert result.exit_code == 0, result.output
print(json.dumps({"heavy": sorted(m for m in ("torch", "transformers") if m in sys.modules),
                  "traced": "tracing" in result.output or "building" in result.output}))
"""


def test_the_cli_asked_again_loads_no_torch_and_answers_as_no_cache(tmp_path):
    # a 2-block llama (traced whole): the command asked again reads its traces and the workload's
    # figures from the cache (trace/deferred.py), and imports neither torch nor transformers
    from typer.testing import CliRunner

    from batchfit.cli.app import app

    config = tmp_path / "tiny2.json"
    config.write_text(json.dumps({**TINY, "num_hidden_layers": 2}))
    args = ["estimate", f"hf:{config}", "--gpu-memory", "610MiB", "--seq-len", "32", "--max-batch", "3"]

    def answer(name: str) -> dict:
        data = json.loads((tmp_path / name).read_text())
        del data["created"], data["trace_seconds"]
        return data

    for name, flags in (("cold.json", []), ("no-cache.json", ["--no-cache"])):
        out = CliRunner().invoke(app, [*args, *flags, "--json", str(tmp_path / name),
                                       "--out", str(tmp_path / name.removesuffix(".json"))])
        assert out.exit_code == 0, out.output
    again = subprocess.run([sys.executable, "-c", ASKED_AGAIN, *args, "--json", str(tmp_path / "again.json"),
                            "--out", str(tmp_path / "again")], capture_output=True, text=True, check=True)
    assert json.loads(again.stdout.splitlines()[-1]) == {"heavy": [], "traced": False}, again.stdout + again.stderr
    assert answer("again.json") == answer("no-cache.json") == answer("cold.json")
    assert answer("again.json")["max_batch_size"] > 0
    assert (tmp_path / "again" / "memory.png").read_bytes() == (tmp_path / "no-cache" / "memory.png").read_bytes()


def test_a_deferred_workload_resolves_to_the_loaded_one(spec):
    # known from the cache: its figures without loading; its functions load it; resolved() is the loaded
    # workload with what was set on the deferred one (or on a copy of it) since
    import dataclasses

    from batchfit.trace.deferred import load_deferred, resolved

    loaded = load_deferred(spec, seq_len=32)  # the first load writes the figures
    deferred = load_deferred(spec, seq_len=32)
    assert deferred.name == loaded.name and deferred.tokens_per_sample == loaded.tokens_per_sample == 32
    assert deferred.cache_key == loaded.cache_key and deferred.attention == loaded.attention
    assert resolved(loaded) is loaded and type(resolved(deferred).build_model) is type(loaded.build_model)
    copy = dataclasses.replace(deferred, description="cut")
    assert resolved(copy).description == "cut" and callable(resolved(copy).loss_fn)
    assert sum(p.numel() for p in deferred.build_model().parameters()) == sum(
        p.numel() for p in loaded.build_model().parameters())
    assert type(deferred.build_model).__name__ == "_Deferred"  # --no-cache loads it, whatever is kept:
    assert type(load_deferred(spec, seq_len=32, cache=False).build_model).__name__ == "function"


@pytest.mark.slow
def test_a_repeating_stack_read_from_the_cache_builds_the_whole_model_only():
    # grpo-gpt2-124m with 2 new tokens: generation runs the stack once per token (no size extrapolates in
    # depth), so it is traced whole from its first size; asked again for another size, no depth session is built
    from batchfit.devices import get_device
    from batchfit.trace.point import TracedCurve
    from batchfit.workload import StepOptions

    workload, device = load_workload("grpo-gpt2-124m", seq_len=2), get_device("rtx4090-24gb")
    with TracedCurve(workload, StepOptions(), device, cache=True, parallel=False) as first:
        first.point(8)
    said: list[str] = []
    with TracedCurve(workload, StepOptions(), device, said.append, cache=True) as again, \
            TracedCurve(workload, StepOptions(), device, by_depth=False) as whole:
        assert again.point(8) == first.point(8) and again._first is None  # read, nothing built
        assert again.point(16) == (whole.point(8), whole.point(16))[1]
        assert again._shallow == [] and again._forked is None and again._full is again._first
    assert [m for m in said if m.startswith(("building", "tracing"))] == [
        "building grpo-gpt2-124m on fake tensors", "tracing batch size 16"]


def test_an_empty_batchfit_cache_is_the_default_not_the_working_directory(monkeypatch, tmp_path):
    # `BATCHFIT_CACHE=$d batchfit ...` with d unset once left a traces/ folder in a checkout
    from batchfit.trace.cache import cache_root

    monkeypatch.setenv("BATCHFIT_CACHE", "")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_root() == tmp_path / ".cache" / "batchfit"
    monkeypatch.setenv("BATCHFIT_CACHE", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
