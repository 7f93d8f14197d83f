"""``tiers``: which host copies live in RAM and which stay in their files (the disk tier), within the CPU's budget.
Placements built by hand with integer byte sizes, whole placements compared; then plans of tiny folders."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import replace

import pytest
import torch

import pipemap
from pipemap import HostMemoryError, Placement, Plan
from pipemap.cost import disk_seconds, page_cached, seconds_per_image
from pipemap.hardware import Performance
from pipemap.inventory import Component
from pipemap.tiers import STAGING_CHUNK, place_tiers, staging_bytes

FILES = ("unet/diffusion_pytorch_model.safetensors",)
SVG = "{http://www.w3.org/2000/svg}"


def _components(mapped: bool = True) -> dict[str, Component]:
    files = {"text_encoder": ("text_encoder/model.safetensors",), "unet": FILES, "vae": ()} if mapped else {}
    return {name: Component(name, "diffusers", "M", size, True, files=files.get(name, ()))
            for name, size in (("text_encoder", 30), ("unet", 60), ("vae", 20))}


# text_encoder 30 offloaded to cuda:0 (once a prompt), unet 60 streamed as a/b/c of 20 with a resident, vae 20 on
# cuda:0
PLACED = (Placement("text_encoder", "cpu", 30, "offload", "cuda:0", room=30),
          Placement("unet", "cpu", 60, "stream", "cuda:0", room=40, blocks=(("a", 20), ("b", 20), ("c", 20)),
                    resident_blocks=("a",), resident_bytes=20, prefetch=1),
          Placement("vae", "cuda:0", 20))


def test_once_a_prompt_from_the_map_every_step_in_ram():
    # RAM 100: the text encoder (once a prompt) stays in its file, staging 2 x 30; the unet's streamed pieces b and
    # c (40) in RAM; its resident piece a keeps no copy (a reset reads it back from the file)
    placed, staging = place_tiers(PLACED, _components(), 100, "test")
    assert staging == 60 == staging_bytes(30)
    assert placed == (replace(PLACED[0], disk_bytes=30, files=("text_encoder/model.safetensors",)),
                      replace(PLACED[1], files=FILES), PLACED[2])
    assert [p.ram_bytes for p in placed] == [0, 40, 0]
    assert [p.pinned_bytes for p in placed] == [0, 40, 0]


def test_what_ram_cannot_hold_spills_to_the_files():
    # RAM 90: staging 60, room 30: piece b (20) in RAM, c spills to the disk
    placed, staging = place_tiers(PLACED, _components(), 90, "test")
    assert staging == 60
    assert placed[1] == replace(PLACED[1], disk_blocks=("c",), disk_bytes=20, files=FILES)
    assert placed[1].ram_bytes == 20


def test_without_files_everything_is_ram_and_a_short_budget_is_refused():
    # no files: the text encoder 30, the unet's pieces 40 and its resident piece 20 (for a reset) all in RAM: 90
    placed, staging = place_tiers(PLACED, _components(mapped=False), 90, "test")
    assert (staging, placed) == (0, PLACED)
    assert sum(p.ram_bytes for p in placed) == 90
    with pytest.raises(HostMemoryError) as info:
        place_tiers(PLACED, _components(mapped=False), 89, "test")
    err = info.value
    assert (err.component, err.bytes, err.largest_room, err.device, err.strategy) == ("unet", 90, 89, "cpu", "test")
    assert isinstance(err, pipemap.DoesNotFitError) and isinstance(err, ValueError)
    assert "stored at another dtype" in str(err) and "cpu=" in str(err)


def test_staging_is_capped_by_its_chunk():
    assert staging_bytes(10 * STAGING_CHUNK) == 2 * STAGING_CHUNK


def test_plan_value_round_trips_and_prints_the_tiers():
    placed, staging = place_tiers(PLACED, _components(), 90, "test")
    plan = Plan("test", placed, (pipemap.DeviceUse("cuda:0", 100, 100, 80), pipemap.DeviceUse("cpu", 100, 90, 80)),
                "cuda:0", staging=staging)
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.remap({"cuda:0": "cpu"}).placement("unet").disk_blocks == ("c",)
    host = plan.host
    assert (host.streamed, host.offloaded, host.staging, host.pinned, host.disk, host.kept, host.headroom) == (
        20, 0, 60, 80, 50, 20, 10)
    text = str(plan)
    assert "[disk]" in text and "1 on disk (20 B)" in text and "from disk (30 B)" in text and "60 B staging" in text


def test_cost_reads_the_disk_at_its_speed_or_the_page_cache():
    placed, _ = place_tiers(PLACED, _components(), 90, "test")
    component = _components()["unet"]
    perf = Performance(disk_bandwidth=1e9)
    work = pipemap.cost.Workload(steps=10, guidance=False)
    assert disk_seconds(placed[1], component, perf, work) == pytest.approx(10 * 20 / 1e9)
    assert disk_seconds(placed[0], _components()["text_encoder"], perf, work) == pytest.approx(30 / 1e9)
    assert disk_seconds(placed[2], _components()["vae"], perf, work) == 0
    tight = Plan("t", placed, (pipemap.DeviceUse("cpu", 100, 90, 80),), "cuda:0")
    roomy = Plan("t", placed, (pipemap.DeviceUse("cpu", 1000, 1000, 80),), "cuda:0")
    assert not page_cached(tight) and page_cached(roomy)


# ---- plans of folders ---------------------------------------------------------------------------------------------


def test_a_folder_at_its_stored_dtype_plans_a_disk_tier(tiny_folders):
    # sdxl saved in fp32 and planned in fp32: its files can stay mapped; one small GPU, RAM a third of the weights
    folder = tiny_folders["sdxl"]
    inventory = pipemap.inspect(folder)
    assert all(c.files for c in inventory.models)
    total = sum(c.bytes for c in inventory.models)
    plan = pipemap.plan(folder, hardware=f"cuda:0={total // 3},cpu={total // 3}", strategy="balanced_ultra_low_memory")
    cpu = plan.devices[-1]
    assert cpu.used <= cpu.budget and plan.host.disk > 0
    assert all(p.files for p in plan.components if p.device == "cpu")
    assert sum(p.ram_bytes for p in plan.components) + plan.staging == cpu.used
    assert Plan.from_json(plan.to_json()) == plan
    # planned in fp16, every tensor is converted while loading: nothing can stay in the files, so RAM must hold all
    assert not any(c.files for c in pipemap.inspect(folder, dtype=torch.float16).models)
    with pytest.raises(HostMemoryError):
        pipemap.plan(folder, hardware=f"cuda:0={total // 6},cpu={total // 10}", strategy="balanced_ultra_low_memory",
                     dtype=torch.float16)


def test_seconds_count_the_disk(tiny_folders):
    folder = tiny_folders["sd"]
    inventory = pipemap.inspect(folder)
    total = sum(c.bytes for c in inventory.models)
    hardware = f"cuda:0={total // 3},cpu={total // 4}"
    plan = pipemap.plan(folder, hardware=hardware + ",disk_bw=1GB", strategy="balanced_ultra_low_memory")
    slow = pipemap.Hardware.parse(hardware + ",disk_bw=1MB").performance
    assert plan.host.disk and seconds_per_image(plan, inventory, slow) > seconds_per_image(
        plan, inventory, pipemap.Hardware.parse(hardware + ",disk_bw=1GB").performance)


def test_the_picture_draws_the_disk_tier(tiny_folders):
    folder = tiny_folders["sdxl"]
    total = sum(c.bytes for c in pipemap.inspect(folder).models)
    plan = pipemap.plan(folder, hardware=f"cuda:0={total // 3},cpu={total // 3}", strategy="balanced_ultra_low_memory")
    svg = ET.fromstring(plan.picture().svg())
    [disk] = [g for g in svg.iter(f"{SVG}g") if g.get("class") == "disk"]
    segments = {s.get("data-label"): int(s.get("data-bytes")) for s in disk.iter(f"{SVG}g")
                if s.get("class") == "segment"}
    # bytes counted once: what is read from the files at each call; the pieces kept on a GPU are drawn there
    assert sum(segments.values()) == plan.host.disk
    assert segments == {p.component: p.disk_bytes for p in plan.components if p.disk_bytes}
    [cpu] = [g for g in svg.iter(f"{SVG}g") if g.get("class") == "device" and g.get("data-device") == "cpu"]
    cpu_segments = {s.get("data-label"): int(s.get("data-bytes")) for s in cpu.iter(f"{SVG}g")
                    if s.get("class") == "segment"}
    assert cpu_segments.pop("staging (pinned, for reads from the disk)") == plan.staging
    assert cpu_segments == {p.component: p.ram_bytes for p in plan.components if p.ram_bytes}
    assert "disk" in plan.picture().text()
