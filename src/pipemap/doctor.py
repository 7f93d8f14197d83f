"""``pipemap doctor``: what this machine offers a plan, and whether copies between its GPUs arrive intact.

It prints the devices with their free memory, the driver, CUDA and torch versions, the transfer matrix of
``check_transfers`` and what that means for planning. A machine without a GPU is a normal case: the report says
so and the exit code is 0.
"""

from __future__ import annotations

import json
import os
import platform
import time

import psutil
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import __version__
from .hardware import disk_cache_path, launch_cache_path, measured_disk_bandwidth, measured_kernel_seconds
from .ram import ram
from .runtime.transfer import FIXED_DRIVER, Copy, TransferReport, cache_path, check_transfers, driver_version
from .units import format_bytes

DISK_PROBE = 128 * 2**20  # bytes written, dropped from the page cache, and read back to time the disk
# The launch probe: a stack of tiny layers (a linear layer, a norm, an activation) run eagerly, so each kernel's own
# work is nothing and the time is the host's: the module calls, the dispatcher and the launch, as a model's are
LAUNCH_LAYERS = 32
LAUNCH_WIDTH = 8
LAUNCH_CALLS = 20


def doctor_text(devices: list[str] | None = None, copy: Copy | None = None) -> str:
    """The doctor's report as text. ``devices`` and ``copy`` go to ``check_transfers`` (default: every GPU).

    >>> print(doctor_text())                                      # doctest: +SKIP
    pipemap doctor
    ...
    """
    report = _transfer_report(devices, copy)
    sections = [
        "pipemap doctor",
        _versions(),
        "Devices\n" + "\n".join(_device_lines()),
        "Copies between GPUs\n" + _transfer_section(report),
        "Disk (weights left in their files are read from it)\n" + _disk_section(),
        "Host (each kernel the GPU runs is launched from it)\n" + _launch_section(),
        "What it means for planning\n" + "\n".join(f"  - {line}" for line in _meaning(report)),
    ]
    return "\n\n".join(sections)


def run_doctor() -> int:
    """Print the doctor's report; the exit code is 0, on a machine without a GPU too.

    >>> raise SystemExit(run_doctor())                            # doctest: +SKIP
    """
    print(doctor_text())
    return 0


def main_doctor(args=None) -> int:
    """The ``pipemap doctor`` command (it takes no options); ``args`` is the parsed command line, unused."""
    return run_doctor()


def _versions() -> str:
    cuda = torch.version.cuda or "none (this torch is a CPU-only build)"
    return "\n".join([
        f"  pipemap        {__version__}",
        f"  torch          {torch.__version__}",
        f"  CUDA (torch)   {cuda}",
        f"  NVIDIA driver  {driver_version()}",
        f"  python         {platform.python_version()} on {platform.system()} {platform.machine()}",
    ])


def _device_lines() -> list[str]:
    lines = [_gpu_line(index) for index in range(_gpu_count())]
    if not lines:
        lines.append("  no CUDA GPU found")
    memory, here = psutil.virtual_memory(), ram()
    limit = (f"; cgroup limit {format_bytes(here.limit)}, {format_bytes(here.used)} in use" if here.limit is not None
             else "")
    lines.append(f"  cpu     RAM, {format_bytes(memory.available)} free of {format_bytes(memory.total)}{limit}; "
                 f"a plan may use {format_bytes(here.figure)}")
    return lines


def _gpu_line(index: int) -> str:
    properties = torch.cuda.get_device_properties(index)
    free, total = torch.cuda.mem_get_info(index)
    return (f"  cuda:{index}  {properties.name} (compute {properties.major}.{properties.minor}), "
            f"{format_bytes(free)} free of {format_bytes(total)}")


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _transfer_report(devices: list[str] | None, copy: Copy | None) -> TransferReport | None:
    if devices is None and _gpu_count() < 2:
        return None
    return check_transfers(devices, copy)


def _transfer_section(report: TransferReport | None) -> str:
    if report is None:
        count = _gpu_count()
        what = "no GPU" if count == 0 else "one GPU"
        return f"  {what}: there is no pair of GPUs, so there is nothing to check"
    origin = "from the cache" if report.cached else "just now"
    timing = f"checked {origin} in {report.elapsed:.3f} s; cache: {cache_path()}"
    return "\n".join(["  " + line for line in str(report).splitlines()] + [f"  {timing}"])


def _meaning(report: TransferReport | None) -> list[str]:
    count = _gpu_count()
    if report is None and count == 0:
        return ["every strategy places every component on the CPU; the plan says so and runs, slowly",
                "plan for a GPU machine anyway with hardware='2x24GiB,cpu=64GiB' (planning needs no GPU)"]
    if report is None:
        return ["one GPU: components that do not fit it are offloaded to CPU RAM (balanced_low_memory) or "
                "streamed block by block (balanced_ultra_low_memory)"]
    return _pair_meaning(report)


