"""The machine a plan is made for: its devices and how much memory each offers.

Devices are canonical strings everywhere in pipemap (``devices.normalize_device``). ``Hardware.detect`` reads this
machine (CUDA's free memory, the available RAM); everything else here is plain values.
"""

from __future__ import annotations

import functools
import json
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .devices import is_accelerator, real_device
from .errors import ArgumentTypeError, DecimalSizeWarning, HardwareSpecError, UnknownDeviceError
from .ram import ram_figure
from .units import decimal_note, format_bytes, parse_bytes

_SHORTHAND = re.compile(r"^(\d+)\s*x\s*(.+)$", re.ASCII)
MAX_GPUS = 1024  # a spec's COUNT: beyond this it is a typo, and 10**6 devices would take long to plan for


@dataclass(frozen=True)
class Device:
    """One device and the memory it offers to the plan (free memory when detected, the given figure otherwise)."""

    name: str
    memory: int

    def __str__(self) -> str:
        return f"{self.name}={format_bytes(self.memory)}"


# The cost model's fitted constants (bench/CALIBRATION.md: each fitted on one published figure, then held against
# figures nothing was fitted on). The share of a GPU's datasheet dense bf16 FLOP/s and memory bandwidth that eager
# PyTorch sustains over a diffusion pipeline's kernels but attention (priced at its backend's published rate,
# ``ATTENTION_SHARE``), for the GPUs a published figure fits it on. A GPU without one
# takes its generation's default share (``GENERATION_SHARE``: the share fitted on that generation's GPU, the figure
# saying so), never another generation's. And the seconds the host takes to launch a kernel (Python, dispatch),
# fitted on SD 1.5 on an A100, a small UNet whose GPU waits for its launches.
SUSTAINED = {"l40s": 0.917, "h100": 0.622, "a100": 0.483}
# generation -> (its default share, where it comes from). Turing has no published figure fitted: it takes the share
# of the nearest generation that has one (Ampere), stated as such.
GENERATION_SHARE = {"hopper": (SUSTAINED["h100"], "fitted on the H100"),
                    "ampere": (SUSTAINED["a100"], "fitted on the A100"),
                    "ada": (SUSTAINED["l40s"], "fitted on the L40S"),
                    "turing": (SUSTAINED["a100"], "no Turing fit: Ampere's, fitted on the A100"),
                    # no Blackwell figure fitted yet: the data-centre part (HBM) takes Hopper's, the GeForce part
                    # (GDDR7, a tensor rate near the L40S's per byte of bandwidth) Ada's, each stated as such
                    "blackwell": (SUSTAINED["h100"], "no Blackwell fit: Hopper's, fitted on the H100"),
                    "blackwell_rtx": (SUSTAINED["l40s"], "no GeForce Blackwell fit: Ada's, fitted on the L40S"),
                    # ROCm's eager kernels reach a lower share of CDNA 3's datasheet than CUDA's of Hopper's
                    # (unmeasured here): Hopper's share is an upper bound, stated as such
                    "cdna3": (SUSTAINED["h100"], "no CDNA 3 fit: Hopper's, fitted on the H100 (likely optimistic)")}
GENERATION = {"h200": "hopper", "h100": "hopper", "h800": "hopper", "h20": "hopper", "a100": "ampere",
              "a800": "ampere", "a6000": "ampere", "a10": "ampere", "3090": "ampere", "l40s": "ada", "l40": "ada",
              "l20": "ada", "4090": "ada", "4080": "ada", "l4": "ada", "t4": "turing", "b200": "blackwell",
              "5090": "blackwell_rtx", "mi300x": "cdna3", "mi325x": "cdna3"}
# a generation without a fused attention figure of its own takes this generation's (FlashAttention-2 runs Ampere
# kernels on Ada and Turing; on Blackwell and CDNA 3 the Hopper-class figure is the nearest published one)
ATTENTION_FALLBACK = {"ada": "ampere", "turing": "ampere", "blackwell": "hopper", "blackwell_rtx": "ampere",
                      "cdna3": "hopper"}
