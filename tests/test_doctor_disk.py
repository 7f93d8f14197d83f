"""``pipemap doctor`` measures the disk weights left in their files are read from, and plans for this machine price
the disk tier with that figure unless a spec's ``disk_bw=`` says otherwise."""

from __future__ import annotations

import json

import pytest

from pipemap import doctor
from pipemap.errors import HardwareSpecError
from pipemap.hardware import Hardware, Performance, disk_cache_path


def test_the_measured_disk_speed_becomes_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPEMAP_CACHE_DIR", str(tmp_path))
    assert Hardware.parse("1x8GiB").performance.disk_bandwidth == Performance.disk_bandwidth  # none measured yet
    bandwidth = doctor.measure_disk_bandwidth(4 * 2**20)
    assert bandwidth > 0 and not list(tmp_path.glob("disk-probe*"))  # the probe file is gone
    assert json.loads(disk_cache_path().read_text())["disk_bw"] == bandwidth
    assert Hardware.parse("1x8GiB").performance.disk_bandwidth == bandwidth
    assert Hardware.parse("1x8GiB,gpu=4090").performance.disk_bandwidth == bandwidth
    assert Hardware.parse("1x8GiB,disk_bw=3GB").performance.disk_bandwidth == 3e9  # a spec wins
    assert "reads" in doctor._disk_section() and "from the cache" in doctor._disk_section()


def test_a_bad_disk_figure_is_refused():
    with pytest.raises(HardwareSpecError) as info:
        Hardware.parse("1x8GiB,disk_bw=fast")
    assert info.value.part == "disk_bw=fast"
