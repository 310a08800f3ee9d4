"""Reserved probes written from the line (trace/stream_line.py) against the same probes traced, on many families.

For HF families built from a tiny config (no weights: tests/support_matrix.py's, and gemma, falcon, stablelm) under
several strategies on small fake worlds and options, a ``DeepSession`` asks reserved memory at sizes as plan's search
does (9, then 4, which checks the line, then 6 and 3 between; then 12 above, which redraws it, then 10 and 7), and a
second session with the line off (``StreamLine.at`` returns None, as tests/test_stream_line.py does) traces a fresh
process at each size the first wrote. Compared: the replay (``ReservedReplay.to_json()``) and the written stream
against the traced one, event for event (idents renamed in order of allocation). Writes
benchmarks/results/stream_line_families-<date>.json.

    python benchmarks/stream_line_families.py [case-substring ...]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import batchfit.plan.deep as deep_module
from _common import write_result
from batchfit import StepOptions, get_device, load_workload
from batchfit.plan.deep import DeepSession
from batchfit.plan.sharded import parse_strategy
from batchfit.trace.stream import _canonical
from batchfit.trace.stream_line import StreamLine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support_matrix import FAMILIES, SEQ_LEN  # noqa: E402

_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=256, max_position_embeddings=256)
MORE = {  # families the support matrix does not list
    "gemma": dict(model_type="gemma", head_dim=16, **_TINY),
    "falcon": dict(model_type="falcon", new_decoder_architecture=True, num_kv_heads=2, alibi=False,
                   **{k: v for k, v in _TINY.items() if k not in ("intermediate_size", "num_key_value_heads")}),
    "stablelm": dict(model_type="stablelm", **_TINY),
}
CONFIGS = {**{f: c for f, c in FAMILIES.items() if f not in ("bert", "t5")}, **MORE}
STRATEGIES = [("fsdp", 2), ("hsdp2", 4), ("fsdp+tp2", 4), ("fsdp+cp2", 4), ("ddp", 2), ("zero2", 2)]
OPTIONS = [dict(precision="bf16-mixed", checkpointing="full"), dict(precision="fp32", checkpointing="none"),
           dict(precision="bf16-mixed", checkpointing="none"), dict(precision="fp32", checkpointing="full")]
ASKED = [9, 4, 6, 3, 12, 10, 7]
"""The reserved probes, in order: 9 traced (and 2, or the first trace's 1, the line's other end), 4 traced (checks
it), 6 and 3 written; 12 traced (above: the line redrawn through it), 10 and 7 written."""
MOE = ("mixtral", "qwen3_moe", "deepseek_v3")


def cases() -> list[dict]:
    """Each family under one strategy (in turn), the options in turn; then the options whose shapes are not plain in
    the batch (a loss cut in chunks of rows, an MoE's routing, an MoE's tokens per expert with a remainder) and two
    models deep enough to be cut to depths 2-4 (plan/deep.py)."""
    out = []
    for i, family in enumerate(CONFIGS):
        strategy, gpus = STRATEGIES[i % len(STRATEGIES)]
        if "tp" in strategy and family in MOE:
            strategy, gpus = "hsdp2", 4  # an MoE's experts are tensor-parallel only beside ep
        if "cp" in strategy and family in ("gemma2", "falcon"):
            strategy, gpus = "ddp", 2  # Gemma 2 runs eager attention, Falcon gives SDPA a mask: cp's ring takes neither
        options = OPTIONS[i % len(OPTIONS)]
        if "cp" in strategy:  # cp's ring takes flash or the memory-efficient kernel: not fp32's math kernel
            options = {**options, "precision": "bf16-mixed"}
        out.append(dict(family=family, strategy=strategy, gpus=gpus, options=options))
    bf16 = OPTIONS[0]
    fused = {**bf16, "loss": "fused-linear"}
    out += [dict(family="llama", strategy="fsdp", gpus=2, options=fused, asked=[9, 3, 5, 6, 7], unguarded=True),
            dict(family="llama", strategy="ddp", gpus=2, options={**bf16, "loss": "chunked:4"}),
            dict(family="qwen3_moe", strategy="fsdp", gpus=2, options={**bf16, "routing": "capacity:1.25"}),
            dict(family="mixtral", strategy="zero2", gpus=2, options={**OPTIONS[1], "routing": "worst"}),
            # 99 x 2 routed tokens a sample over 8 experts: whole at multiples of 4 only (trace/stream_line.py)
            dict(family="qwen3_moe", strategy="fsdp", gpus=2, options=OPTIONS[1], seq=99, config={"num_experts": 8},
                 asked=[10, 6, 4, 8, 7], unguarded=True),
            dict(family="qwen3_moe", strategy="ep2+fsdp", gpus=4, options=bf16),
            dict(family="llama", strategy="fsdp", gpus=2, options=bf16, config={"num_hidden_layers": 10}),
            dict(family="qwen3", strategy="fsdp+cp2", gpus=4, options=OPTIONS[2], config={"num_hidden_layers": 10})]
    return out


def case_id(case: dict) -> str:
    options = ",".join(f"{k}={v}" for k, v in case["options"].items())
    layers = "".join(f"/{k}={v}" for k, v in {**case.get("config", {}), "seq": case.get("seq")}.items() if v)
    asked = f"/asked={','.join(map(str, case['asked']))}" if "asked" in case else ""
    return f"{case['family']}{layers}/{case['strategy']}@{case['gpus']}/{options}{asked}"


def workload(case: dict, folder: Path):
    config = {**CONFIGS[case["family"]], **case.get("config", {})}
    path = folder / f"{case['family']}-{abs(hash(json.dumps(config)))}.json"
    path.write_text(json.dumps(config))
    return load_workload(f"hf:{path}", seq_len=case.get("seq", SEQ_LEN), for_plan=True)


def first_difference(a: list, b: list) -> dict | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return {"event": i, "written": list(x), "traced": list(y)}
    return None if len(a) == len(b) else {"event": min(len(a), len(b)), "written_events": len(a),
                                          "traced_events": len(b)}


def run(case: dict, folder: Path) -> dict:
    started = time.perf_counter()
    work, options = workload(case, folder), StepOptions(**case["options"])
    device, strategy = get_device("a100-80gb"), parse_strategy(case["strategy"], case["gpus"])
    written: dict[int, tuple] = {}
    replays: dict[int, dict] = {}
    with DeepSession(work, options, device, strategy) as deep:
        at = deep.line.at

        def recorded(size: int):
            found = at(size)
            if found is not None:
                written[size] = found
            return found

        deep.line.at = recorded
        deep.trace(1)  # the search's allocated probes come first: the sessions' first trace is a fresh process's
        for size in case.get("asked", ASKED):
            replay = deep.reserved(size)
            if replay.written:
                replays[size] = replay.to_json()
        summary = deep.line.summary()
        cut, lattice, refused = deep.blocks is not None, deep.line.lattice, deep.line.refused
    traced: dict[int, tuple] = {}
    off = StreamLine.at
    StreamLine.at = lambda self, size: None
    try:
        with DeepSession(work, options, device, strategy) as other:
            keep = other._traced_stream

            def kept(size: int):
                traced[size] = keep(size)
                return traced[size]

            other._traced_stream = kept
            other.trace(1)
            fresh = {size: other.reserved(size).to_json() for size in written}
    finally:
        StreamLine.at = off
    differing = {}
    for size in written:
        events, starts, sides = written[size]
        t_events, t_starts, t_sides = traced[size]
        raw = first_difference(_canonical(events), _canonical(t_events))
        if raw or starts != t_starts or dict(sides) != dict(t_sides) or replays[size] != fresh[size]:
            differing[size] = {"stream": raw, "starts": [list(starts), list(t_starts)],
                               "sides_equal": dict(sides) == dict(t_sides),
                               "replay_equal": replays[size] == fresh[size],
                               "peak_reserved": [replays[size]["peak_reserved_bytes"],
                                                 fresh[size]["peak_reserved_bytes"]]}
    return {"case": case_id(case), "family": case["family"], "config": case.get("config", {}),
            "seq": case.get("seq", SEQ_LEN), "cut": cut, "lattice": lattice, "refused": refused,
            "strategy": case["strategy"], "gpus": case["gpus"], "options": case["options"],
            "asked": case.get("asked", ASKED), "written": summary["written"], "through": summary["through"],
            "checked_at": summary["checked_at"],
            "events": {size: len(written[size][0]) for size in written},
            "equal": not differing, "different": differing, "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    wanted = sys.argv[1:]
    folder = Path(tempfile.mkdtemp())
    rows = []
    for case in cases():
        if wanted and not any(w in case_id(case) for w in wanted):
            continue
        try:
            rows.append(run(case, folder))
        except Exception as error:  # a refusal or a crash: said, not compared
            rows.append({"case": case_id(case), "family": case["family"], "strategy": case["strategy"],
                         "options": case["options"], "error": f"{type(error).__name__}: {str(error)[:300]}"})
        row = rows[-1]
        shown = ("written", "through", "checked_at", "lattice", "equal", "seconds", "error")
        print(row["case"], {k: row.get(k) for k in shown}, flush=True)
    unguarded = []  # the cases the guards are for, with the line as commit daeecec wrote it: no refusal, no lattice
    refusal, rounds = deep_module.refusal, deep_module.rounds_by_batch
    deep_module.refusal, deep_module.rounds_by_batch = (lambda options: None), (lambda **kw: False)
    try:
        for case in cases():
            if case.get("unguarded") and (not wanted or any(w in case_id(case) for w in wanted)):
                unguarded.append(run(case, folder))
                print("unguarded:", unguarded[-1]["case"], unguarded[-1]["written"], unguarded[-1]["equal"], flush=True)
    finally:
        deep_module.refusal, deep_module.rounds_by_batch = refusal, rounds
    if wanted:
        return
    write_result("stream_line_families", {
        "what": "reserved probes whose fresh stream plan/deep.py wrote from the line (trace/stream_line.py) against "
                "the same sizes traced fresh with the line off: the replay (ReservedReplay.to_json) and the stream, "
                "event for event; probes asked in the order " + ", ".join(map(str, ASKED)) + " after a trace at 1 "
                f"(each family of tests/support_matrix.py and gemma, falcon, stablelm at 4 blocks, seq {SEQ_LEN}; "
                "a100-80gb)",
        "command": "python benchmarks/stream_line_families.py",
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 cwd=Path(__file__).parent).stdout.strip(),
        "rows": rows,
        "unguarded": unguarded,
        "unguarded_what": "the fused-linear and the rounded-MoE cases again with the line as commit daeecec wrote it "
                          "(no refusal by name, no lattice): what the guards of trace/stream_line.py are for",
        "cases": len(rows),
        "written": sum(len(r.get("written", [])) for r in rows),
        "all_equal": all(r.get("equal", True) for r in rows),
    })


if __name__ == "__main__":
    main()
