"""The public surface, pinned: a change to it is a decision, not an accident."""

import batchfit


def test_public_names_are_pinned_and_sorted():
    assert batchfit.__all__ == sorted(batchfit.__all__, key=lambda name: (not name.isupper(), name))
    assert set(batchfit.__all__) == {
        "CATALOG", "BatchfitError", "Device", "ElasticInfo", "ElasticStep", "EstimateResult", "ModelSpecError", "OptionError",
        "ProbeResult", "SizeError", "StepOptions", "Target", "TraceError", "UnknownGPUError", "UsageError",
        "Workload", "estimate", "find_max_batch", "get_device", "load_workload", "parse_size", "parse_target",
        "resolve_target",
    }
    for name in batchfit.__all__:
        assert getattr(batchfit, name) is not None
