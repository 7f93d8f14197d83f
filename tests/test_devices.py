"""Device names (``pipemap.devices``): one canonical name for each device, everything else refused with the reason."""

from __future__ import annotations

import pytest
import torch

from pipemap import PipemapError, UnknownDeviceError, normalize_device
from pipemap.devices import is_accelerator, real_device

# ---- normalize_device --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (0, "cuda:0"),
        (3, "cuda:3"),
        ("cuda", "cuda:0"),
        ("cuda:1", "cuda:1"),
        (" CUDA:2 ", "cuda:2"),
        ("cpu", "cpu"),
        ("cpu:0", "cpu"),
        ("meta:1", "meta:1"),
        ("meta", "meta:0"),
        (torch.device("cuda"), "cuda:0"),
        (torch.device("cuda", 1), "cuda:1"),
        (torch.device("cpu"), "cpu"),
        (torch.device("meta", 2), "meta:2"),
    ],
)
def test_normalize_device(given, expected):
    assert normalize_device(given) == expected


@pytest.mark.parametrize("given", ["gpu", "cuda:x", "cuda:-1", "", "cuda:0:1", "tpu:0", True, -1, None])
def test_normalize_device_rejects_garbage(given):
    with pytest.raises(UnknownDeviceError) as info:
        normalize_device(given)
    assert info.value.device is given
    assert isinstance(info.value, ValueError) and isinstance(info.value, PipemapError)


def test_leading_zeros_name_the_same_gpu_and_only_ascii_digits_count():
    assert normalize_device("cuda:01") == normalize_device("cuda:1") == "cuda:1"
    with pytest.raises(UnknownDeviceError, match="not a device name"):
        normalize_device("cuda:\u0661")  # an Arabic-Indic one


@pytest.mark.parametrize("given", ["mps", "xpu:1", "npu", torch.device("mps")])
def test_other_accelerators_are_refused_as_device_types_pipemap_does_not_run_on(given):
    with pytest.raises(UnknownDeviceError) as info:
        normalize_device(given)
    assert "does not run on" in info.value.reason and "CUDA GPUs and the CPU" in str(info.value)
    assert info.value.available == ()


def test_the_cpu_is_one_device():
    with pytest.raises(UnknownDeviceError) as info:
        normalize_device("cpu:1")
    assert "the CPU is one device" in info.value.reason


@pytest.mark.parametrize("given", [1.0, b"cuda:0", ["cuda:0"]])
def test_values_of_other_types_are_no_device_names(given):
    with pytest.raises(UnknownDeviceError) as info:
        normalize_device(given)
    assert info.value.reason == "is not a device name"


# ---- real_device and is_accelerator ------------------------------------------------------------------------------


def test_real_device_is_normalize_device_without_stand_ins():
    assert real_device(torch.device("cuda", 2)) == "cuda:2" and real_device(" CPU ") == "cpu"
    assert real_device(0) == "cuda:0"
    for stand_in in ("meta", "meta:1", torch.device("meta", 3)):
        with pytest.raises(UnknownDeviceError) as info:
            real_device(stand_in)
        assert info.value.device is stand_in and "stand-in of a dry run" in info.value.reason


def test_is_accelerator_is_true_for_gpus_and_their_stand_ins():
    assert is_accelerator("cuda:0") and is_accelerator("meta:1")
    assert not is_accelerator("cpu")