KERNEL_SECONDS = 4.02e-5
# Attention backends: the share of a GPU's datasheet dense bf16 FLOP/s each fused kernel's forward reaches, by
# generation, from published kernel benchmarks (head dim 128, long sequences), and where each figure comes from. The
# backend is what the user's stack runs (``attention=`` in a profile), not a fit; the fits price attention at
# ``DEFAULT_ATTENTION``'s rate. "dense": attention at the GPU's sustained share, as matrix products (a GPU without a
# datasheet figure, where no rate is known). "math": PyTorch's unfused path, the score
# matrices written and read through memory (``cost.MATH_SCORE_BYTES``). A generation without a figure takes the one
# named beside it.
ATTENTION_SHARE: dict[str, tuple[dict[str, float], str]] = {
    "flash": ({"hopper": 0.35, "ampere": 0.70}, "FlashAttention-2: ~35% of an H100's peak (FlashAttention-3 paper, "
              "Shah et al. 2024), 50-73% of an A100's (FlashAttention-2 paper, Dao 2023); Ada and Turing: Ampere's"),
    "fa3": ({"hopper": 0.75}, "FlashAttention-3 forward: up to 75% of an H100's peak (Shah et al. 2024); Hopper "
            "only, other generations run FlashAttention-2's figure"),
    "cudnn": ({"hopper": 0.60}, "cuDNN 9 fused attention: about 0.6 of an H100's peak (the FlashAttention-3 paper's "
              "cuDNN baseline, approximate); other generations FlashAttention-2's figure"),
    "efficient": ({"hopper": 0.20, "ampere": 0.40}, "memory-efficient (xFormers CUTLASS) kernels: about half of "
                  "FlashAttention-2's rate on an A100 (FlashAttention-2 paper), Ampere kernels on Hopper at Ampere's "
                  "rate per clock (approximate)"),
}
ATTENTION_BACKENDS = ("dense", "math", *ATTENTION_SHARE)
# what PyTorch's SDPA runs for 16-bit inputs without a mask on Ampere, Ada and Hopper (torch 2.1-2.5, diffusers'
# default processors), for a named GPU whose profile names no backend
DEFAULT_ATTENTION = "flash"


@dataclass(frozen=True)
class Performance:
    """What the cost model needs to know of a machine: one GPU's sustained FLOP/s (bf16 tensor cores; float32
    operands run at half of it, as TF32 does) and memory bandwidth, the seconds a kernel launch adds, the
    host-to-GPU link and the GPU-to-GPU link in bytes per second, the CPU's FLOP/s, and how fast weights left in
    their files are read from the disk (``disk_bw=``; ``pipemap doctor`` measures this machine's)."""

    flops: float = 100e12
    host_bandwidth: float = 25e9
    peer_bandwidth: float = 20e9
    cpu_flops: float = 0.5e12
    memory_bandwidth: float = 600e9
    kernel_seconds: float = KERNEL_SECONDS
    kernel_origin: str = "default"  # where ``kernel_seconds`` comes from: a key of KERNEL_ORIGINS
    disk_bandwidth: float = 2e9  # an NVMe SSD's sustained reads through the page cache
    disk_origin: str = "default"  # where ``disk_bandwidth`` comes from: a key of DISK_ORIGINS
    origin: str = "generic figures: no GPU model named"  # where the GPU's sustained figures come from
    attention: str = "dense"  # the attention backend the stack runs (``ATTENTION_BACKENDS``)
    attention_flops: float | None = None  # its sustained FLOP/s (None: the dense rate, ``flops``)

    def __post_init__(self) -> None:
        for name in ("flops", "host_bandwidth", "peer_bandwidth", "cpu_flops", "memory_bandwidth", "kernel_seconds",
                     "disk_bandwidth"):
            value = getattr(self, name)
            # `not value > 0` also catches NaN; a zero figure would divide by zero in the cost model
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
                raise HardwareSpecError(repr(self), f"{name}={value!r}", "a speed must be a positive finite number")
        if self.disk_origin not in DISK_ORIGINS:
            raise HardwareSpecError(repr(self), f"disk_origin={self.disk_origin!r}", f"one of {sorted(DISK_ORIGINS)}")
        if self.kernel_origin not in KERNEL_ORIGINS:
            raise HardwareSpecError(repr(self), f"kernel_origin={self.kernel_origin!r}",
                                    f"one of {sorted(KERNEL_ORIGINS)}")

    @property
    def disk_text(self) -> str:
        """The disk figure and where it comes from, as a plan's note and ``explain()`` say it."""
        return f"{self.disk_bandwidth / 1e9:.3g} GB/s ({DISK_ORIGINS[self.disk_origin]})"

    @property
    def kernel_text(self) -> str:
        """The host's seconds a kernel launch and where they come from, as ``explain()`` says it."""
        return f"{self.kernel_seconds * 1e6:.3g} us a kernel ({KERNEL_ORIGINS[self.kernel_origin]})"


