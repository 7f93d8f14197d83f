"""The one way pipemap moves tensors between devices, and the self-test that decides how.

Every tensor the dispatcher and its hooks move goes through ``move``/``move_tensor``, so that a GPU pair whose
direct copies are unsafe can be routed through CPU memory in one place. ``check_transfers`` finds such pairs: two
RTX 4090s under drivers older than 550.40.07 turn peer-to-peer copies into zeros without any error, and the
pipeline then produces NaNs or black images. Checking the GPU's name and driver (as accelerate does) only guesses;
this module copies known patterns and compares what arrives.

Endpoints are canonical device names (``"cuda:1"``, ``"cpu"``); ``"cpu:N"`` for N >= 1 names a stand-in endpoint
that lives on the real CPU, so the check and the staging routes can be tested on a machine without GPUs.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import os
import re
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from ..devices import normalize_device
from ..errors import UnknownDeviceError, UnsafeTransferWarning

if TYPE_CHECKING:
    from rich.table import Table

STATUSES = ("ok", "corrupted", "no_peer", "error")  # error: the copy raised
# The first driver that stops GeForce RTX 40 cards from silently corrupting peer-to-peer copies (accelerate's
# check_cuda_p2p_ib_support uses the same version).
FIXED_DRIVER = "550.40.07"
CACHE_ENV = "PIPEMAP_CACHE_DIR"
CACHE_FILE = "transfers.json"

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64)
_SIZES = (8, 4096, (1 << 20) + 4096)  # bytes: a few, one page, just over 1 MiB (large copies take another path)
_STAND_IN = re.compile(r"^cpu:(\d+)$")
_PROC_VERSION = Path("/proc/driver/nvidia/version")

Copy = Callable[[torch.Tensor, str, str], torch.Tensor]
Pair = tuple[str, str]

# Pairs (source, destination) whose direct copies must be staged through CPU memory; filled by stage_unsafe_pairs.
_STAGED: set[Pair] = set()
_WARNED: set[Pair] = set()
_CHECKED: dict[str, TransferReport] = {}  # this process's reports, by TransferKey text


# ---- moving tensors ------------------------------------------------------------------------------------------------


def move_tensor(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``: itself when already there, staged through the CPU for an unsafe GPU pair."""
    if tensor.device == device:
        return tensor
    if _STAGED and (str(tensor.device), str(device)) in _STAGED:
        return _staged_copy(tensor, device)
    return tensor.to(device)


def move(obj, device: torch.device | str):
    """``obj`` with every tensor in it on ``device``: tensors, lists, tuples, dicts, model outputs, and diffusers'
    small result objects (a VAE's ``latent_dist``). Returns ``obj`` itself when nothing had to move.

    accelerate's ``send_to_device`` rebuilds every container on each call and does not reach into diffusers'
    ``DiagonalGaussianDistribution``; hooks run at every denoising step, so this one returns inputs untouched when
    they are already in place.
    """
    return _move(obj, torch.device(device) if isinstance(device, str) else device)


