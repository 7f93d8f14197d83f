"""``ram``: the RAM a plan may use follows a container's cgroup limit (v2 and v1, fake cgroup files in a tmp folder),
a ``cpu=`` spec still wins; and the maps of safetensors files are found where diffusers' loading leaves weights."""

from __future__ import annotations

import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

import pipemap
from pipemap import ram
from pipemap.hardware import Hardware

GIB = 2**30


def _v2(root, limit: str, current: int, inactive: int = 0):
    root.mkdir(parents=True, exist_ok=True)
    (root / "memory.max").write_text(f"{limit}\n")
    (root / "memory.current").write_text(f"{current}\n")
    (root / "memory.stat").write_text(f"anon {current}\ninactive_file {inactive}\nactive_file 0\n")
    return root


def _v1(root, limit: int, usage: int, inactive: int = 0):
    folder = root / "memory"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (folder / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (folder / "memory.stat").write_text(f"cache {inactive}\ntotal_inactive_file {inactive}\n")
    return root


def test_a_cgroup_v2_limit_sets_the_budget(tmp_path, monkeypatch):
    # 4 GiB limit, 1.5 GiB in use of which 0.5 GiB is inactive page cache: 3 GiB free less the page-cache reserve
    root = _v2(tmp_path / "v2", str(4 * GIB), 3 * GIB // 2, GIB // 2)
    found = ram.ram(root)
    assert (found.limit, found.used) == (4 * GIB, GIB)
    assert found.figure == 3 * GIB - ram.PAGE_CACHE_RESERVE
    monkeypatch.setenv(ram.ROOT_VARIABLE, str(root))
    hw = Hardware.detect()
    assert hw.memory("cpu") == 3 * GIB - ram.PAGE_CACHE_RESERVE
    assert Hardware.parse("1x8GiB").memory("cpu") == 3 * GIB - ram.PAGE_CACHE_RESERVE  # no cpu=: this machine's
    assert Hardware.parse("1x8GiB,cpu=16GiB").memory("cpu") == 16 * GIB  # a spec still wins
    # the budget follows the limit: a plan for this machine refuses what it would have noted
    inventory = pipemap.Inventory("test", "TestPipeline", (pipemap.Component("unet", "diffusers", "M", 4 * GIB, True),))
    with pytest.raises(pipemap.HostMemoryError) as info:
        pipemap.plan(inventory, hardware=Hardware.parse("1x8GiB"), strategy={"unet": "cpu"})
    free = 3 * GIB - ram.PAGE_CACHE_RESERVE  # less the CPU's default headroom (10% of a CPU of 2 GiB or more)
    assert info.value.largest_room == free - int(free * 0.10)


def test_no_limit_leaves_the_available_ram(tmp_path):
    root = _v2(tmp_path, "max", GIB)
    found = ram.ram(root)
    assert found.limit is None and found.figure == found.available
    assert abs(found.available - psutil.virtual_memory().available) < GIB


def test_cgroup_v1_and_its_unlimited_value(tmp_path):
    assert ram.ram(_v1(tmp_path / "a", 2 * GIB, GIB)).figure == GIB - ram.PAGE_CACHE_RESERVE
    assert ram.ram(_v1(tmp_path / "b", 9223372036854771712, GIB)).limit is None


def test_the_tightest_level_on_the_path_wins(tmp_path):
    _v2(tmp_path, str(8 * GIB), GIB)
    _v2(tmp_path / "job" / "step", str(2 * GIB), GIB // 2)
    assert ram.cgroup_memory(tmp_path, {"v2": "/job/step"}) == (2 * GIB, GIB // 2)
    assert ram.cgroup_memory(tmp_path, {"v2": "/job/other"}) == (8 * GIB, GIB)  # a missing folder: its parent's
    assert ram.cgroup_memory(tmp_path / "none", {}) is None


def test_a_limit_below_what_is_used_leaves_nothing(tmp_path):
    assert ram.ram(_v2(tmp_path, str(GIB), 2 * GIB)).figure == 0


def test_file_maps_find_what_safetensors_maps(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.randn(256, 256), "b": torch.arange(10)}, path)
    loaded = load_file(path)
    maps = ram.file_maps()
    a = loaded["a"]
    assert maps.file_of(a.data_ptr(), a.numel() * a.element_size()) == str(path)
    assert maps.file_of(torch.randn(256, 256).data_ptr(), 4) is None  # private memory is no map
    assert ram.address(a) == a.data_ptr()