# A measured figure describes this machine only: a spec for another machine (GPUs this one lacks, another GPU model)
# takes its stated or default figures, so one spec gives the same plan and estimate on every machine.
DISK_ORIGINS = {
    "default": "the default, an NVMe SSD; `pipemap doctor` measures this machine's, used when planning for it",
    "measured": "this machine's, measured by `pipemap doctor`",
    "stated": "disk_bw= in the hardware spec",
}
# The host's launch cost, as the disk: measured by ``pipemap doctor`` for this machine, stated in a spec
# (``launch=12us``), else its GPU class's default: the hosts a GPU class ships in launch at different speeds (a
# 2023 A100 host with torch 2.1, a Sapphire Rapids or Genoa H100/B200 host with a newer torch). Each default is
# fitted on one published figure a host's launches set (bench/CALIBRATION.md): KERNEL_SECONDS on SD 1.5 on an A100
# (fal's benchmark); the data-centre Hopper hosts' on FLUX.1-dev split over 2 H100s (xDiT's Ulysses-2 run, 4.38 s:
# each rank launches every kernel of its half and its exchanges' own, ~3,700 + 680 a call, for ~0.12 s of GPU
# work), from the source the H100's sustained share is fitted on (its 1-GPU run); Blackwell hosts take the Hopper
# hosts' (no Blackwell figure yet); every other class the A100 host's, stated as such.
HOST_LAUNCH = {"hopper": 30.6e-6, "blackwell": 30.6e-6}
KERNEL_ORIGINS = {
    "default": "the default, fitted on one A100 host (bench/CALIBRATION.md); `pipemap doctor` measures this machine's",
    "default_hopper": "a Hopper host's default, fitted on FLUX.1-dev on 2 H100s (bench/CALIBRATION.md); `pipemap "
                      "doctor` measures this machine's, launch= states one",
    "default_blackwell": "a Blackwell host's default: the Hopper host's (no Blackwell figure fitted); `pipemap "
                         "doctor` measures this machine's, launch= states one",
    "measured": "this machine's, measured by `pipemap doctor`",
    "stated": "launch= in the hardware spec",
}


# The links, as measured rather than as the spec sheets give them (bench/CALIBRATION.md, "The GPU table"):
# - pinned host-to-GPU copies: PCIe 4.0 x16 about 25 GB/s of its 32 line rate; PCIe 5.0 x16 35-53 GB/s by direction
#   and copy engine (its line rate 64), priced at the middle of that range (nvbandwidth's host_to_device_memcpy_ce
#   reads ~55 at best); PCIe 3.0 about 12.
# - NVLink through NCCL: about 0.82 of the line rate one way ("with the protocol overhead (~20%) NCCL can get an
#   effective NVLink bandwidth of 370GB/s" of NVLink 4's 450, NVIDIA/nccl-tests#212); NVLink 5 (900 one way) and
#   the H800's and A800's cut-down NVLink (200 one way) at that share; NVLink 3 on the A100 about 200 GB/s as
#   nccl-tests reports it on 8xA100 (NVIDIA/nccl-tests#149, #178).
# - GPUs without NVLink: peer copies through the host (GeForce has no P2P) at about 0.8 of the host link.
# - MI300X: one xGMI link between a pair of GPUs (64 GB/s one way of its 7 links) at NVLink's 0.82: a pair's figure;
#   8 GPUs exchange over all 7 links at once, which one figure does not model (priced as a pair: pessimistic there).
PCIE3, PCIE4, PCIE5 = 12e9, 25e9, 44e9
NVLINK_MEASURED_SHARE = 370 / 450
NVLINK3, NVLINK4, NVLINK5 = 200e9, 450e9 * NVLINK_MEASURED_SHARE, 900e9 * NVLINK_MEASURED_SHARE
NVLINK_CUT = 200e9 * NVLINK_MEASURED_SHARE  # H800, A800: 400 GB/s both ways
XGMI_PAIR = 64e9 * NVLINK_MEASURED_SHARE

