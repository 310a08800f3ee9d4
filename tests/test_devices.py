from __future__ import annotations

import pytest

from batchfit.devices import CATALOG, GiB, MiB, cublas_workspace_bytes, get_device, parse_size
from batchfit.errors import SizeError, UnknownGPUError


def test_catalog_covers_the_named_gpus():
    for name in ("h100-80gb", "h100-pcie-80gb", "h200-141gb", "a100-40gb", "a100-80gb", "a10g-24gb",
                 "l4-24gb", "l40s-48gb", "rtx4090-24gb", "rtx6000ada-48gb", "v100-16gb", "v100-32gb",
                 "t4-16gb", "mi300x-192gb"):
        device = CATALOG[name]
        assert device.bf16_tflops and device.bandwidth_gb_per_s
        assert device.usable_bytes == device.total_bytes - 512 * MiB


def test_names_are_case_insensitive_and_typos_get_a_suggestion():
    assert get_device("H100-80GB").name == "h100-80gb"
    with pytest.raises(UnknownGPUError, match="did you mean 'h100-80gb'"):
        get_device("h100-80")


@pytest.mark.parametrize("text,expected", [("48GiB", 48 * GiB), ("80GB", 80 * 10**9), ("1.5 GiB", int(1.5 * GiB)),
                                           ("512MiB", 512 * MiB)])
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["48", "48 gigs", "", "GiB"])
def test_sizes_need_a_number_and_a_unit(text):
    with pytest.raises(SizeError, match="24GiB"):
        parse_size(text)


def test_cublas_workspace_follows_pytorch_defaults():
    assert cublas_workspace_bytes(9) == 2 * 32 * MiB
    assert cublas_workspace_bytes(8) == 2 * (8 * MiB + 128 * 1024)
