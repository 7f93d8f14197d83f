"""RAM: how much of it this process may really use, and which of its memory is a file's memory map.

In a container "available RAM" is the host's: the cgroup's limit is what the kernel enforces, so a plan made against
the host's figure is killed for memory. ``ram_figure`` takes the smaller of the two: the machine's available RAM, and
the tightest cgroup limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``) of the cgroups this process is in, less
what the cgroup already uses (its reclaimable page cache excepted) and a reserve for the page cache that reading
weights from their files needs. ``PIPEMAP_CGROUP_ROOT`` points it at another folder (tests: fake cgroup files).

``file_maps`` lists this process's memory maps of safetensors files: diffusers and transformers load weights stored
at the dtype asked for as views of such a map (safetensors maps each file privately, ``MAP_PRIVATE``), so they cost
page cache, not private memory, until something copies them.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from torch._subclasses.fake_tensor import FakeTensor

CGROUP_ROOT = "/sys/fs/cgroup"
ROOT_VARIABLE = "PIPEMAP_CGROUP_ROOT"
# kept out of a cgroup's room: the page cache that reading weights from their files needs (read-ahead, the pieces in
# flight), which the kernel charges to the cgroup
PAGE_CACHE_RESERVE = 256 * 2**20
_UNLIMITED = 2**62  # cgroup v1 writes "no limit" as the largest page-aligned int64


@dataclass(frozen=True)
class Ram:
    """The machine's available RAM and, in a memory cgroup, its limit and what it uses beside reclaimable cache."""

    available: int
    limit: int | None = None
    used: int = 0

    @property
    def figure(self) -> int:
        """What a plan may use: the available RAM, or less where the cgroup's limit leaves less."""
        if self.limit is None:
            return self.available
        return max(0, min(self.available, self.limit - self.used - PAGE_CACHE_RESERVE))


def ram(root: str | os.PathLike[str] | None = None) -> Ram:
    """This process's RAM: ``psutil``'s available figure and its tightest memory cgroup (``root``: where the cgroup
    files are; default ``$PIPEMAP_CGROUP_ROOT`` or ``/sys/fs/cgroup``).

    >>> ram().figure > 0
    True
    """
    base = Path(root or os.environ.get(ROOT_VARIABLE) or CGROUP_ROOT)
    found = cgroup_memory(base, _own_paths())
    available = int(psutil.virtual_memory().available)
    return Ram(available) if found is None else Ram(available, *found)


def ram_figure() -> int:
    """``ram().figure``: the RAM a plan for this machine may use."""
    return ram().figure


def cgroup_memory(root: Path, own: dict[str, str]) -> tuple[int, int] | None:
    """``(limit, used)`` of the tightest memory cgroup on the path from this process's cgroup up to ``root``, v2 or
    v1 (``own``: the paths ``/proc/self/cgroup`` gives, keyed ``"v2"`` and ``"v1"``); None when none sets a limit.
    ``used`` leaves out the inactive page cache, which the kernel reclaims before it kills."""
    tightest = None
    for folder, v2 in [*((d, True) for d in _levels(root, own.get("v2", "/"))),
                       *((d, False) for d in _levels(root / "memory", own.get("v1", "/")))]:
        found = _read_level(folder, v2)
        if found is not None and (tightest is None or found[0] < tightest[0]):
            tightest = found
    return tightest


def _levels(base: Path, path: str) -> list[Path]:
    """``base`` joined with ``path`` and each of its ancestors, the deepest first (those that exist)."""
    parts = [p for p in path.strip("/").split("/") if p]
    levels = [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
    return [level for level in levels if level.is_dir()]


def _read_level(folder: Path, v2: bool) -> tuple[int, int] | None:
    limit_file, usage_file, inactive = (("memory.max", "memory.current", "inactive_file") if v2 else
                                        ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
    limit = _number(folder / limit_file)
    if limit is None or limit >= _UNLIMITED:
        return None
    usage = _number(folder / usage_file) or 0
    return limit, max(0, usage - _stat(folder / "memory.stat", inactive))


def _number(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def _own_paths() -> dict[str, str]:
    """This process's cgroup paths from ``/proc/self/cgroup``: the v2 one (``0::path``) and v1's memory one."""
    paths: dict[str, str] = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return paths
    for line in lines:
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if number == "0" and controllers == "":
            paths["v2"] = path
        elif "memory" in controllers.split(","):
            paths["v1"] = path
    return paths


# ---- memory maps of weight files ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FileMaps:
    """This process's memory maps of safetensors files: address ranges ``[start, end)``, sorted, and their files."""

    starts: tuple[int, ...]
    ends: tuple[int, ...]
    paths: tuple[str, ...]

    def file_of(self, address: int, nbytes: int) -> str | None:
        """The file whose map holds ``nbytes`` from ``address``, or None when no one map holds them all."""
        at = bisect.bisect_right(self.starts, address) - 1
        return self.paths[at] if at >= 0 and address + nbytes <= self.ends[at] else None


def file_maps() -> FileMaps:
    """The maps ``/proc/self/maps`` lists for ``*.safetensors`` files (none where there is no ``/proc``)."""
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip().endswith(".safetensors"):
                    start, _, end = fields[0].partition("-")
                    ranges.append((int(start, 16), int(end, 16), fields[5].rstrip()))
    except OSError:
        pass
    ranges.sort()
    return FileMaps(*(tuple(r[i] for r in ranges) for i in range(3)))  # type: ignore[arg-type]


def address(tensor: torch.Tensor) -> int:
    """Where a tensor's bytes start in this process's memory; 0 for a fake tensor (a dry run's), which has none."""
    if isinstance(tensor, FakeTensor) or tensor.device.type != "cpu":
        return 0
    return tensor.data_ptr()