def _move(obj, device: torch.device):
    if isinstance(obj, torch.Tensor):
        return move_tensor(obj, device)
    if isinstance(obj, (list, tuple)):
        items = [_move(x, device) for x in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return type(obj)(*items)
        return type(obj)(items)
    if isinstance(obj, Mapping):
        moved = {k: _move(v, device) for k, v in obj.items()}
        if all(moved[k] is v for k, v in obj.items()):
            return obj
        if dataclasses.is_dataclass(obj):
            return dataclasses.replace(obj, **moved)
        # a Mapping subclass (a model output) rebuilt from a dict, which the Mapping protocol does not promise
        return cast(Any, type(obj))(moved) if type(obj) is not dict else moved
    if _is_result_object(obj):
        return _move_attributes(obj, device)
    return obj


def _is_result_object(obj) -> bool:
    # diffusers' distribution objects (DiagonalGaussianDistribution, IdentityDistribution) hold their tensors as
    # plain attributes and have no .to(); other objects are left alone.
    return type(obj).__module__.startswith("diffusers.") and not isinstance(obj, torch.nn.Module) and hasattr(
        obj, "__dict__")


def _move_attributes(obj, device: torch.device):
    moved = {k: _move(v, device) for k, v in vars(obj).items()}
    if all(moved[k] is v for k, v in vars(obj).items()):
        return obj
    clone = copy.copy(obj)
    vars(clone).update(moved)
    return clone


def _staged_copy(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    # Two plain host<->device DMA copies instead of one peer-to-peer copy: slower, but the path the broken drivers
    # get right. Pinned memory keeps both halves DMA; each copy_ is synchronous, so no stream can read early.
    if tensor.device.type != "cpu" and torch.cuda.is_available():
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor)
    else:
        host = tensor.to("cpu")
    return host.to(device)


# ---- the staging registry --------------------------------------------------------------------------------------------


def stage_pair(source: str | torch.device, destination: str | torch.device) -> None:
    """Route every later move from ``source`` to ``destination`` through CPU memory (that direction only).

    >>> stage_pair("cuda:0", "cuda:1"); staged_pairs()
    frozenset({('cuda:0', 'cuda:1')})
    >>> clear_staged()
    """
    _STAGED.add((endpoint(source), endpoint(destination)))


def unstage_pair(source: str | torch.device, destination: str | torch.device) -> None:
    """Copy directly again from ``source`` to ``destination``."""
    _STAGED.discard((endpoint(source), endpoint(destination)))


def staged_pairs() -> frozenset[Pair]:
    """The ``(source, destination)`` pairs whose moves go through CPU memory."""
    return frozenset(_STAGED)


def clear_staged() -> None:
    """Copy every pair directly again, and warn again the next time a pair is found unsafe."""
    _STAGED.clear()
    _WARNED.clear()


def exchange_line(component: str, devices: list[str]) -> str | None:
    """What dispatch reports (``pipemap.stats``) for a component whose ranks on ``devices`` exchange between a pair
    of devices this process stages (the copy check found direct copies corrupting): they exchange through host
    memory there. Read from what was found, never running the check; a report of the placed pipeline, not part of
    its plan (a plan depends only on its request)."""
    staged = staged_pairs()
    ends = [endpoint(d) for d in devices]
    pairs = sorted({(a, b) for a in ends for b in ends if (a, b) in staged})
    if not pairs:
        return None
    found = ", ".join(f"{a} -> {b}" for a, b in pairs)
    return (f"{component}'s copies on {', '.join(dict.fromkeys(ends))} exchange through host memory, as the copy "
            f"check found direct copies {found} corrupting on this machine (worker processes: NCCL with "
            "peer-to-peer off; threads: each copy staged through pinned memory)")


def endpoint(device: str | int | torch.device) -> str:
    """The canonical name of a transfer endpoint: ``normalize_device``'s, except that ``"cpu:N"`` (N >= 1) stays,
    naming a stand-in endpoint on the real CPU.

    >>> endpoint("cuda"), endpoint("cpu:0"), endpoint("cpu:2")
    ('cuda:0', 'cpu', 'cpu:2')
    """
    match = _STAND_IN.match(str(device).strip().lower())
    if match and int(match.group(1)) > 0:
        return f"cpu:{int(match.group(1))}"
    return normalize_device(device)


# ---- the report ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TransferKey:
    """What a check's result depends on: a driver update, another torch or another set of GPUs re-runs it."""

    driver: str
    torch: str
    devices: tuple[str, ...]
    gpus: tuple[str, ...]

    def __str__(self) -> str:
        return (f"driver {self.driver} | torch {self.torch} | {','.join(self.devices)} | "
                f"{','.join(self.gpus) or 'no GPU'}")


@dataclass(frozen=True)
class TransferReport:
    """The result of ``check_transfers``: a status per ordered pair, ``"ok"``, ``"corrupted"`` (data arrived
    wrong), ``"no_peer"`` (right, through the host) or ``"error"`` (the copy raised).

    ``details`` says what went wrong for a corrupted or failed pair; ``cached`` is True when the result came from an
    earlier run (this process or the disk cache) and ``elapsed`` is then that run's time.

    >>> report = check_transfers(["cpu", "cpu:1"])
    >>> report.pairs
    {('cpu', 'cpu:1'): 'ok', ('cpu:1', 'cpu'): 'ok'}
    """

    pairs: dict[Pair, str]
    devices: tuple[str, ...]
    key: TransferKey
    elapsed: float
    details: dict[Pair, str] = field(default_factory=dict)
    cached: bool = False

    @property
    def corrupted(self) -> tuple[Pair, ...]:
        return tuple(pair for pair, status in self.pairs.items() if status == "corrupted")

    @property
    def no_peer(self) -> tuple[Pair, ...]:
        return tuple(pair for pair, status in self.pairs.items() if status == "no_peer")

    @property
    def errors(self) -> tuple[Pair, ...]:
        return tuple(pair for pair, status in self.pairs.items() if status == "error")

    @property
    def ok(self) -> bool:
        """True when no pair is corrupted or failed (``no_peer`` pairs copy correctly, through the host)."""
        return not self.corrupted and not self.errors

    def table(self) -> Table:
        """The matrix as a rich table: one row per source, one column per destination."""
        from rich.table import Table  # here: rich is for printing; dispatch moves tensors with this module

        table = Table(title="copies between devices")
        table.add_column("from \\ to")
        for name in self.devices:
            table.add_column(name)
        for source in self.devices:
            table.add_row(source, *(self.pairs.get((source, d), "-") for d in self.devices))
        return table

    def __str__(self) -> str:
        from rich.console import Console

        buffer = io.StringIO()
        Console(file=buffer, width=120, color_system=None, force_terminal=False).print(self.table())
        lines = [f"{s} -> {d}: {why}" for (s, d), why in self.details.items()]
        return "\n".join([buffer.getvalue().rstrip(), *lines])

    def to_dict(self) -> dict:
        return {
            "key": dataclasses.asdict(self.key),
            "devices": list(self.devices),
            "elapsed": self.elapsed,
            "pairs": [{"source": s, "destination": d, "status": status, "detail": self.details.get((s, d), "")}
                      for (s, d), status in self.pairs.items()],
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> TransferReport:
        key = data["key"]
        pairs = {(p["source"], p["destination"]): p["status"] for p in data["pairs"]}
        details = {(p["source"], p["destination"]): p["detail"] for p in data["pairs"] if p.get("detail")}
        return cls(pairs, tuple(data["devices"]), TransferKey(key["driver"], key["torch"], tuple(key["devices"]),
                                                               tuple(key["gpus"])), float(data["elapsed"]), details)


# ---- the check -----------------------------------------------------------------------------------------------------


def check_transfers(devices: Iterable[str | int | torch.device] | None = None, copy: Copy | None = None, *,
                    refresh: bool = False) -> TransferReport:
    """Copy known patterns along every ordered pair of ``devices`` (default: every CUDA GPU) and compare what
    arrived: fp32, fp16, bf16 and int64; from 8 bytes to just over 1 MiB; contiguous and strided.

    The result is cached for the process and on disk (``$PIPEMAP_CACHE_DIR`` or ``$HF_HOME/pipemap``), keyed by the
    driver version, torch version and GPU set, so a driver update runs it again; ``refresh=True`` always runs it.
    ``copy(tensor, source, destination)`` replaces the direct copy, to test with a faulty one: its result says
    nothing about this machine, so it is neither read from nor written to any cache. The check only reports;
    ``ensure_safe_transfers`` also stages the corrupted and failed pairs.

    >>> report = pipemap.check_transfers()                       # doctest: +SKIP
    >>> report.corrupted                                          # doctest: +SKIP
    (('cuda:0', 'cuda:1'), ('cuda:1', 'cuda:0'))
    >>> print(report)                                             # doctest: +SKIP
    """
    endpoints = _endpoints(devices)
    key = transfer_key(endpoints)
    if copy is not None:
        return _run_check(endpoints, key, copy)
    cached = None if refresh else _cached(key)
    if cached is not None:
        return cached
    report = _run_check(endpoints, key, _direct_copy)
    _store(report)
    return report


def ensure_safe_transfers(devices: Iterable[str | int | torch.device], copy: Copy | None = None
                          ) -> TransferReport | None:
    """Check (cached) the pairs among ``devices`` and stage each corrupted one, warning once per pair.

    The plain CPU and stand-in devices (``meta:N``) are left out: copies to and from host memory are not
    peer-to-peer. Returns None when fewer than two devices remain. ``dispatch`` calls this when a plan spans two
    GPUs or more.

    >>> plan = pipemap.plan("path/to/flux", hardware=pipemap.Hardware.detect())     # doctest: +SKIP
    >>> ensure_safe_transfers(p.device for p in plan.components)                    # doctest: +SKIP
    """
    names = dict.fromkeys(endpoint(d) for d in devices)
    chosen = [d for d in names if d != "cpu" and not d.startswith("meta")]
    if len(chosen) < 2:
        return None
    report = check_transfers(chosen, copy)
    stage_unsafe_pairs(report)
    return report


def stage_unsafe_pairs(report: TransferReport) -> tuple[Pair, ...]:
    """Stage every corrupted or failed pair of ``report`` (that pair only, that direction only); warn once per
    pair."""
    unsafe = report.corrupted + report.errors
    for pair in unsafe:
        _STAGED.add(pair)
        if pair not in _WARNED:
            _WARNED.add(pair)
            advice = unsafe_advice(pair, report.key)
            if pair in report.errors:
                advice = f"{advice}. The copy raised: {report.details.get(pair, '')}"
            warnings.warn(advice, UnsafeTransferWarning, stacklevel=3)
    return unsafe


def unsafe_advice(pair: Pair, key: TransferKey) -> str:
    """What the user reads about a corrupted pair: what pipemap does about it and how to fix it."""
    source, destination = pair
    return (f"direct copies from {source} to {destination} arrive corrupted (NVIDIA driver {key.driver}, GPUs: "
            f"{', '.join(key.gpus) or 'none'}); pipemap stages them through pinned CPU memory, which is slower. "
            f"Update the NVIDIA driver to {FIXED_DRIVER} or newer (it fixes peer-to-peer copies on GeForce RTX 40 "
            "cards); pipemap checks again after a driver update. Run `pipemap doctor` to see every pair")


def transfer_key(devices: Iterable[str]) -> TransferKey:
    """The cache key for a check of ``devices``: driver version, torch version, device names, and each GPU's name
    with its UUID and PCI bus id (in device order), so another physical pair of same-named GPUs is checked again."""
    names = tuple(sorted(devices))
    gpus = tuple(gpu_identity(d) for d in names if d.startswith("cuda"))
    return TransferKey(driver_version(), torch.__version__, names, gpus)


def gpu_identity(device: str) -> str:
    """``"NVIDIA GeForce RTX 4090 GPU-8f3c... pci 0000:41:00"``: the GPU's name, UUID and PCI bus id."""
    props = torch.cuda.get_device_properties(torch.device(device))
    uuid = getattr(props, "uuid", "")
    bus = (f"pci {getattr(props, 'pci_domain_id', 0):04x}:{getattr(props, 'pci_bus_id', 0):02x}:"
           f"{getattr(props, 'pci_device_id', 0):02x}")
    return f"{props.name} {uuid} {bus}".replace("  ", " ")


def plan_devices(plan) -> list[str]:
    """Every device ``plan`` copies between: the pipeline's execution device, each component's home and execution
    device, the GPUs its split shards live on and those its copies live on (replicas, guidance and sequence copies:
    weights, inputs and outputs are copied straight between the home GPU and each copy's).

    >>> plan = pipemap.plan("path/to/wan", hardware="2x16GiB", strategy="auto")        # doctest: +SKIP
    >>> plan_devices(plan)                                                            # doctest: +SKIP
    ['cuda:0', 'cpu', 'cuda:1']
    """
    found = [plan.execution_device]
    for p in plan.components:
        found += [p.device, p.execution_device, *(device for _, device, _ in p.shards), *p.replicas]
    return list(dict.fromkeys(found))


def synchronize(devices: Iterable[str]) -> None:
    """The host waits for every copy queued on these GPUs: weights a load or a dispatch placed are then ready for
    any stream (a caller's own ``torch.cuda.stream`` included), not only for the stream that copied them."""
    for device in dict.fromkeys(devices):
        if device.startswith("cuda") and torch.cuda.is_available():
            torch.cuda.synchronize(device)


def _endpoints(devices) -> list[str]:
    if devices is None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [f"cuda:{i}" for i in range(count)]
    names = list(dict.fromkeys(endpoint(d) for d in devices))
    for name in names:
        if not _usable(name):
            raise UnknownDeviceError(name, tuple(_endpoints(None)) + ("cpu",))  # cpu:N stand-ins are for tests only
    return names


def _usable(name: str) -> bool:
    if name.startswith("cuda"):
        return torch.cuda.is_available() and torch.device(name).index < torch.cuda.device_count()
    return name.startswith("cpu")


def _actual(name: str) -> torch.device:
    return torch.device("cpu") if name.startswith("cpu") else torch.device(name)


def _direct_copy(tensor: torch.Tensor, source: str, destination: str) -> torch.Tensor:
    return tensor.to(_actual(destination))


def _run_check(endpoints: list[str], key: TransferKey, copy: Copy) -> TransferReport:
    start = time.perf_counter()
    patterns = [(dtype, size, strided) for dtype in _DTYPES for size in _SIZES for strided in (False, True)]
    made = {name: [_pattern(*p, _actual(name)) for p in patterns] for name in endpoints}
    labels = [f"{str(d).removeprefix('torch.')} {n} bytes{' strided' if s else ''}" for d, n, s in patterns]
    pairs, details = {}, {}
    for source in endpoints:
        for destination in endpoints:
            if source != destination:
                status, why = _check_pair(source, destination, copy, made, labels)
                pairs[(source, destination)] = status
                if why:
                    details[(source, destination)] = why
    return TransferReport(pairs, tuple(endpoints), key, time.perf_counter() - start, details)


def _pattern(dtype: torch.dtype, nbytes: int, strided: bool, device: torch.device) -> torch.Tensor:
    numel = max(1, nbytes // dtype.itemsize)
    values = torch.arange(numel * (2 if strided else 1), device=device, dtype=torch.int64)
    if dtype == torch.int64:
        data = values * 1_000_003 - (1 << 40)  # every byte of the word varies, the sign bit included
    else:
        data = (values % 251 - 125).to(dtype)  # small integers: exact in fp16 and bf16, mostly non-zero
    return data[::2] if strided else data


def _check_pair(source: str, destination: str, copy: Copy, made: dict, labels: list[str]) -> tuple[str, str]:
    try:
        arrived = [copy(tensor, source, destination) for tensor in made[source]]
        same = torch.stack([_same(a, e) for a, e in zip(arrived, made[destination])]).tolist()  # one sync
    except Exception as err:  # a copy that fails outright: as unusable as a corrupting one, but not the same fault
        return "error", f"the copy raised {type(err).__name__}: {err}"
    wrong = [label for label, ok in zip(labels, same) if not ok]
    if wrong:
        return "corrupted", f"{len(wrong)} of {len(labels)} patterns arrived wrong, first {wrong[0]}"
    return ("ok" if _has_peer(source, destination) else "no_peer"), ""


def _same(arrived: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    if arrived.shape != expected.shape or arrived.dtype != expected.dtype or arrived.device != expected.device:
        return torch.tensor(False, device=expected.device)
    return (arrived == expected).all()


def _has_peer(source: str, destination: str) -> bool:
    if not (source.startswith("cuda") and destination.startswith("cuda")):
        return True  # host memory is no peer: copies to and from it are plain DMA
    return torch.cuda.can_device_access_peer(torch.device(source).index, torch.device(destination).index)


# ---- driver version ------------------------------------------------------------------------------------------------


def driver_version() -> str:
    """The NVIDIA driver version (``"550.54.14"``), without nvidia-smi; ``"none"`` on a machine without one.

    Read from ``/proc/driver/nvidia/version`` (Linux), else NVML when installed, else the CUDA driver API version
    torch reports (``"CUDA 12.4 driver API"``), else ``"unknown"``.
    """
    version = _proc_driver_version()
    if version:
        return version
    if not torch.cuda.is_available():
        return "none"
    return _nvml_driver_version() or _cuda_driver_api_version() or "unknown"


def parse_proc_version(text: str) -> str | None:
    """The driver version in the text of ``/proc/driver/nvidia/version``, or None."""
    match = re.search(r"Kernel Module\b.*?\s(\d+\.\d+(?:\.\d+)?)\s", text)
    return match.group(1) if match else None


def _proc_driver_version() -> str | None:
    try:
        return parse_proc_version(_PROC_VERSION.read_text())
    except OSError:
        return None


def _nvml_driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
    except Exception:  # not installed, or no NVML library: fall through to the next source
        return None
    return version.decode() if isinstance(version, bytes) else str(version)


def _cuda_driver_api_version() -> str | None:
    get = getattr(torch._C, "_cuda_getDriverVersion", None)
    try:
        number = int(get()) if get else 0
    except Exception:
        return None
    return f"CUDA {number // 1000}.{number % 1000 // 10} driver API" if number else None


# ---- the cache -----------------------------------------------------------------------------------------------------


def cache_path() -> Path:
    """Where check results are kept: ``$PIPEMAP_CACHE_DIR/transfers.json``, else under huggingface_hub's home."""
    root = os.environ.get(CACHE_ENV)
    if not root:
        from huggingface_hub import constants

        root = os.path.join(constants.HF_HOME, "pipemap")
    return Path(root) / CACHE_FILE


def clear_transfer_cache(disk: bool = False) -> None:
    """Forget this process's check results (and the disk cache too with ``disk=True``)."""
    _CHECKED.clear()
    if disk:
        cache_path().unlink(missing_ok=True)


def _cached(key: TransferKey) -> TransferReport | None:
    text = str(key)
    if text in _CHECKED:
        return _CHECKED[text]
    entry = _read_cache().get(text)
    try:
        report = dataclasses.replace(TransferReport.from_dict(entry), cached=True) if entry else None
    except (KeyError, TypeError, ValueError):  # an entry from another pipemap version: check again
        return None
    if report is not None and report.key == key:
        _CHECKED[text] = report
        return report
    return None


def _read_cache() -> dict:
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _store(report: TransferReport) -> None:
    text = str(report.key)
    _CHECKED[text] = dataclasses.replace(report, cached=True)
    data = _read_cache()
    data[text] = report.to_dict()
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(data, indent=1))
        os.replace(temporary, path)  # atomic: two processes never leave half a file
    except OSError:
        pass  # a read-only cache costs one more check in the next process, nothing else
