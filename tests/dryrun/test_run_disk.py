"""The dry run of a plan with a disk tier: host copies left in their files are counted on the disk, not the CPU, and
the CPU's peak stays within the plan's RAM figure (weights in RAM and the staging buffers)."""

from __future__ import annotations

import pytest

import pipemap


@pytest.mark.slow
def test_the_dry_run_counts_the_disk_apart(tiny_folders):
    folder = tiny_folders["sd"]
    total = sum(c.bytes for c in pipemap.inspect(folder).models)
    plan = pipemap.plan(folder, hardware=f"cuda:0={total // 3},cpu={total // 3}", strategy="balanced_ultra_low_memory")
    assert plan.host.disk and plan.host.kept
    report = pipemap.simulate(folder, plan, steps=1)
    assert report.ok, report.error
    cpu = next(d for d in plan.devices if d.device == "cpu")
    # the plan counts each tensor as it sits in a packed buffer (aligned to 16 bytes), and the root's few loose
    # tensors go with the files when their component's pieces do: within 1%
    assert report.disk_bytes == pytest.approx(plan.host.disk + plan.host.kept, rel=0.01)
    assert report.weight_bytes["cpu"] <= sum(p.ram_bytes for p in plan.components)
    assert report.weight_peak_bytes["cpu"] <= cpu.used  # RAM copies and the staging ring, within the plan's figure
    assert "disk" not in report.peak_bytes and "left in the files" in str(report)
    assert all(s.device != "disk" for s in report.timeline)


@pytest.mark.slow
def test_flux_on_8gib_and_16gib_of_ram_runs_from_the_disk():
    # the desktop: the plan that used to hold 31.42 GiB in 16 GiB of RAM now fits it, the rest on the disk
    plan = pipemap.plan("flux.1-dev", hardware="1x8GiB,cpu=16GiB", strategy="auto")
    cpu = next(d for d in plan.devices if d.device == "cpu")
    assert cpu.used <= cpu.budget and plan.host.disk > 8 * 2**30
    report = pipemap.simulate("flux.1-dev", plan, steps=1, height=256, width=256)
    assert report.ok, report.error
    assert report.weight_peak_bytes["cpu"] <= cpu.used and report.disk_bytes > 8 * 2**30
