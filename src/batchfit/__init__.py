"""batchfit: which batch size should I train with? Traced, measured and reported.

The names below are imported when first used (PEP 562), so ``import batchfit`` and
``batchfit --help`` do not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from batchfit.notices import quiet_import_notes

quiet_import_notes()  # torchao's and bitsandbytes' import notes (transformers, PEFT import them): batchfit/notices.py

_WHERE = {
    "CATALOG": "devices", "Device": "devices", "get_device": "devices", "parse_size": "devices",
    "BatchfitError": "errors", "ModelSpecError": "errors", "OptionError": "errors", "SizeError": "errors",
    "TraceError": "errors", "UnknownGPUError": "errors", "UsageError": "errors",
    "ElasticInfo": "integrations.elastic", "ElasticStep": "integrations.elastic",
    "EstimateResult": "estimator.engine", "estimate": "estimator.engine",
    "ProbeResult": "probe.find", "find_max_batch": "probe.find",
    "load_workload": "specs",
    "Target": "targets", "parse_target": "targets", "resolve_target": "targets",
    "StepOptions": "workload", "Workload": "workload",
}

__all__ = [
    "CATALOG",
    "BatchfitError",
    "Device",
    "ElasticInfo",
    "ElasticStep",
    "EstimateResult",
    "ModelSpecError",
    "OptionError",
    "ProbeResult",
    "SizeError",
    "StepOptions",
    "Target",
    "TraceError",
    "UnknownGPUError",
    "UsageError",
    "Workload",
    "estimate",
    "find_max_batch",
    "get_device",
    "load_workload",
    "parse_size",
    "parse_target",
    "resolve_target",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'batchfit' has no attribute '{name}'")
    value = getattr(importlib.import_module(f"batchfit.{_WHERE[name]}"), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, eagerly
    from batchfit.devices import CATALOG, Device, get_device, parse_size
    from batchfit.errors import (
        BatchfitError,
        ModelSpecError,
        OptionError,
        SizeError,
        TraceError,
        UnknownGPUError,
        UsageError,
    )
    from batchfit.estimator.engine import EstimateResult, estimate
    from batchfit.integrations.elastic import ElasticInfo, ElasticStep
    from batchfit.probe.find import ProbeResult, find_max_batch
    from batchfit.specs import load_workload
    from batchfit.targets import Target, parse_target, resolve_target
    from batchfit.workload import StepOptions, Workload
