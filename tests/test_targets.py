"""One device grammar for every command: --gpu, --gpu-memory and --device."""

from __future__ import annotations

import pytest
import torch

from batchfit.devices import CATALOG, GiB
from batchfit.errors import OptionError
from batchfit.targets import DEFAULT_GPU, parse_target, resolve_target


def test_gpu_is_the_virtual_device_of_that_gpu():
    by_gpu = resolve_target(gpu="t4-16gb")
    by_device = resolve_target(device="virtual:t4-16gb")
    assert (by_gpu.kind, by_gpu.device) == (by_device.kind, by_device.device) == ("virtual", CATALOG["t4-16gb"])


def test_gpu_memory_is_a_custom_virtual_device():
    target = resolve_target(gpu_memory="24GiB")
    assert target.kind == "virtual" and target.device.total_bytes == 24 * GiB
    assert target.device == parse_target("virtual:24GiB").device


def test_cpu_time_with_memory_sized_for_a_gpu():
    target = resolve_target(device="cpu", gpu="a100-40gb")
    assert target.kind == "cpu" and target.device == CATALOG["a100-40gb"]
    assert resolve_target(device="cpu").device is None


def test_two_names_for_the_gpu_are_refused():
    with pytest.raises(OptionError, match="give one of `gpu` / `gpu_memory`"):
        resolve_target(gpu="t4-16gb", gpu_memory="16GiB")
    with pytest.raises(OptionError, match="give one of `gpu` / `device`"):
        resolve_target(gpu="t4-16gb", device="virtual:t4-16gb")


def test_nothing_named_says_which_device_it_chose():
    said = []
    target = resolve_target(say=said.append)
    if torch.cuda.is_available():
        assert target.kind == "cuda" and "using the GPU here" in said[0]
    else:
        assert target.kind == "virtual" and target.device == CATALOG[DEFAULT_GPU]
        assert len(said) == 1 and DEFAULT_GPU in said[0] and "--gpu" in said[0]


def test_bad_cuda_index_says_what_to_type():
    with pytest.raises(OptionError, match="cuda:N"):
        parse_target("cuda:x")
