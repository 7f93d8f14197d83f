"""Device names: the one place that turns ``0``, ``"cuda"`` or ``torch.device("cuda", 1)`` into the canonical strings
pipemap uses everywhere (``"cuda:0"``, ``"cpu"``, ``"meta:1"`` for a dry run's stand-in GPU).

A value module: it imports no torch (a ``torch.device`` is told by its type's module), so a plan can be read, printed
and remapped without it.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from .errors import UnknownDeviceError

if TYPE_CHECKING:
    import torch

# ASCII digits only: "cuda:١" is no device; "meta" names a stand-in GPU of a dry run, never a real device
_DEVICE = re.compile(r"^(cuda|cpu|meta)(?::(\d+))?$", re.ASCII)
_OTHER = re.compile(r"^(mps|xpu|npu|hpu|xla|ipu|mtia|privateuseone|vulkan|opengl|opencl|ideep|fpga|maia|ve|lazy)"
                    r"(?::\d+)?$", re.ASCII)


def normalize_device(device: int | str | torch.device) -> str:
    """The canonical name of a device: ``0`` -> ``"cuda:0"``, ``"cuda"`` -> ``"cuda:0"``, ``"cpu:0"`` -> ``"cpu"``."""
    if isinstance(device, bool):
        raise UnknownDeviceError(device, ())
    if isinstance(device, int):
        if device < 0:
            raise UnknownDeviceError(device, ())
        return f"cuda:{device}"
    if not isinstance(device, str) and not _is_torch_device(device):
        raise UnknownDeviceError(device, (), "is not a device name")
    text = str(device).strip().lower()
    match = _DEVICE.match(text)
    if not match:
        reason = "is a device type pipemap does not run on (it runs on CUDA GPUs and the CPU)" if _OTHER.match(
            text) else "is not a device name"
        raise UnknownDeviceError(device, (), reason)
    kind, index = match.groups()
    if kind == "cpu":
        if index and int(index) != 0:
            raise UnknownDeviceError(device, (), "is not a device: the CPU is one device, 'cpu'")
        return "cpu"
    return f"{kind}:{int(index or 0)}"  # int(): "cuda:01" is cuda:1


def real_device(device: int | str | torch.device) -> str:
    """``normalize_device`` for a device a user names for real work: a stand-in ``meta:N`` is refused."""
    name = normalize_device(device)
    if name.startswith("meta"):
        raise UnknownDeviceError(device, (), "is the stand-in of a dry run, not a device weights can live on")
    return name


def is_accelerator(device: str) -> bool:
    """True for a GPU or a stand-in for one (``meta:N``), False for the CPU."""
    return device != "cpu"


def _is_torch_device(value: object) -> bool:
    return type(value).__module__ == "torch" and type(value).__name__ == "device"