# name fragment (lower case) -> datasheet figures: dense bf16 tensor FLOP/s (no sparsity; GeForce: with FP32
# accumulate, as PyTorch runs them), memory bandwidth, and the links above: pinned host-to-GPU copies and GPU-to-GPU.
# Nothing here is fitted: the sustained figures are the SUSTAINED share of them. A name matches its longest fragment
# ("h200" before "h20", "l40s" before "l40" and "l4"). Datasheets: NVIDIA's HGX B200 (2.25 PFLOP/s bf16 dense a GPU,
# 8 TB/s), H20 (148 TFLOP/s, 4.0 TB/s), RTX 5090 (209.5 TFLOP/s FP16/FP32-accumulate, 1792 GB/s), L40 (181, 864 GB/s),
# A10 (125, 600 GB/s), A800/H800 (the A100's/H100's compute, NVLink 400 GB/s both ways); AMD's MI300X (1307.4
# TFLOP/s bf16 dense, 5.3 TB/s) and MI325X (1307.4, 6 TB/s).
GPU_PERFORMANCE = {
    "b200": (2250e12, 8.0e12, PCIE5, NVLINK5), "h200": (989e12, 4.8e12, PCIE5, NVLINK4),
    "h100": (989e12, 3.35e12, PCIE5, NVLINK4), "h800": (989e12, 3.35e12, PCIE5, NVLINK_CUT),
    "h20": (148e12, 4.0e12, PCIE5, NVLINK4), "a100": (312e12, 2.0e12, PCIE4, NVLINK3),
    "a800": (312e12, 2.0e12, PCIE4, NVLINK_CUT), "l40s": (362e12, 864e9, PCIE4, PCIE4), "l40": (181e12, 864e9, PCIE4,
                                                                                               PCIE4),
    "l20": (119.5e12, 864e9, PCIE4, PCIE4), "a6000": (154.8e12, 768e9, PCIE4, PCIE4),
    "a10": (125e12, 600e9, PCIE4, 0.8 * PCIE4), "5090": (209.5e12, 1792e9, PCIE5, 0.8 * PCIE5),
    "4090": (165.2e12, 1008e9, PCIE4, 0.8 * PCIE4), "3090": (71e12, 936e9, PCIE4, 0.8 * PCIE4),
    "4080": (97.5e12, 717e9, PCIE4, 0.8 * PCIE4), "l4": (121e12, 300e9, PCIE4, 0.8 * PCIE4),
    "t4": (65e12, 320e9, PCIE3, 10e9), "mi300x": (1307.4e12, 5.3e12, PCIE5, XGMI_PAIR),
    "mi325x": (1307.4e12, 6.0e12, PCIE5, XGMI_PAIR),
}
# Each GPU's datasheet FP32 FLOP/s on its CUDA cores (its vector units, without tensor cores; AMD's vector FP32):
# what runs the part of a kernel outside its matrix products (exponentials, scaling, address arithmetic, the
# softmax of a fused attention), for ``moved_share``
VECTOR_FLOPS = {"b200": 75e12, "h200": 67e12, "h100": 67e12, "h800": 67e12, "h20": 44e12, "a100": 19.5e12,
                "a800": 19.5e12, "l40s": 91.6e12, "l40": 90.5e12, "l20": 59.8e12, "a6000": 38.7e12, "a10": 31.2e12,
                "5090": 104.8e12, "4090": 82.6e12, "3090": 35.6e12, "4080": 48.7e12, "l4": 30.3e12, "t4": 8.1e12,
                "mi300x": 163.4e12, "mi325x": 163.4e12}
# the GPU each generation's shares are fitted on (its sustained share) or taken as (its attention share), which
# ``moved_share`` moves a GPU of that generation's from; CDNA 3 keeps Hopper's share as its stated upper bound
SHARE_REFERENCE = {"hopper": "h100", "ampere": "a100", "ada": "l40s", "turing": "a100", "blackwell": "h100",
                   "blackwell_rtx": "l40s"}
_PERF_KEYS = {"gpu", "flops", "host_bw", "peer_bw", "mem_bw", "disk_bw", "reserve", "attention", "launch"}
# Kept off each detected GPU's free memory, beside the activation headroom: cuBLAS/cuDNN workspaces and the
# allocator's fragmentation (0.3 to 1 GiB); the CUDA context itself is already out of the free figure, since
# reading it starts the context.
GPU_RESERVE = 512 * 2**20


def attention_rate(gpu: str, backend: str) -> tuple[float | None, str]:
    """The sustained FLOP/s of ``backend``'s fused attention on a GPU (``GPU_PERFORMANCE``'s key) and where the
    figure comes from; None for "dense" and "math" (attention at the dense rate)."""
    if backend not in ATTENTION_SHARE:
        return None, f"attention {backend}: at the dense rate"
    shares, origin = ATTENTION_SHARE[backend]
    flash = ATTENTION_SHARE["flash"][0]
    generation = GENERATION[gpu]
    share = moved_share(shares.get(generation) or flash.get(generation)
                        or flash[ATTENTION_FALLBACK.get(generation, "ampere")], gpu)
    return GPU_PERFORMANCE[gpu][0] * share, f"attention {backend} at {share:.2g} of the datasheet ({origin})"


