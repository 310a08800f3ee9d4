"""The public surface, pinned: a change to it is a decision, not an accident."""

import batchfit


def test_public_names_are_pinned_and_sorted():
    assert batchfit.__all__ == sorted(batchfit.__all__, key=lambda name: (not name.isupper(), name))
    assert set(batchfit.__all__) == {
        "CATALOG", "BatchfitError", "Device", "ElasticInfo", "ElasticStep", "EstimateResult", "ModelSpecError",
        "OptionError",
        "ProbeResult", "SizeError", "StepOptions", "Target", "TraceError", "UnknownGPUError", "UsageError",
        "Workload", "estimate", "find_max_batch", "get_device", "load_workload", "parse_size", "parse_target",
        "resolve_target",
    }
    for name in batchfit.__all__:
        assert getattr(batchfit, name) is not None


def test_names_stay_functions_whatever_is_imported_first():
    # no public function shares its name with a submodule: importing the submodule that holds
    # it (the CLI does, so does batchfit.EstimateResult) must not turn batchfit.estimate into a module
    import subprocess
    import sys

    script = ("import batchfit; batchfit.EstimateResult; import batchfit.estimator.engine; "
              "print(callable(batchfit.estimate), callable(batchfit.find_max_batch))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"], out.stderr
    for name in batchfit.__all__:
        assert not isinstance(getattr(batchfit, name), type(batchfit)), name
