"""dryrun/report.py: what a dry run reports. Figures come back under the plan's device names (``cuda:0``, not the
stand-in ``meta:0``), with every planned device present, the failure's devices renamed, the call shown without its
tensors, and each device's timeline thinned without losing its peak."""

from __future__ import annotations

import collections
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import pipemap
from helpers import inventory, plain_pipeline
from helpers import plan as make_plan
from pipemap.dryrun.report import TIMELINE_POINTS, Failure, report_of
from pipemap.dryrun.trackers import Phase
from pipemap.units import format_bytes

GPUS = {2: "2x5MiB,cpu=1GiB"}
MiB = 2**20
BACK = {"meta:0": "cuda:0", "meta:1": "cuda:1"}


@pytest.fixture(scope="module")
def pipes(tiny_folders):
    return {"sd": plain_pipeline(tiny_folders["sd"])}


@pytest.mark.slow  # over 2 s: out of the quick subset
def test_report_prints_a_table(pipes):
    report = pipemap.simulate(pipes["sd"], pipemap.plan(pipes["sd"], hardware=GPUS[2], headroom=0.0))
    text = str(report)
    assert "dry run ok" in text and "cuda:0" in text and "cuda:1" in text and "activations" in text


def _plan():
    """unet on cuda:0, vae on cuda:1, nothing on the CPU."""
    plan = make_plan(inventory(("unet", 3 * MiB), ("vae", 2 * MiB)), "2x4MiB,cpu=1GiB")
    assert plan.device_map == {"unet": "cuda:0", "vae": "cuda:1"}
    return plan


def _tracker(**figures):
    """What ``report_of`` reads from the dry run's tracker, keyed by stand-in devices."""
    counters = ("peak", "weights", "weight_peak", "activation_peak")
    base = {name: collections.Counter(figures.pop(name, {})) for name in counters}
    return SimpleNamespace(**base, **{"peak_phase": {}, "peak_bound": {}, "samples": [], "peak_component": {},
                                      **figures})


def test_figures_are_keyed_by_the_plans_device_names_and_every_planned_device_is_there():
    tracker = _tracker(peak={"meta:0": 5 * MiB, "cpu": 100}, weights={"meta:0": 3 * MiB},
                       weight_peak={"meta:0": 4 * MiB}, activation_peak={"meta:0": 2 * MiB, "cpu": 100},
                       peak_phase={"meta:0": Phase("denoising", 1)}, peak_component={"meta:0": "unet", "cpu": ""})
    report = report_of(tracker, None, _plan(), BACK, 1.5, {"prompt": "a cat"})
    assert report.ok and report.error is None and report.seconds == 1.5
    # cuda:1 holds the VAE in the plan: there with 0 though the tracker never saw it; the CPU as the tracker saw it
    assert report.peak_bytes == {"cuda:0": 5 * MiB, "cuda:1": 0, "cpu": 100}
    assert report.weight_bytes == {"cuda:0": 3 * MiB, "cuda:1": 0, "cpu": 0}
    assert report.weight_peak_bytes == {"cuda:0": 4 * MiB, "cuda:1": 0, "cpu": 0}
    assert report.activation_bytes == {"cuda:0": 2 * MiB, "cuda:1": 0, "cpu": 100}
    assert report.peak_phase == {"cuda:0": "denoising (step 1)"}
    assert report.peak_component == {"cuda:0": "unet"}  # a peak set by pipeline code names no component


def test_a_failure_names_the_plans_devices_and_the_call_is_shown_without_tensors():
    failure = Failure("aten.add.Tensor", "unet", ("meta:0", "meta:1"), "aten.add.Tensor got tensors on ...")
    call = {"prompt": "a cat", "generator": torch.Generator("cpu"), "image": torch.zeros(1, 3, 8, 8),
            "num_inference_steps": 2}
    report = report_of(_tracker(peak={"meta:0": 1}), failure, _plan(), BACK, 0.1, call)
    assert not report.ok
    assert report.error.devices == ("cuda:0", "cuda:1") and report.error.component == "unet"
    assert report.call == {"prompt": "a cat", "generator": "generator", "num_inference_steps": 2}
    assert "FAILED" in str(report) and "in 'unet'" in str(report)


def test_failure_says_where_and_who():
    assert str(Failure("aten.embedding", "text_encoder", ("cuda:0", "cuda:1"), "mixed", "clip.py:10 (forward)")) \
        == "aten.embedding in 'text_encoder' at clip.py:10 (forward) on cuda:0, cuda:1: mixed"
    assert str(Failure("dispatch", None, (), "no hook")) == "dispatch in the pipeline's own code on ?: no hook"


def test_bound_peaks_and_advice_are_printed_under_the_table():
    note = "every token routed to the first 2 experts"
    tracker = _tracker(peak={"meta:0": 4 * MiB, "meta:1": 3 * MiB}, peak_bound={"meta:0": note},
                       peak_phase={"meta:0": Phase("denoising", 2), "meta:1": Phase("VAE decode")})
    report = report_of(tracker, None, _plan(), BACK, 0.0, {})
    report = replace(report, advice=("cuda:1: use pipe.vae.enable_tiling()",))
    lines = str(report).splitlines()
    assert lines[0].startswith("dry run ok") and report.fits  # 4 MiB on a 4 MiB GPU: at its memory, not above
    row = next(line for line in lines if line.startswith("cuda:0"))
    assert row.count("4.00 MiB") == 2 and row.endswith("denoising (step 2)  (bound)")
    assert next(line for line in lines if line.startswith("cuda:1")).endswith("VAE decode")
    assert lines[-2] == f"(bound): a peak at most this high; the dry run assumed {note}"
    assert lines[-1] == "cuda:1: use pipe.vae.enable_tiling()"


