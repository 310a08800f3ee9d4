"""batchfit: which batch size should I train with? Traced, measured and reported."""

from batchfit.devices import CATALOG, Device, get_device, parse_size
from batchfit.errors import (BatchfitError, ModelSpecError, OptionError, SizeError, TraceError,
                             UnknownGPUError, UsageError)
from batchfit.elastic import ElasticInfo, ElasticStep
from batchfit.estimate import EstimateResult, estimate
from batchfit.probe.find import ProbeResult, find_max_batch
from batchfit.specs import load_workload
from batchfit.targets import Target, parse_target, resolve_target
from batchfit.workload import StepOptions, Workload

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
