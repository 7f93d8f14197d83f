"""The dry run runs what a real run runs: module conversions (SDXL's fp16 VAE upcast), any output_type, phases,
catalog pipelines with nothing downloaded, folder and loaded pipelines placed alike."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import families
import pipemap
from helpers import plain_pipeline
from pipemap import tiny
from pipemap.dryrun import patches, standin, trackers
from pipemap.dryrun.run import _fake_pipeline

# tiny sdxl in fp16: unet 1.58 MiB, vae 1.26 MiB (2.52 MiB upcast to fp32), text encoders 0.11 MiB each
HW = "2x5MiB,cpu=1GiB"
SDXL_MAP = {"unet": "cuda:0", "text_encoder": "cuda:0", "text_encoder_2": "cuda:0", "vae": "cuda:1"}


@pytest.fixture(scope="module")
def sdxl16(tiny_folders):
    return tiny_folders["sdxl"], plain_pipeline(tiny_folders["sdxl"], dtype=torch.float16)


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory):
    return str(tiny.save("flux", tmp_path_factory.mktemp("flux")))


def _vae_bytes(pipe) -> int:
    return sum(t.numel() * t.element_size() for t in [*pipe.vae.parameters(), *pipe.vae.buffers()])


@pytest.mark.slow
@pytest.mark.parametrize("output_type", ["pil", "np", "pt"])
def test_sdxl_fp16_upcasts_its_vae_from_a_folder_and_a_loaded_pipeline(sdxl16, output_type):
    folder, pipe = sdxl16
    assert pipe.vae.dtype == torch.float16 and pipe.vae.config.force_upcast  # diffusers calls vae.to(float32)
    plan = pipemap.plan(folder, hardware=HW, strategy=SDXL_MAP, dtype=torch.float16, headroom=0.0)
    from_folder = pipemap.simulate(folder, plan, output_type=output_type)
    from_pipe = pipemap.simulate(pipe, plan, output_type=output_type)
    assert from_folder.ok, from_folder.error
    assert from_pipe.ok, from_pipe.error
    assert from_folder.peak_bytes == from_pipe.peak_bytes
    fp16 = _vae_bytes(pipe)
    # the fp32 VAE holds twice its fp16 bytes: the extra half is room the plan's headroom must leave
    assert from_pipe.peak_bytes["cuda:1"] >= 2 * fp16
    assert from_pipe.activation_bytes["cuda:1"] >= fp16
    assert from_pipe.peak_phase["cuda:1"] == "VAE decode"
    assert pipe.vae.dtype == torch.float16  # the caller's pipeline is untouched


@pytest.mark.slow
@pytest.mark.parametrize("source", ["folder", "pipeline"])
def test_measured_headroom_for_sdxl_fp16_covers_the_upcast(sdxl16, source):
    folder, pipe = sdxl16
    plan = pipemap.plan(folder if source == "folder" else pipe, hardware=HW, strategy=SDXL_MAP,
                        dtype=torch.float16, headroom="measure")
    vae_device = plan.device_map["vae"]
    budget = next(d for d in plan.devices if d.device == vae_device)
    assert budget.memory - budget.budget >= _vae_bytes(pipe)  # the reservation holds the fp32 copy's extra bytes
    assert pipemap.simulate(folder, plan).ok


def test_module_conversions_on_stand_in_weights_keep_ties_and_count_bytes():
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    t5 = tiny.build("flux").text_encoder_2
    fake = standin.fake_module(t5, mode, "meta:0")
    assert fake.shared.weight is fake.encoder.embed_tokens.weight
    tracker = trackers.ConvertingTracker()
    tracker.track_module_tensors(type("P", (), {"components": {"t5": fake}})())
    before = tracker.live["meta:0"]
    with patches.module_conversions(tracker), mode, tracker:
        fake.half()
        assert {p.dtype for p in fake.parameters()} == {torch.float16}
        assert tracker.live["meta:0"] == before // 2 and tracker.weight_live["meta:0"] == before // 2
        fake.to(torch.float32)  # the cast back: weights up to their fp16 bytes, the rest activations
        assert tracker.live["meta:0"] == before and tracker.weight_live["meta:0"] == before // 2
        fake.to("meta:1")
        fake.float()
    assert fake.shared.weight is fake.encoder.embed_tokens.weight
    assert all(isinstance(p, FakeTensor) and str(p.device) == "meta:1" for p in fake.parameters())
    assert tracker.live["meta:0"] == 0 and tracker.live["meta:1"] == before


@pytest.mark.slow
def test_phases_name_each_peak_and_tiling_advice_when_decode_does_not_fit(tiny_folders):
    folder = tiny_folders["sd"]
    # the VAE alone on a 4 MiB GPU: its 2.5 MiB of weights fit, a 96x96 decode does not, a tiled decode does
    plan = pipemap.plan(folder, hardware="2x4MiB,cpu=1GiB", headroom=0.0,
                        strategy={"unet": "cuda:0", "text_encoder": "cpu", "vae": "cuda:1"})
    report = pipemap.simulate(folder, plan, height=96, width=96)
    assert report.ok, report.error
    assert report.peak_phase["cuda:0"] in ("denoising (step 1)", "denoising (step 2)")
    assert report.peak_phase["cuda:1"] == "VAE decode" and report.peak_phase["cpu"] == "prompt encoding"
    assert report.peak_bytes["cuda:1"] > 4 * 2**20
    # the advice comes from a second dry run with vae.enable_tiling()
    assert len(report.advice) == 1 and report.advice[0].startswith("cuda:1: VAE decode peaks at")
    assert "pipe.vae.enable_tiling()" in report.advice[0] and report.advice[0].endswith(": fits")
    assert report.advice[0] in str(report)


def test_folder_built_models_are_in_eval_mode(flux_folder):
    folder = flux_folder
    plan = pipemap.plan(folder, hardware=HW, headroom=0.0)
    pipe = _fake_pipeline(folder, plan, FakeTensorMode(allow_non_fake_inputs=True), standin.devices_for(plan))
    models = [c for c in pipe.components.values() if isinstance(c, torch.nn.Module)]
    assert len(models) == 4 and not any(m.training for m in [*models, *(s for m in models for s in m.modules())])


@pytest.mark.slow
def test_hunyuan_dit_from_a_folder_places_and_peaks_as_the_loaded_pipeline(tmp_path):
    # two causes of issue 17's meta/meta:1 mix, both fixed: from_pretrained loaded text_encoder_2 (an __init__
    # argument with a default, not an optional component) from disk in place of the one passed in, and
    # init_empty_weights untied T5's shared embedding from its encoder's (counted twice)
    built, call = families.build("hunyuan_dit")
    built.save_pretrained(tmp_path)
    pipe = plain_pipeline(str(tmp_path))  # loaded, not as built: BertModel loads with the pooler built without
    plan = pipemap.plan(str(tmp_path), hardware="2x8MiB,cpu=1GiB", headroom=0.0,
                        strategy={"text_encoder_2": "cuda:1", "transformer": "cuda:0", "vae": "cuda:0",
                                  "text_encoder": "cuda:0"})
    from_folder = pipemap.simulate(str(tmp_path), plan, **families.fresh(call))
    from_pipe = pipemap.simulate(pipe, plan, **families.fresh(call))
    assert from_folder.ok and from_pipe.ok, (from_folder.error, from_pipe.error)
    assert from_folder.peak_bytes == from_pipe.peak_bytes
    assert from_folder.weight_bytes == from_pipe.weight_bytes
    assert from_folder.peak_phase == from_pipe.peak_phase
    t5 = pipe.text_encoder_2
    assert from_pipe.weight_bytes["cuda:1"] == sum(p.numel() * p.element_size() for p in t5.parameters())


@pytest.mark.slow
def test_a_catalog_pipeline_plans_with_measured_headroom_and_dry_runs_with_nothing_downloaded():
    # the suite's one catalog dry run: SD 1.5 at full size (860M-parameter UNet, safety checker), small images
    call = {"height": 256, "width": 256, "steps": 1}
    plan = pipemap.plan("sd1.5", hardware="2x2GiB,cpu=8GiB", strategy="auto", headroom="measure", call=call)
    assert any("headroom measured" in n for n in plan.notes)
    report = pipemap.simulate("sd1.5", plan, **call)
    assert report.ok, report.error
    for device in plan.devices:
        if device.used:
            assert report.peak_bytes[device.device] <= device.memory
            assert report.weight_bytes[device.device] == pytest.approx(device.used, rel=0.01)
    assert "VAE decode" in report.peak_phase.values()
    assert set(report.peak_phase.values()) <= {"prompt encoding", "denoising (step 1)", "VAE decode", "safety check"}
