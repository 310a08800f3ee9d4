"""A sweep's result, read back from its store: runs, the best rate per batch size, the answers.

Per batch size the result keeps the run with the lowest best validation loss over its
learning rates, so a batch size is judged at its own best rate, not at one rate tuned for
another size. Two answers come out:

- best for quality: the batch size with the lowest validation loss at the budget;
- fastest to a target loss (default: the worst of the per-batch-size best losses, a loss
  every finished batch size reached): the one that reached it in the least time, timed as
  the run's seconds x the fraction of its steps done at the first evaluation under target.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from batchfit.runs.store import Store


@dataclass(kw_only=True)
class SweepResult:
    store: str
    workload: str
    description: str
    config: dict
    budget: dict
    data_kind: str
    data_info: dict | None
    runs: list[dict]
    """Every run's row, with its ``curve`` (val and train points)."""
    notes: list[str] = field(default_factory=list)
    noise: dict | None = None
    seconds: float = 0.0
    target_loss: float | None = None

    @property
    def unit(self) -> str:
        return self.budget["unit"]

    def best_runs(self) -> dict[int, dict]:
        """Per batch size, its finished run with the lowest best validation loss."""
        best: dict[int, dict] = {}
        for run in self.runs:
            if run["status"] == "done" and run["best_val_loss"] is not None:
                current = best.get(run["batch_size"])
                if current is None or run["best_val_loss"] < current["best_val_loss"]:
                    best[run["batch_size"]] = run
        return dict(sorted(best.items()))

    def best_batch_size(self) -> int | None:
        best = self.best_runs()
        return min(best, key=lambda b: best[b]["best_val_loss"]) if best else None

    def target(self) -> float | None:
        best = self.best_runs()
        if self.target_loss is not None:
            return self.target_loss
        return max(r["best_val_loss"] for r in best.values()) if best else None

    def time_to_target(self) -> dict[int, dict]:
        """Per batch size (at its best rate): steps, budget units and seconds to the target."""
        target, out = self.target(), {}
        if target is None:
            return out
        for b, run in self.best_runs().items():
            hit = next((p for p in run["curve"]["val"] if p["loss"] <= target + 1e-12), None)
            if hit is not None:
                units = hit["tokens"] if self.unit == "tokens" else hit["samples"]
                out[b] = {"step": hit["step"], self.unit: units,
                          "seconds": run["seconds"] * hit["step"] / run["steps"] if run["steps"] else 0.0}
        return out

    def fastest_batch_size(self) -> int | None:
        reached = self.time_to_target()
        return min(reached, key=lambda b: reached[b]["seconds"]) if reached else None

    def to_json(self) -> dict:
        unit = self.unit
        runs = []
        for r in self.runs:
            runs.append({
                "batch_size": r["batch_size"], "lr": r["lr"], "status": r["status"], "steps": r["steps"],
                unit: r[unit] if r["status"] == "done" else (r["steps_done"] or 0) * r["batch_size"] *
                (self.budget["tokens_per_sample"] if unit == "tokens" else 1),
                "micro_batch": r["micro_batch"], "accumulation_steps": r["accumulation_steps"],
                "initial_val_loss": r["initial_val_loss"], "final_train_loss": r["final_train_loss"],
                "final_val_loss": r["final_val_loss"], "best_val_loss": r["best_val_loss"],
                "seconds": round(r["seconds"] or 0.0, 3), "error": r["error"], "note": r["note"],
                "curve": r["curve"]})
        best = self.best_runs()
        return {
            "workload": self.workload, "description": self.description, "store": self.store,
            "budget": self.budget, "data": self.data_kind, "data_info": self.data_info, "config": self.config,
            "runs": runs,
            "best_lr_per_batch_size": {str(b): r["lr"] for b, r in best.items()},
            "best_batch_size": self.best_batch_size(), "target_loss": self.target(),
            "time_to_target": {str(b): v for b, v in self.time_to_target().items()},
            "fastest_batch_size": self.fastest_batch_size(), "noise": self.noise, "notes": self.notes,
            "seconds": round(self.seconds, 2),
        }


def read_result(path: Path | str, *, seconds: float = 0.0, target_loss: float | None = None) -> SweepResult:
    """The result of the sweep in the store at ``path`` (finished or not); a path that holds no
    sweep store raises OptionError (it is never created)."""
    with Store(path, create=False) as store:
        runs = store.runs()
        for run in runs:
            run["curve"] = {"val": store.curve(run["id"], "val"), "train": store.curve(run["id"], "train")}
        meta = {k: store.meta(k) for k in ("config", "budget", "data_kind", "data_info", "notes", "workload",
                                           "description", "noise")}
    return SweepResult(store=str(path), workload=meta["workload"] or "", description=meta["description"] or "",
                       config=meta["config"] or {}, budget=meta["budget"] or {"unit": "tokens"},
                       data_kind=meta["data_kind"] or "synthetic", data_info=meta["data_info"], runs=runs,
                       notes=meta["notes"] or [], noise=meta["noise"], seconds=seconds, target_loss=target_loss)


def save_noise(path: Path | str, noise: dict) -> None:
    """Keep a noise-scale result beside the sweep (shown in its report)."""
    with Store(path, create=False) as store:
        store.set_config(store.meta("config") or {}, {"noise": noise})
