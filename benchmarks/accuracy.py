"""Write docs/accuracy.md: every prediction batchfit checked against something real, as a ledger.

Reads every JSON in benchmarks/results/ (the latest date of each benchmark; files named
``*before*`` hold figures a later change replaced and are left out) and finds each row that
holds a prediction beside a measurement of the same quantity (``PAIRS``: a traced peak beside
the torch profiler's peak of the same real CPU step, a real gloo run's rank, a real GPU, or a
published figure). Per file: the rows, the error (predicted - measured) / measured as min /
median / max, and the share of rows below parity (a prediction too low: the worse side, a batch
said to fit that runs out). Then recommend's answers against full sweeps, and the speed figures
that benchmarks timed as whole commands over several runs (``min_s`` / ``median_s`` /
``max_s``, or ``min`` / ``median`` / ``max`` under a key ending in ``_s``; each file's ``command`` says what was timed).

    python benchmarks/accuracy.py            # writes docs/accuracy.md
    python benchmarks/accuracy.py --check    # exit 1 if docs/accuracy.md differs from the results

No torch: it reads JSON only (tests/test_accuracy_doc.py runs --check's function in the fast tier).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "accuracy.md"

# (predicted key, measured key, what measured it). The first pair a row holds is its check.
PAIRS = [
    ("traced_bytes", "cpu_truth_bytes", "torch profiler, real CPU step"),
    ("traced_bytes", "gloo_truth_bytes", "torch profiler, real gloo run"),
    ("traced_bytes", "gloo_bytes", "torch profiler, real gloo run"),
    ("traced_rank0_bytes", "gloo_bytes", "torch profiler, real gloo run"),
    ("traced_bytes", "h100_bytes", "real GPU (max_memory_allocated)"),
    ("traced_bytes", "measured_allocated_bytes", "real GPU (max_memory_allocated)"),
    ("reserved_streams_apart_gib", "published_reserved_gib", "published figure"),
]
LABEL_KEYS = ("label", "setup", "recipe", "model", "strategy", "schedule", "compile", "checkpointing", "precision",
              "attention", "budget", "options", "gpus", "rank", "batch_size", "local_batch")
MEASURED_ON = {"h100_bytes": "NVIDIA H100 80GB HBM3 (figures from an earlier GPU run)",
               "published_reserved_gib": "the published run's GPUs"}
FAR = 0.005  # "well below parity": more than 0.5% too low
DATED = re.compile(r"^(?P<name>.+?)-(?P<date>\d{4}-\d{2}-\d{2})\.json$")


def latest_results(folder: Path = RESULTS) -> list[Path]:
    """The newest file of each benchmark name, ``*before*`` files left out."""
    newest: dict[str, tuple[str, Path]] = {}
    for path in sorted(folder.glob("*.json")):
        match = DATED.match(path.name)
        if not match or "before" in match["name"]:
            continue
        name, date = match["name"], match["date"]
        if name not in newest or date > newest[name][0]:
            newest[name] = (date, path)
    return [path for _, path in sorted(newest.values(), key=lambda item: item[1].name)]


def _rows(value, inherited: dict | None = None):
    """Every dict below ``value``, each with the label keys of the rows above it (a model's
    points inherit its name; the file's own top-level keys are defaults, not labels)."""
    if isinstance(value, dict):
        here = {**(inherited or {}),
                **{k: v for k, v in value.items() if k in LABEL_KEYS and not isinstance(v, (dict, list))}}
        if isinstance(value.get("options"), dict) and value["options"]:
            here["options"] = " ".join(f"{k}={v}" for k, v in value["options"].items())
        yield here, value
        for child in value.values():
            yield from _rows(child, here if inherited is not None else {})
    elif isinstance(value, list):
        for child in value:
            yield from _rows(child, inherited)


def checks(data: dict) -> list[dict]:
    """The rows of one results file that hold a prediction beside its measurement."""
    found = []
    for labels, row in _rows(data):
        for predicted, measured, what in PAIRS:
            p, m = row.get(predicted), row.get(measured)
            if isinstance(p, (int, float)) and isinstance(m, (int, float)) and m > 0:
                label = ", ".join(f"{k} {labels[k]}" for k in LABEL_KEYS if labels.get(k) not in (None, ""))
                found.append({"label": label, "predicted": p, "measured": m, "error": (p - m) / m, "truth": what,
                              "measured_on": MEASURED_ON.get(measured)})
                break
    return found


def _hardware(data: dict) -> tuple[str, str]:
    machine = data.get("machine") if isinstance(data.get("machine"), dict) else {}
    hardware = machine.get("gpu") or (f"CPU, {machine['cpus']} cores" if "cpus" in machine else "not recorded")
    return hardware, machine.get("torch", "not recorded")


def _pct(x: float) -> str:
    return f"{x:+.2%}"


def ledger_rows(files: list[Path]) -> list[dict]:
    rows = []
    for path in files:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            continue
        found = checks(data)
        if not found:
            continue
        errors = sorted(c["error"] for c in found)
        hardware, torch_version = _hardware(data)
        hardware = found[0]["measured_on"] or hardware
        rows.append({"file": path.name, "truth": found[0]["truth"], "rows": len(found), "min": errors[0],
                     "median": statistics.median(errors), "max": errors[-1],
                     "below": sum(e < 0 for e in errors) / len(errors),
                     "far_below": sum(e < -FAR for e in errors), "worst_low": min(found, key=lambda c: c["error"]),
                     "hardware": hardware, "torch": torch_version, "command": data.get("command") or ""})
    return rows


def recommend_rows(files: list[Path]) -> list[dict]:
    rows = []
    for path in files:
        data = json.loads(path.read_text())
        for setup in data.get("setups", []) if isinstance(data, dict) else []:
            if "sweep_best_batch_size" in setup and "recommended_batch_size" in setup:
                rows.append({"file": path.name, **setup})
    return rows


def _ratio(a: int, b: int) -> float:
    return max(a, b) / min(a, b)


def middle(interval: list[int], predicted: dict[str, float]) -> int:
    """The batch of the interval nearest its geometric middle (the least worst-case ratio to any
    batch in it); between two, the lower predicted loss."""
    low, high = interval
    inside = [int(b) for b in predicted if low <= int(b) <= high]
    centre = math.log2(low * high) / 2
    return min(inside, key=lambda b: (abs(math.log2(b) - centre), predicted[str(b)]))


def _setup_name(row: dict) -> str:
    """The setup, with the options that differ from recommend's defaults."""
    options = row.get("options") or {}
    extra = ", ".join(f"{k} {','.join(map(str, v)) if isinstance(v, list) else v}" for k, v in options.items())
    return f"{row.get('setup', '')} ({extra})" if extra else row.get("setup", "")


def recommend_section(rows: list[dict]) -> list[str]:
    """recommend's answers against the full sweeps; where the file has each setup's role and the
    branches' predictions, the choice rules that could read the same branches, side by side."""
    lines = ["", "## recommend against the full sweep it replaces", "",
             "Done when: within 2x of the sweep's best batch size and at most 20% of the sweep's tokens (trained and "
             "validated, counted alike), or the sweep itself ran because branching could not cost less. `tuning` "
             "setups are those recommend's settings were chosen on; `held-out` setups were added after and chose "
             "nothing.", "",
             "| results file | setup | role | sweep's best batch | recommended (interval) | ratio | share of the "
             "sweep's tokens | plan | done |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        best, got = r["sweep_best_batch_size"], r["recommended_batch_size"]
        interval = r.get("recommended_interval") or []
        share = r.get("cost_share_of_sweep")
        plan = r.get("mode", "branch")
        if r.get("branched") and r["branched"] != r.get("batch_sizes"):
            plan += f" {r['branched'][0]}-{r['branched'][-1]}"
        done = {True: "yes", False: "**no**"}.get(r.get("met"), "")
        lines.append(f"| `{r['file']}` | {_setup_name(r)} | {r.get('role', '')} | {best} | {got} "
                     f"({'-'.join(map(str, interval))}) | {_ratio(best, got):g}x | "
                     f"{f'{share:.1%}' if isinstance(share, float) else 'not recorded'} | {plan} | {done} |")
    ruled = [r for r in rows if r.get("role") and r.get("recommend_extrapolated_val") and r.get("mode") == "branch"]
    if ruled:
        lines += ["", "The same branches read by other choice rules (batch size, and its ratio to the sweep's best): "
                  "recommend's rule is the lowest predicted loss.", "",
                  "| results file | setup | role | sweep's best | lowest predicted loss | largest in the interval | "
                  "critical batch size | interval's geometric middle |", "|---|---|---|---|---|---|---|---|"]
        for r in ruled:
            best = r["sweep_best_batch_size"]
            picks = (r["recommended_batch_size"], r["recommended_interval"][1], r["critical_batch_size"],
                     middle(r["recommended_interval"], r["recommend_extrapolated_val"]))
            lines.append(f"| `{r['file']}` | {_setup_name(r)} | {r['role']} | {best} | "
                         + " | ".join(f"{b} ({_ratio(best, b):g}x)" for b in picks) + " |")
    return lines


def seed_mean_best(losses_by_seed: dict[str, dict[str, float]]) -> int:
    """The batch size whose best validation loss, averaged over the seeds, is lowest."""
    sizes = set.intersection(*(set(by_batch) for by_batch in losses_by_seed.values()))
    return int(min(sizes, key=lambda b: sum(s[b] for s in losses_by_seed.values())))


def seeds_section(files: list[Path], recommend: list[dict]) -> list[str]:
    """The sweep's own answer at other seeds (``sweep_seeds.py``): the target recommend is held to
    is one draw; its best batch across seeds, and recommend's answer against their mean."""
    defaults = sorted((r for r in recommend if re.fullmatch(r"recommend_cpu-[0-9-]+\.json", r["file"])),
                      key=lambda r: r["file"])
    latest = {r["setup"]: r for r in defaults}  # the newest file's row of each setup
    rows = [(path.name, s) for path in files if path.name.startswith("sweep_seeds-")
            for s in json.loads(path.read_text())["setups"]]
    if not rows:
        return []
    lines = ["", "### The sweep's own answer at other seeds", "",
             "The same sweep trained again at other seeds (the seed draws the initial model and the data order; "
             "`benchmarks/sweep_seeds.py`). `spread` is the largest best batch over the smallest; the seed mean's "
             "best is the batch with the lowest best validation loss averaged over the seeds. recommend is the "
             "newest `recommend_cpu-<date>.json` row above (recommend's defaults).", "",
             "| results file | setup | role | best batch by seed | spread | seed mean's best | recommended | ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for name, s in rows:
        mean_best = seed_mean_best(s["best_val_loss_by_seed"])
        got = latest.get(s["setup"], {}).get("recommended_batch_size")
        by_seed = ", ".join(f"{seed}: {b}" for seed, b in s["best_batch_size_by_seed"].items())
        lines.append(f"| `{name}` | {s['setup']} | {s.get('role', '')} | {by_seed} | {s['spread']:g}x | {mean_best} | "
                     f"{got if got is not None else 'not run'} | "
                     f"{f'{_ratio(mean_best, got):g}x' if got is not None else ''} |")
    return lines


SKIPPED_FIGURES = ("user_s", "sys_s")
"""Parts of cpu_s, which is kept."""


def _timings(value, path: tuple[str, ...] = (), parent: dict | None = None):
    """Every whole-command timing figure below ``value``: a dict with ``min_s`` / ``median_s`` / ``max_s``, or
    ``min`` / ``median`` / ``max`` under a key ending in ``_s`` (``wall_s: {min, median, max}``), with
    the keys that lead to it and the row that holds it."""
    if isinstance(value, dict):
        for suffix in ("_s", ""):
            keys = tuple(f"{k}{suffix}" for k in ("min", "median", "max"))
            figure = next((k for k in reversed(path) if k.endswith("_s")), None)
            timed = suffix or (figure is not None and figure not in SKIPPED_FIGURES)
            if timed and all(isinstance(value.get(k), (int, float)) for k in keys):
                yield path, dict(zip(("min_s", "median_s", "max_s"), (value[k] for k in keys))), parent or {}
        for key, child in value.items():
            yield from _timings(child, (*path, str(key)), value)
    elif isinstance(value, list):
        for n, child in enumerate(value):
            yield from _timings(child, (*path, str(n)), parent)


def speed_rows(files: list[Path]) -> list[dict]:
    rows = []
    for path in files:
        data = json.loads(path.read_text())
        for keys, figures, row in _timings(data):
            what = row.get("command") or row.get("label") or ""
            detail = f" ({row['cache']})" if isinstance(row.get("cache"), str) else ""
            figure = next((k for k in reversed(keys) if k.endswith("_s")), "")
            label = f"`{what}`{detail}: {figure}" if what else " / ".join(keys)
            rows.append({"file": path.name, "commit": data.get("commit", ""), "label": label,
                         "runs": row.get("runs", ""), **figures})
    return rows


def render(files: list[Path]) -> str:
    ledger = ledger_rows(files)
    n = sum(r["rows"] for r in ledger)
    below = sum(round(r["below"] * r["rows"]) for r in ledger)
    far = sum(r["far_below"] for r in ledger)
    lines = [
        "# Accuracy: every prediction against something real",
        "",
        "Generated by `python benchmarks/accuracy.py` from `benchmarks/results/` (the newest file of each",
        "benchmark); do not edit by hand. Error = (predicted - measured) / measured. Below parity means the",
        "prediction was lower than the measurement: the worse side (a batch said to fit that runs out), so",
        "each file's share below parity and its lowest row are stated.",
        "",
        f"**{n} checks in {len(ledger)} files; {below} ({below / max(n, 1):.0%}) below parity, {far} "
        f"({far / max(n, 1):.0%}) more than {FAR:.1%} below.**",
        "",
        "## Memory: predicted peak against a measurement",
        "",
        "| results file | measured by | rows | min | median | max | below parity | more than 0.5% below | lowest row "
        "| measured on | torch |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in ledger:
        low = r["worst_low"]
        lowest = f"{_pct(low['error'])} ({low['label']})" if low["error"] < 0 else "none below"
        lines.append(f"| `{r['file']}` | {r['truth']} | {r['rows']} | {_pct(r['min'])} | {_pct(r['median'])} | "
                     f"{_pct(r['max'])} | {r['below']:.0%} | {r['far_below']} | {lowest} | {r['hardware']} | "
                     f"{r['torch']} |")
    lines += ["", "Each file's `command` reproduces it:", ""]
    lines += [f"- `{r['file']}`: `{r['command']}`" for r in ledger if r["command"]]
    recommend = recommend_rows(files)
    if recommend:
        lines += recommend_section(recommend)
        lines += seeds_section(files, recommend)
    speed = speed_rows(files)
    if speed:
        lines += ["", "## Speed: whole commands timed over several runs", "",
                  "| results file | what | runs | min | median | max | commit |", "|---|---|---|---|---|---|---|"]
        for r in speed:
            lines.append(f"| `{r['file']}` | {r['label']} | {r['runs']} | "
                         f"{r['min_s']:.1f} s | {r['median_s']:.1f} s | {r['max_s']:.1f} s | {r['commit']} |")
        timed = dict.fromkeys(r["file"] for r in speed)
        by_name = {path.name: path for path in files}
        commands = {f: json.loads(by_name[f].read_text()).get("command", "") for f in timed}
        lines += ["", "What each file timed:", ""] + [f"- `{f}`: `{c}`" for f, c in commands.items() if c]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/accuracy.md differs from the results")
    args = parser.parse_args()
    text = render(latest_results())
    if args.check:
        if not DOC.exists() or DOC.read_text() != text:
            print("docs/accuracy.md differs from benchmarks/results/: run python benchmarks/accuracy.py")
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