def _pair_meaning(report: TransferReport) -> list[str]:
    lines = []
    if report.corrupted:
        pairs = ", ".join(f"{s} -> {d}" for s, d in report.corrupted)
        lines.append(f"direct copies arrive corrupted for {pairs}: pipemap stages those pairs through pinned CPU "
                     f"memory (slower). Update the NVIDIA driver to {FIXED_DRIVER} or newer to copy directly")
    if report.no_peer:
        pairs = ", ".join(f"{s} -> {d}" for s, d in report.no_peer)
        lines.append(f"no peer-to-peer access for {pairs}: copies arrive intact but go through host memory, so "
                     "plans that keep chatty components (denoiser and ControlNet) on one GPU run faster")
    if not lines:
        lines.append("every pair copies directly and intact: plans may spread components over all GPUs")
    return lines


def _disk_section() -> str:
    cached = measured_disk_bandwidth()
    origin = "from the cache"
    if cached is None:
        cached, origin = measure_disk_bandwidth(), "just now"
    return (f"  reads {cached / 1e9:.2f} GB/s (measured {origin}; cache: {disk_cache_path()}); plans for this "
            "machine price the disk tier with it (disk_bw= in a hardware spec sets another figure)")


def measure_disk_bandwidth(nbytes: int = DISK_PROBE) -> float:
    """Time reading ``nbytes`` of a new file beside pipemap's cache, dropped from the page cache first (as weights
    not read for a while are); the figure is stored for ``Hardware.detect`` and ``Hardware.parse`` to use."""
    path = disk_cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    probe = path.with_name(f"disk-probe.{os.getpid()}")
    chunk = bytearray(os.urandom(1 << 20)) * 8
    try:
        with open(probe, "wb") as f:
            for _ in range(max(1, nbytes // len(chunk))):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
            if hasattr(os, "posix_fadvise"):  # written pages stay cached: drop them, so the read hits the disk
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        start, read = time.perf_counter(), 0
        with open(probe, "rb", buffering=0) as f:
            while block := f.read(len(chunk)):
                read += len(block)
        bandwidth = read / max(time.perf_counter() - start, 1e-9)
    finally:
        probe.unlink(missing_ok=True)
    try:
        path.write_text(json.dumps({"disk_bw": bandwidth, "folder": str(path.parent)}))
    except OSError:
        pass  # a read-only cache: measured again next time
    return bandwidth


def _launch_section() -> str:
    cached, origin = measured_kernel_seconds(), "from the cache"
    if cached is None:
        cached, origin = measure_kernel_seconds(), "just now"
    return (f"  launches a kernel in {cached * 1e6:.3g} us (measured {origin} on {_launch_device()}; cache: "
            f"{launch_cache_path()}); estimates for this machine price launch-bound calls with it")


def _launch_device() -> str:
    return "cuda:0" if torch.cuda.is_available() else "cpu"  # the device itself: a mocked count runs nothing


def measure_kernel_seconds(device: str | None = None) -> float:
    """The host's seconds a kernel launch: a stack of tiny layers run eagerly on ``device`` (cuda:0 if there is a
    GPU, else the CPU) and timed, over the kernels one pass runs (counted as the dry run counts them); stored for
    ``performance_for`` to price this machine's launch-bound calls with."""
    device = device or _launch_device()
    layers = [torch.nn.Sequential(torch.nn.Linear(LAUNCH_WIDTH, LAUNCH_WIDTH), torch.nn.LayerNorm(LAUNCH_WIDTH),
                                  torch.nn.GELU()) for _ in range(LAUNCH_LAYERS)]
    model = torch.nn.Sequential(*layers).to(device)
    x = torch.randn(1, LAUNCH_WIDTH, device=device)
    with torch.no_grad():
        kernels = _kernels_of(model, x)
        model(x)  # the first pass pays one-time setup (cuBLAS handles, allocations)
        _synchronize(device)
        start = time.perf_counter()
        for _ in range(LAUNCH_CALLS):
            model(x)
        _synchronize(device)
    seconds = (time.perf_counter() - start) / (LAUNCH_CALLS * max(1, kernels))
    try:
        launch_cache_path().parent.mkdir(parents=True, exist_ok=True)
        launch_cache_path().write_text(json.dumps({"kernel_seconds": seconds, "device": device, "kernels": kernels}))
    except OSError:
        pass  # a read-only cache: measured again next time
    return seconds


def _kernels_of(model: torch.nn.Module, x: torch.Tensor) -> int:
    """The kernels one pass launches, as the dry run's counter counts them."""
    from .dryrun.counter import launches_kernel  # here: the doctor's other sections need no dry-run code

    class Count(TorchDispatchMode):
        kernels = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Count.kernels += launches_kernel(func, out)
            return out

    with Count():
        model(x)
    return Count.kernels


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