def performance_for(gpu_name: str | None, attention: str = DEFAULT_ATTENTION,
                    this_machine: bool = False) -> Performance:
    """Figures for a GPU model name (``"NVIDIA H100 80GB HBM3"``, ``"4090"``): the sustained share of its datasheet
    FLOP/s and memory bandwidth (``sustained_share``), its links, its ``attention`` backend's rate
    (``attention_rate``) and its class's host launch cost (``launch_default``); generic figures if unknown
    (attention at the dense rate). ``origin`` says which share and rate priced it. The disk is this machine's as
    ``pipemap doctor`` measured it when the figures are for ``this_machine`` and it did; the default otherwise; the
    host's seconds a kernel launch likewise."""
    fragment = gpu_key(gpu_name)
    measured = measured_disk_bandwidth() if this_machine else None
    disk, disk_origin = (measured, "measured") if measured else (Performance.disk_bandwidth, "default")
    launch = measured_kernel_seconds() if this_machine else None
    kernel, kernel_origin = (launch, "measured") if launch else launch_default(fragment)
    if fragment is None:
        backend = "dense" if attention in ATTENTION_SHARE else attention  # no rate without the GPU
        return Performance(disk_bandwidth=disk, disk_origin=disk_origin, kernel_seconds=kernel,
                           kernel_origin=kernel_origin, attention=backend)
    flops, memory, host, peer = GPU_PERFORMANCE[fragment]
    share, origin = tensor_share(fragment)
    rate, said = attention_rate(fragment, attention)
    return Performance(flops * share, host, peer, memory_bandwidth=memory * sustained_share(fragment)[0],
                       disk_bandwidth=disk, disk_origin=disk_origin, kernel_seconds=kernel, kernel_origin=kernel_origin,
                       origin=f"{fragment.upper()} datasheet at {share:.3g} of it ({origin}); {said}",
                       attention=attention, attention_flops=rate)


def launch_default(gpu: str | None) -> tuple[float, str]:
    """The host's default seconds a kernel launch for a GPU (``GPU_PERFORMANCE``'s key, None: unknown) and its
    ``KERNEL_ORIGINS`` key: its class's figure (``HOST_LAUNCH``), the A100 host's fit for a class without one."""
    generation = GENERATION.get(gpu or "", "")
    if generation in HOST_LAUNCH:
        return HOST_LAUNCH[generation], f"default_{generation}"
    return KERNEL_SECONDS, "default"


def gpu_key(name: str | None) -> str | None:
    """The ``GPU_PERFORMANCE`` key a GPU model name matches (its longest fragment: ``"NVIDIA H20"`` is the H20,
    ``"NVIDIA H200"`` the H200), or None."""
    lowered = (name or "").lower()
    return max((fragment for fragment in GPU_PERFORMANCE if fragment in lowered), key=len, default=None)


def sustained_share(gpu: str) -> tuple[float, str]:
    """A GPU's (``GPU_PERFORMANCE``'s key) sustained share of its datasheet and where it comes from: its own fit,
    else its generation's default."""
    if gpu in SUSTAINED:
        return SUSTAINED[gpu], f"fitted on the {gpu.upper()}"
    share, origin = GENERATION_SHARE[GENERATION[gpu]]
    return share, f"no {gpu.upper()} fit: the {GENERATION[gpu].capitalize()} generation's default, {origin}"


def tensor_share(gpu: str) -> tuple[float, str]:
    """The share of a GPU's datasheet dense FLOP/s it sustains (``GPU_PERFORMANCE``'s key): its own fit, else its
    generation's share moved to it (``moved_share``); its memory keeps ``sustained_share``."""
    share, origin = sustained_share(gpu)
    if gpu in SUSTAINED:
        return share, origin
    moved = moved_share(share, gpu)
    return moved, origin if moved == share else f"{origin}, moved to {moved:.3g} by its tensor and vector rates"