def test_a_peak_above_its_devices_memory_does_not_fit_and_each_such_device_is_named_with_advice():
    # unet 3 MiB on cuda:0 (4 MiB), vae 2 MiB on cuda:1 (4 MiB): cuda:0 peaks at 9 MiB denoising (3 MiB of weights,
    # 6 MiB of activations: more than the GPU), cuda:1 at 5 MiB in VAE decode; the CPU within its 1 GiB
    tracker = _tracker(peak={"meta:0": 9 * MiB, "meta:1": 5 * MiB, "cpu": MiB}, weights={"meta:0": 3 * MiB},
                       peak_phase={"meta:0": Phase("denoising", 2), "meta:1": Phase("VAE decode")},
                       peak_component={"meta:0": "unet", "meta:1": "vae"})
    report = report_of(tracker, None, _plan(), BACK, 0.0, {})
    assert report.ok and not report.fits and report.verdict == "DOES NOT FIT"
    assert [(o.device, o.peak, o.memory, o.phase, o.component) for o in report.overruns] == [
        ("cuda:0", 9 * MiB, 4 * MiB, "denoising (step 2)", "unet"), ("cuda:1", 5 * MiB, 4 * MiB, "VAE decode", "vae")]
    lines = str(report).splitlines()
    assert lines[0].startswith("dry run DOES NOT FIT")
    assert lines[-2] == ("does not fit: cuda:0: peak 9.00 MiB is above its memory 4.00 MiB, set by denoising (step "
                         "2) in 'unet'; try a smaller call (height, width, frames, num_images_per_prompt): its "
                         "activations alone take 6.00 MiB; or a GPU with more memory")
    assert lines[-1].startswith("does not fit: cuda:1: peak 5.00 MiB") and "enable_tiling()" in lines[-1]
    assert report.picture().title.endswith("(does not fit)")
    # weights alone above the memory; activations that a headroom would keep room for
    heavy = report_of(_tracker(peak={"meta:0": 5 * MiB}, weights={"meta:0": 5 * MiB}), None, _plan(), BACK, 0, {})
    assert "its weights alone take 5.00 MiB" in heavy.overruns[0].advice()
    light = report_of(_tracker(peak={"meta:0": 5 * MiB}, weights={"meta:0": 3 * MiB}), None, _plan(), BACK, 0, {})
    assert "--headroom measure (the plan keeps the 2.00 MiB of activations free)" in light.overruns[0].advice()
    failed = replace(report, ok=False, error=Failure("dispatch", None, (), "no hook"))
    assert failed.verdict == "FAILED" and not failed.fits


def test_the_timeline_keeps_each_devices_peak_in_at_most_its_points():
    weights, peak_at = Phase("weights"), 1234
    samples = [("meta:0", 10 + i % 7, weights) for i in range(5000)]
    samples[peak_at] = ("meta:0", 10**6, Phase("VAE decode"))
    samples[10] = ("meta:1", 42, weights)
    report = report_of(_tracker(peak={"meta:0": 10**6, "meta:1": 42}, samples=samples), None, _plan(), BACK, 0, {})
    by_device = collections.Counter(s.device for s in report.timeline)
    assert 0 < by_device["cuda:0"] <= TIMELINE_POINTS and by_device["cuda:1"] == 1
    top = max(report.timeline, key=lambda s: s.bytes)
    assert (top.device, top.bytes, top.phase) == ("cuda:0", 10**6, "VAE decode")
    assert [s.index for s in report.timeline] == sorted(s.index for s in report.timeline)


def test_a_notebook_shows_the_picture_then_the_text_escaped():
    failure = Failure("aten.add", None, ("meta:0",), "<bad> & worse")
    samples = [("meta:0", 5, Phase("weights")), ("meta:0", 9, Phase("denoising", 1))]
    report = report_of(_tracker(peak={"meta:0": 9}, samples=samples), failure, _plan(), BACK, 0, {})
    html = report._repr_html_()
    assert html.index("<svg") < html.index("<pre>")
    assert "&lt;bad&gt; &amp; worse" in html and "<bad>" not in html


@pytest.mark.slow  # a dry run of a streamed plan: about 5 s on 2 cores
def test_the_tables_weights_count_a_streamed_models_resident_blocks_as_the_ledger_does(flux_folder):
    # issue 38: the table showed 0 B of weights on the GPU where the stream's resident blocks live (placed at its
    # first call, after the start's count), while simulate_many's ledger showed them
    plan = pipemap.plan(flux_folder, hardware="1x400KiB,cpu=64MiB", strategy="balanced_ultra_low_memory", headroom=0)
    streamed = plan.placement("transformer")
    assert streamed.device == "cpu" and streamed.resident_bytes > 0  # streamed onto cuda:0, some blocks kept there
    many = pipemap.simulate_many(flux_folder, plan, [{}], workers=1)
    assert many.ok, many.calls
    report = many.reports[0]
    assert report.weight_bytes["cuda:0"] == 0  # nothing there at the start: the resident blocks came at the call
    assert report.weights_held("cuda:0") == many.weight_bytes["cuda:0"] >= streamed.resident_bytes
    row = next(line for line in str(report).splitlines() if line.startswith("cuda:0"))
    assert row.split()[1:3] == format_bytes(many.weight_bytes["cuda:0"]).split()
    assert {d: report.weights_held(d) for d in report.peak_bytes} == many.weight_bytes
