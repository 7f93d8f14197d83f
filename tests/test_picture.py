"""The plan picture: the SVG's numbers parsed back equal the plan's; terminal and notebook forms."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

import pipemap
from helpers import pipemap_cli
from pipemap import picture
from pipemap.cost import bytes_moved
from pipemap.planner import forcing_hardware

SVG = "{http://www.w3.org/2000/svg}"
STRATEGIES = ("balanced", "balanced_low_memory", "balanced_ultra_low_memory", "balanced_split")


def _plan(folder: str, strategy: str) -> pipemap.Plan:
    inventory = pipemap.inspect(folder)
    gpus = 2 if strategy in ("balanced", "balanced_split") else 1
    hardware = forcing_hardware(inventory, strategy, gpus=gpus) if strategy != "balanced" else "2x1GiB,cpu=4GiB"
    return pipemap.plan(inventory, hardware=hardware, strategy=strategy, headroom=0.0)


def _groups(svg: str, cls: str) -> list[ET.Element]:
    root = ET.fromstring(svg)
    return [g for g in root.iter(f"{SVG}g") if g.get("class") == cls]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_svg_segments_add_up_to_each_devices_use(tiny_folders, strategy):
    plan = _plan(tiny_folders["sdxl"], strategy)
    svg = plan.picture().svg()
    devices = {g.get("data-device"): g for g in _groups(svg, "device")}
    assert set(devices) == {d.device for d in plan.devices}
    for use in plan.devices:
        group = devices[use.device]
        segments = [int(s.get("data-bytes")) for s in group.iter(f"{SVG}g") if s.get("class") == "segment"]
        assert sum(segments) == use.used == int(group.get("data-used"))
        budget = next(e for e in group.iter(f"{SVG}line") if e.get("class") == "budget")
        assert int(budget.get("data-bytes")) == use.budget


def test_budget_line_sits_at_the_budget(tiny_folders):
    plan = _plan(tiny_folders["sd"], "balanced")
    for group in _groups(plan.picture().svg(), "device"):
        frame = next(group.iter(f"{SVG}rect"))
        x0, width = float(frame.get("x")), float(frame.get("width"))
        line = next(e for e in group.iter(f"{SVG}line") if e.get("class") == "budget")
        expected = x0 + width * int(group.get("data-budget")) / int(group.get("data-memory"))
        assert float(line.get("x1")) == pytest.approx(expected, abs=0.01)


def test_offloaded_components_show_on_their_execution_gpu_and_their_links(tiny_folders):
    plan = _plan(tiny_folders["sdxl"], "balanced_low_memory")
    offloaded = [p.component for p in plan.components if p.mode == "offload"]
    assert offloaded
    moved = bytes_moved(plan, pipemap.inspect(tiny_folders["sdxl"]))
    drawn = plan.picture(moved)
    gpu = next(b for b in drawn.bars if b.device == "cuda:0")
    assert any(s.kind == "offload" for s in gpu.segments)
    links = {(link.source, link.target): link.bytes_per_image for link in drawn.links}
    assert links[("cpu", "cuda:0")] == sum(p.bytes for p in plan.components if p.mode == "offload")
    svg_links = _groups(drawn.svg(), "link")
    assert [int(g.get("data-bytes")) for g in svg_links] == list(links.values())


def test_svg_is_accessible(tiny_folders):
    svg = _plan(tiny_folders["sd"], "balanced").picture().svg()
    root = ET.fromstring(svg)
    assert root.find(f"{SVG}title").text.startswith("pipemap plan")
    labels = "".join(t.text or "" for t in root.iter(f"{SVG}text"))
    assert "GiB" in labels and "unet" in labels


def test_terminal_picture_fits_80_columns(tiny_folders):
    plan = _plan(tiny_folders["sdxl"], "balanced_ultra_low_memory")
    text = plan.picture().text(width=80)
    assert all(len(line) <= 80 for line in text.splitlines())
    assert "cuda:0" in text and "unet" in text


def test_notebook_html_holds_the_svg(tiny_folders):
    plan = _plan(tiny_folders["sd"], "balanced")
    html = plan._repr_html_()
    assert "<svg" in html and "</svg>" in html
    ET.fromstring(html[html.index("<svg"):html.index("</svg>") + 6])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["balanced", "balanced_ultra_low_memory"])
def test_dry_run_timeline_peak_equals_the_reports(tiny_folders, strategy):
    plan = _plan(tiny_folders["sd"], strategy) if strategy == "balanced" else pipemap.plan(
        tiny_folders["sd"], hardware=forcing_hardware(pipemap.inspect(tiny_folders["sd"]), strategy, gpus=2),
        strategy=strategy, headroom=0.0)
    report = pipemap.simulate(tiny_folders["sd"], plan)
    assert report.ok, report.error
    panels = {g.get("data-device"): g for g in _groups(report.picture().svg(), "timeline")}
    for device, peak in report.peak_bytes.items():
        if not peak:
            continue
        panel = panels[device]
        assert int(panel.get("data-peak")) == peak
        assert panel.get("data-peak-phase") == report.peak_phase[device]
        assert int(panel.get("data-budget")) == next(d.budget for d in plan.devices if d.device == device)
    gpu = plan.execution_device
    assert panels[gpu].get("data-peak-component") == report.peak_component[gpu] != ""
    assert all(len([s for s in report.timeline if s.device == d]) <= 600 for d in panels)


@pytest.mark.slow  # over 2 s: out of the quick subset
def test_report_notebook_html_holds_the_timeline(tiny_folders):
    report = pipemap.simulate(tiny_folders["sd"], _plan(tiny_folders["sd"], "balanced"))
    html = report._repr_html_()
    svg = ET.fromstring(html[html.index("<svg"):html.index("</svg>") + 6])
    assert [g for g in svg.iter(f"{SVG}g") if g.get("class") == "timeline"]
    assert "peak set by" in html


def test_replicas_are_drawn_on_each_gpu(tiny_folders):
    plan = pipemap.plan(tiny_folders["sd"], hardware="2x1GiB,cpu=4GiB", strategy="parallel", headroom=0.0)
    unet = plan.placement("unet")
    assert unet.mode == "replicated"
    drawn = plan.picture()
    for device in (unet.device, *unet.replicas):
        bar = next(b for b in drawn.bars if b.device == device)
        assert any(s.label.startswith("unet") and s.bytes == unet.bytes for s in bar.segments)
    for use in plan.devices:
        assert sum(s.bytes for s in next(b for b in drawn.bars if b.device == use.device).segments) == use.used


@pytest.mark.parametrize(("mode", "label"), [("guidance", "transformer (copy: 2nd guidance branch)"),
                                             ("sequence", "transformer (copy: share of tokens)")])
def test_a_copy_is_drawn_on_its_gpu_with_what_it_runs_and_the_bytes_between_them(mode, label):
    plan = pipemap.Plan("parallel", (pipemap.Placement("transformer", "cuda:0", 100, mode, replicas=("cuda:1",)),),
                        (pipemap.DeviceUse("cuda:0", 200, 200, 100), pipemap.DeviceUse("cuda:1", 200, 200, 100)),
                        "cuda:0")
    drawn = plan.picture({"transformer": 5000})
    copy = next(b for b in drawn.bars if b.device == "cuda:1").segments
    assert [(s.label, s.bytes, s.kind) for s in copy] == [(label, 100, mode)]
    assert [(lk.source, lk.target, lk.bytes_per_image) for lk in drawn.links] == [("cuda:0", "cuda:1", 5000)]
    assert f'data-kind="{mode}"' in drawn.svg()


def test_timeline_peak_and_budget():
    samples = [picture.Sample(i, "cuda:0", b, phase) for i, (b, phase) in
               enumerate([(10, "encode prompt"), (30, "denoise step 1"), (25, "denoise step 2"), (40, "vae decode")])]
    svg = picture.timeline_svg(samples, {"cuda:0": 35}, "dry run")
    (panel,) = _groups(svg, "timeline")
    assert int(panel.get("data-peak")) == 40 and panel.get("data-peak-phase") == "vae decode"
    assert int(panel.get("data-budget")) == 35


@pytest.mark.slow
def test_command_line_draws_and_writes_svg(tiny_folders, tmp_path):
    out = tmp_path / "plan.svg"
    done = pipemap_cli("plan", tiny_folders["sd"], "--hardware", "2x1GiB", "--picture", "--svg", str(out))
    assert done.returncode == 0, done.stderr
    assert "cuda:0" in done.stdout and f"wrote {out}" in done.stdout
    devices = {g.get("data-device") for g in _groups(out.read_text(), "device")}
    assert devices == {"cuda:0", "cuda:1", "cpu"}


@pytest.mark.slow
def test_simulate_command_writes_the_timeline(tiny_folders, tmp_path):
    out = tmp_path / "run.svg"
    done = pipemap_cli("simulate", tiny_folders["sd"], "--hardware", "2x1GiB", "--strategy", "balanced", "--svg",
                       str(out))
    assert done.returncode == 0, done.stderr
    assert {g.get("data-device") for g in _groups(out.read_text(), "timeline")} >= {"cuda:0", "cuda:1"}


def test_a_label_too_long_for_its_segment_is_keyed_and_written_out_under_the_bars_and_labels_have_a_halo():
    MiB = 2**20
    # 1 GiB of bar is 520 px: the 1 GiB unet's label fits, the text encoder's 100 MiB (51 px) does not
    bar = picture.Bar("cuda:0", 1300 * MiB, 1200 * MiB, 1124 * MiB, (
        picture.Segment("unet", 1024 * MiB, "resident"),
        picture.Segment("text_encoder_2 (resident part)", 100 * MiB, "stream")))
    svg = picture.Picture("plan", (bar,)).svg()
    labels = {g.get("data-label"): g.find(f"{SVG}text") for g in _groups(svg, "segment")}
    assert labels["unet"].text == "unet 1.00 GiB" and labels["text_encoder_2 (resident part)"].text == "[1]"
    assert [g.find(f"{SVG}text").text for g in _groups(svg, "cut")] == ["[1] text_encoder_2 (resident part) 100.00 MiB"]
    assert all(t.get("paint-order") == "stroke" and t.get("stroke") for t in labels.values())  # over hatch and dots
    assert "\u2026" not in svg  # nothing cut off