def moved_share(share: float, gpu: str) -> float:
    """A share of the datasheet FLOP/s taken on the reference GPU of ``gpu``'s generation (``SHARE_REFERENCE``),
    moved to ``gpu``: a FLOP's time is one at the tensor cores' peak plus the rest of its kernel on the vector units
    (``VECTOR_FLOPS``), in the reference's proportion, so a GPU whose tensor cores are slow beside its vector units
    reaches a larger share of their peak (the H20: 148 tensor TFLOP/s beside 44 vector, the H100's 989 beside 67).

    >>> round(moved_share(0.622, "h20"), 3), moved_share(0.622, "h200")
    (0.878, 0.622)
    """
    reference = SHARE_REFERENCE.get(GENERATION[gpu])
    if reference is None or reference == gpu:
        return share
    ratio = (GPU_PERFORMANCE[gpu][0] / VECTOR_FLOPS[gpu]) / (GPU_PERFORMANCE[reference][0] / VECTOR_FLOPS[reference])
    return 1 / (1 + (1 / share - 1) * ratio)


LAUNCH_FILE = "launch.json"
DISK_FILE = "disk.json"  # beside the transfer checks' cache: ``pipemap doctor``'s measured disk read speed


def disk_cache_path() -> Path:
    """``$PIPEMAP_CACHE_DIR/disk.json``, else under huggingface_hub's home (where the weights are read from)."""
    root = os.environ.get("PIPEMAP_CACHE_DIR")
    if not root:
        from huggingface_hub import constants

        root = os.path.join(constants.HF_HOME, "pipemap")
    return Path(root) / DISK_FILE


def launch_cache_path() -> Path:
    """``launch.json`` beside ``disk.json``: the host's seconds a kernel launch, as ``pipemap doctor`` measured them."""
    return disk_cache_path().with_name(LAUNCH_FILE)


def measured_kernel_seconds() -> float | None:
    """The host's seconds a kernel launch ``pipemap doctor`` measured on this machine, or None."""
    return _measured(launch_cache_path(), "kernel_seconds")


def measured_disk_bandwidth() -> float | None:
    """The disk read speed ``pipemap doctor`` measured on this machine (bytes per second), or None."""
    return _measured(disk_cache_path(), "disk_bw")


