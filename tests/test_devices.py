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


@pytest.mark.parametrize("typed,name", [
    ("t4", "t4-16gb"), ("l4", "l4-24gb"), ("rtx4090", "rtx4090-24gb"), ("4090", "rtx4090-24gb"),
    ("H100 80GB", "h100-80gb"), ("h100_80gb", "h100-80gb"), ("h100", "h100-80gb"), ("h100-pcie", "h100-pcie-80gb"),
    ("NVIDIA A100 40GB", "a100-40gb"), ("mi300x", "mi300x-192gb"), ("rtx6000ada", "rtx6000ada-48gb"),
])
def test_one_alias_rule_for_every_entry(typed, name):
    """The name, the name without its memory, without 'rtx'; any case, spaces or underscores."""
    assert get_device(typed).name == name


@pytest.mark.parametrize("typed,message", [
    ("a100", "'a100' is ambiguous: a100-80gb or a100-40gb"),
    ("v100", "'v100' is ambiguous: v100-16gb or v100-32gb"),
])
def test_an_alias_of_two_cards_is_refused(typed, message):
    with pytest.raises(UnknownGPUError, match=message):
        get_device(typed)


def test_suggestions_stay_in_the_family():
    with pytest.raises(UnknownGPUError) as error:
        get_device("v100x")
    assert "v100-16gb" in str(error.value) and "h100" not in str(error.value)


def test_display_names_do_not_carry_a_precision():
    assert all("(fp16)" not in d.display_name for d in CATALOG.values())
    assert not CATALOG["t4-16gb"].supports_bf16 and CATALOG["a100-40gb"].supports_bf16


def test_peak_follows_the_runs_precision():
    """MFU of an fp32 run divides by the fp32 peak, not the bf16 tensor peak."""
    a100 = CATALOG["a100-40gb"]
    assert a100.peak_tflops("fp32") == 19.5 and a100.peak_tflops("bf16-mixed") == 312.0
    assert CATALOG["t4-16gb"].peak_tflops("fp16-mixed") == 65.0 and CATALOG["t4-16gb"].peak_tflops("bf16") is None
    assert all(d.fp32_tflops and d.fp32_tflops < d.bf16_tflops for d in CATALOG.values())


def test_bf16_on_a_card_without_it_warns():
    from batchfit.devices import precision_warning

    assert "fp16-mixed" in precision_warning(CATALOG["t4-16gb"], "bf16-mixed")
    assert precision_warning(CATALOG["t4-16gb"], "fp16-mixed") is None
    assert precision_warning(CATALOG["h100-80gb"], "bf16") is None


@pytest.mark.parametrize("size", ["0GiB", "512MiB", "0.5GiB"])
def test_a_gpu_memory_that_leaves_nothing_usable_is_refused(size):
    from batchfit.devices import custom_device

    with pytest.raises(SizeError, match="no usable memory"):
        custom_device(parse_size(size))
