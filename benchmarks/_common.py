"""Shared by the benchmark scripts: where results go and what machine made them."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def machine() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def write_result(name: str, figures: dict) -> Path:
    """Write benchmarks/results/<name>-<date>.json with the date, machine and command."""
    RESULTS.mkdir(exist_ok=True)
    date = datetime.date.today().isoformat()
    path = RESULTS / f"{name}-{date}.json"
    record = {"date": date, "machine": machine(), "command": " ".join(["python", *sys.argv]), **figures}
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path