def _measured(path: Path, key: str) -> float | None:
    """``key`` of the doctor's JSON file at ``path``: a positive number, or None. Read again only when the file
    changed (its size and time): every plan and load asks (issue 38: load time)."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return _read_measured(str(path), stat.st_mtime_ns, stat.st_size, key)


@functools.lru_cache(maxsize=16)
def _read_measured(path: str, mtime: int, size: int, key: str) -> float | None:
    try:
        value = json.loads(Path(path).read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def gpu_names() -> list[str]:
    """This machine's CUDA GPUs by name (``cuda:0``, ...), nothing else detected."""
    return [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


@dataclass(frozen=True)
class Hardware:
    """The devices of a machine, GPUs first in index order, then the CPU.

    >>> hw = Hardware.parse("2x24GiB,cpu=64GiB")
    >>> [d.name for d in hw.devices]
    ['cuda:0', 'cuda:1', 'cpu']
    """

    devices: tuple[Device, ...]
    detected: bool = False
    performance: Performance = Performance()
    reserve: int = 0  # bytes kept off each GPU's figure for the CUDA context and library workspaces

    @classmethod
    def detect(cls, reserve: int = GPU_RESERVE) -> Hardware:
        """The real machine: each CUDA GPU with its free memory less ``reserve``, and the CPU with the RAM this
        process may use (``ram.ram``: the available RAM, or less where a container's cgroup limit leaves less). The
        CUDA cache is emptied first: blocks this process cached are free for a plan, not used."""
        gpus = []
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            for index in range(torch.cuda.device_count()):
                free, _total = torch.cuda.mem_get_info(index)
                gpus.append(Device(f"cuda:{index}", max(0, int(free) - reserve)))
        name = torch.cuda.get_device_name(0) if gpus else None
        return cls(tuple(gpus) + (Device("cpu", ram_figure()),), detected=True,
                   performance=performance_for(name, this_machine=True), reserve=reserve if gpus else 0)

    @classmethod
    def parse(cls, spec: str) -> Hardware:
        """A profile from text: ``"cuda:0=24GiB,cuda:1=24GiB,cpu=64GiB"`` or ``"2x24GiB,cpu=64GiB"``.

        A profile without ``cpu`` gets the RAM this process may use (``ram.ram``) as its CPU memory. The cost
        model's figures may follow: ``gpu=4090`` (defaults for that model), ``flops=120T`` (sustained),
        ``host_bw=25GB``, ``peer_bw=50GB``, ``mem_bw=700GB`` (sustained), ``disk_bw=3GB`` (bytes per second),
        ``attention=flash`` (the attention backend the stack runs: ``ATTENTION_BACKENDS``; a fused one needs gpu=),
        ``launch=12us`` (the host's seconds a kernel launch: ``pipemap doctor`` measures this machine's);
        ``reserve=512MiB`` is kept off each GPU for the CUDA context and workspaces (none unless given: a profile's
        figures are what the plan may use).

        The disk speed ``pipemap doctor`` measured applies only to a spec of this machine (no ``gpu=``, and no GPU
        this machine lacks): a spec for another machine gives the same plan and estimate everywhere.
        """
        if not isinstance(spec, str):
            raise ArgumentTypeError("hardware", spec, "a spec string such as '2x24GiB,cpu=64GiB' or a Hardware")
        devices: dict[str, int] = {}
        settings: dict[str, str] = {}
        for part in (p.strip() for p in spec.split(",")):
            if not part:
                continue
            key = part.split("=", 1)[0].strip().lower()
            if key in _PERF_KEYS and "=" in part:
                settings[key] = part.split("=", 1)[1].strip()
                continue
            for name, memory in _parse_part(spec, part, gpus=sum(is_accelerator(d) for d in devices)):
                if name in devices:
                    raise HardwareSpecError(spec, part, f"{name} is given twice")
                devices[name] = memory
        if not devices:
            raise HardwareSpecError(spec, spec, "no device is given")
        if "cpu" not in devices:
            devices["cpu"] = ram_figure()
        reserve = _size(spec, f"reserve={settings['reserve']}", settings["reserve"]) if "reserve" in settings else 0
        devices = {n: max(0, m - reserve) if is_accelerator(n) else m for n, m in devices.items()}
        this_machine = "gpu" not in settings and _present(devices)
        return cls(_ordered(devices), performance=_performance(spec, settings, this_machine), reserve=reserve)

    def with_max_memory(self, max_memory: Mapping[int | str, int | str]) -> Hardware:
        """This machine restricted to the devices of a diffusers/accelerate ``max_memory`` dict, with its figures.

        As in accelerate, GPUs left out of ``max_memory`` are not used; the CPU keeps its figure unless given.
        """
        if not isinstance(max_memory, Mapping):
            raise ArgumentTypeError("max_memory", max_memory, "a dict such as {0: '20GiB', 'cpu': '64GiB'}")
        given = {real_device(k): parse_bytes(v) for k, v in max_memory.items()}
        for value in max_memory.values():
            _note_decimal(value)
        for name in given:
            if name not in self.names:
                raise UnknownDeviceError(name, self.names)
        memory = {d.name: d.memory for d in self.devices if d.name == "cpu"}
        memory.update(given)
        return replace(self, devices=_ordered(memory))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.devices)

    @property
    def gpus(self) -> tuple[Device, ...]:
        return tuple(d for d in self.devices if is_accelerator(d.name))

    def memory(self, device: str) -> int:
        for d in self.devices:
            if d.name == device:
                return d.memory
        raise UnknownDeviceError(device, self.names)

    def __str__(self) -> str:
        return ",".join(str(d) for d in self.devices)


def _parse_part(spec: str, part: str, gpus: int) -> list[tuple[str, int]]:
    shorthand = _SHORTHAND.match(part)
    if shorthand:
        count, size = int(shorthand.group(1)), _size(spec, part, shorthand.group(2))
        if not 0 < count <= MAX_GPUS:
            raise HardwareSpecError(spec, part, f"COUNT must be between 1 and {MAX_GPUS}")
        return [(f"cuda:{gpus + i}", size) for i in range(count)]
    if "=" not in part:
        raise HardwareSpecError(spec, part, "each device is NAME=SIZE, or COUNTxSIZE for identical GPUs")
    name, text = part.split("=", 1)
    try:
        device = real_device(name.strip())
    except UnknownDeviceError as err:
        raise HardwareSpecError(spec, part, f"{name.strip()!r} {err.reason}") from err
    return [(device, _size(spec, part, text))]


def _present(devices: Mapping[str, int]) -> bool:
    """Whether this machine has every GPU ``devices`` names (a CPU-only spec describes any machine's CPU)."""
    gpus = [int(name.partition(":")[2] or 0) for name in devices if is_accelerator(name)]
    if not gpus:
        return True
    return torch.cuda.is_available() and max(gpus) < torch.cuda.device_count()


def _performance(spec: str, settings: Mapping[str, str], this_machine: bool) -> Performance:
    backend = settings.get("attention", DEFAULT_ATTENTION).lower()
    if backend not in ATTENTION_BACKENDS:
        raise HardwareSpecError(spec, f"attention={backend}", f"the backends are {', '.join(ATTENTION_BACKENDS)}")
    base = performance_for(settings.get("gpu"), backend, this_machine)
    if "attention" in settings and backend in ATTENTION_SHARE and base.attention_flops is None:
        raise HardwareSpecError(spec, f"attention={backend}", "a fused backend's rate needs the GPU: add gpu=")
    flops, host, peer = base.flops, base.host_bandwidth, base.peer_bandwidth
    if "flops" in settings:
        flops = _flops(spec, settings["flops"])
    if "host_bw" in settings:
        host = _bandwidth(spec, "host_bw", settings["host_bw"])
    if "peer_bw" in settings:
        peer = _bandwidth(spec, "peer_bw", settings["peer_bw"])
    memory = _bandwidth(spec, "mem_bw", settings["mem_bw"]) if "mem_bw" in settings else base.memory_bandwidth
    if "disk_bw" in settings:
        disk, disk_origin = _bandwidth(spec, "disk_bw", settings["disk_bw"]), "stated"
    else:
        disk, disk_origin = base.disk_bandwidth, base.disk_origin
    kernel, kernel_origin = base.kernel_seconds, base.kernel_origin
    if "launch" in settings:
        kernel, kernel_origin = _seconds(spec, "launch", settings["launch"]), "stated"
    stated = [key for key in ("flops", "mem_bw") if key in settings]
    origin = base.origin + (f"; {' and '.join(stated)} as given" if stated else "")
    return replace(base, flops=flops, host_bandwidth=host, peer_bandwidth=peer, memory_bandwidth=memory,
                   disk_bandwidth=disk, disk_origin=disk_origin, origin=origin, kernel_seconds=kernel,
                   kernel_origin=kernel_origin)


_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def _seconds(spec: str, key: str, text: str) -> float:
    """A duration: a number with a unit (``12us``, ``0.012ms``, ``1.2e-5s``)."""
    match = re.match(r"^\s*(\d+(?:\.\d+)?(?:e-?\d+)?)\s*(s|ms|us|µs|ns)\s*$", text.strip().lower())
    if not match:
        raise HardwareSpecError(spec, f"{key}={text}", "write a duration with its unit: 12us, 0.012ms, 1.2e-5s")
    value = float(match.group(1)) * _TIME_UNITS[match.group(2)]
    if not 0 < value < 1:
        raise HardwareSpecError(spec, f"{key}={text}", "a kernel launch takes more than 0 and less than 1 second")
    return value


def _bandwidth(spec: str, key: str, text: str) -> float:
    value = float(_size(spec, f"{key}={text}", text, memory=False))
    if value <= 0:
        raise HardwareSpecError(spec, f"{key}={text}", "a bandwidth must be above zero bytes per second")
    return value


def _flops(spec: str, text: str) -> float:
    scale = {"": 1.0, "g": 1e9, "t": 1e12, "p": 1e15}
    match = re.match(r"^\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([gtpGTP]?)\s*$", text, re.ASCII)
    if not match:
        raise HardwareSpecError(spec, f"flops={text}", "write FLOP/s as a number with an optional G, T or P")
    flops = float(match.group(1)) * scale[match.group(2).lower()]
    if not 0 < flops < float("inf"):
        raise HardwareSpecError(spec, f"flops={text}", "FLOP/s must be above zero")
    return flops


def _size(spec: str, part: str, text: str, memory: bool = True) -> int:
    """Bytes of a spec's size; a memory size in KB/MB/GB is noted (``_note_decimal``), a speed's figure not."""
    try:
        size = parse_bytes(text.strip())
    except ValueError as err:
        raise HardwareSpecError(spec, part, str(err)) from err
    if memory:
        _note_decimal(text)
    return size


def _note_decimal(text: object) -> None:
    """Say how a size in KB/MB/GB/TB was read (powers of 1000: ``16GB`` is 14.90 GiB), never silently."""
    note = decimal_note(text) if isinstance(text, str) else None
    if note is not None:
        warnings.warn(DecimalSizeWarning(f"pipemap: {note}"), stacklevel=4)


def _ordered(memory: Mapping[str, int]) -> tuple[Device, ...]:
    def key(name: str) -> tuple[int, str, int]:
        kind, _, index = name.partition(":")
        return (name == "cpu", kind, int(index or 0))

    return tuple(Device(name, memory[name]) for name in sorted(memory, key=key))
