"""dryrun/patches.py: pipeline code works on stand-in weights as on real ones: module conversions (SDXL's fp16 VAE
upcast, counted as activations), decoded outputs of any output_type, host copies; folder and loaded pipelines
alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import pipemap
from helpers import plain_pipeline
from pipemap import tiny
from pipemap.dryrun import patches, standin, trackers

# tiny sdxl in fp16: unet 1.58 MiB, vae 1.26 MiB (2.52 MiB upcast to fp32), text encoders 0.11 MiB each
HW = "2x5MiB,cpu=1GiB"
SDXL_MAP = {"unet": "cuda:0", "text_encoder": "cuda:0", "text_encoder_2": "cuda:0", "vae": "cuda:1"}


@pytest.fixture(scope="module")
def sdxl16(tiny_folders):
    return tiny_folders["sdxl"], plain_pipeline(tiny_folders["sdxl"], dtype=torch.float16)


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


def test_host_copies_read_a_stand_in_as_zeros_of_its_shape():
    with FakeTensorMode(allow_non_fake_inputs=True):
        scores = torch.empty(2, 3, device="meta:0")
    with pytest.raises(RuntimeError):
        scores.numpy()  # fake tensors have no host copy of their own
    with patches.host_copies():
        copied = scores.numpy()
        assert copied.shape == (2, 3) and copied.dtype == np.float32 and not copied.any()
        assert copied.strides == (0, 0)  # one zero broadcast: no host memory per element
        np.testing.assert_array_equal(torch.arange(3.0).numpy(), [0.0, 1.0, 2.0])  # real tensors are untouched
    with pytest.raises(RuntimeError):
        scores.numpy()


@pytest.mark.parametrize("output_type", ["pil", "np"])
def test_tensor_outputs_keep_a_decoded_stand_in_a_tensor(output_type):
    from diffusers.image_processor import VaeImageProcessor

    processor, original = VaeImageProcessor(), VaeImageProcessor.postprocess
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        decoded = torch.zeros(1, 3, 8, 8, device="meta:1")
    with patches.tensor_outputs():
        real = processor.postprocess(torch.zeros(1, 3, 8, 8), output_type=output_type)
        with mode:
            images = processor.postprocess(decoded, output_type=output_type)
    # the stand-in comes back as the host type asked for, of the real one's size, blank (issue 28: pipeline code
    # reads ``.size`` and ``.crop`` of decoded images)
    assert type(images) is type(real) and len(images) == len(real) == 1
    if output_type == "pil":
        assert images[0].size == real[0].size == (8, 8) and images[0].mode == real[0].mode
    else:
        assert images.shape == real.shape == (1, 8, 8, 3) and images.dtype == real.dtype and not images.any()
    assert VaeImageProcessor.postprocess is original


# ---- tiles: run once what each tile repeats ------------------------------------------------------------------------

# the tiny SD VAE: tiles of 16x16 latents every 12 (overlap 0.25), decoded to 32x32; at 64x64 its latents are 32x32
TILED = {"unet": "cuda:0", "text_encoder": "cpu", "vae": "cuda:1"}


def _executed_decoder_runs(monkeypatch) -> list:
    """Counts the VAE decoder's mid-blocks that really run (a replayed tile runs none of its modules)."""
    from diffusers.models.unets.unet_2d_blocks import UNetMidBlock2D

    runs: list = []
    original = UNetMidBlock2D.forward
    monkeypatch.setattr(UNetMidBlock2D, "forward", lambda self, *a, **k: runs.append(1) or original(self, *a, **k))
    return runs


def _figures(report) -> tuple:
    return (report.ok, report.peak_bytes, report.weight_bytes, report.activation_bytes, report.weight_peak_bytes,
            report.peak_phase, report.peak_component, report.bound_peaks)


@pytest.mark.slow  # two tiled dry runs: about 4 s on 2 cores
def test_a_tiled_decode_runs_each_tile_shape_once_with_the_figures_of_every_tile(tiny_folders, monkeypatch):
    from pipemap.dryrun.run import traced

    folder = tiny_folders["sd"]
    plan = pipemap.plan(folder, hardware="2x4MiB,cpu=1GiB", headroom=0.0, strategy=TILED)
    runs = _executed_decoder_runs(monkeypatch)
    once, _, _ = traced(folder, plan, vae_tiling=True, call={"height": 64, "width": 64})
    assert len(runs) == 4  # 3x3 tiles of 4 shapes: 16x16, 16x8, 8x16, 8x8 latents
    runs.clear()
    monkeypatch.setattr(patches, "repeated_tiles", lambda vae, tracker: patches.contextlib.nullcontext())
    every, _, _ = traced(folder, plan, vae_tiling=True, call={"height": 64, "width": 64})
    assert len(runs) == 9  # every tile run
    assert _figures(once) == _figures(every) and once.ok
    assert once.peak_phase["cuda:1"] == "VAE decode"


@pytest.mark.slow  # a dry run at 1024x1024: about 15 s of CPU on 2 cores (400 s when each of its 1849 tiles ran)
def test_tiling_advice_at_1024_runs_a_bounded_number_of_tiles(tiny_folders, monkeypatch):
    folder = tiny_folders["sd"]
    plan = pipemap.plan(folder, hardware="2x5MiB,cpu=1GiB")
    runs = _executed_decoder_runs(monkeypatch)
    report = pipemap.simulate(folder, plan, height=1024, width=1024)
    # 1 untiled decode, then 43x43 tiles of 4 shapes, each run once
    assert report.ok and len(runs) <= 5
    assert len(report.advice) == 1 and "with pipe.vae.enable_tiling() the peak is" in report.advice[0]


def test_repeated_tiles_leaves_a_vae_without_tiling_and_puts_methods_back():
    vae = tiny.build("sd").vae
    tracker = trackers.StorageTracker()
    with patches.repeated_tiles(vae, tracker):
        assert "forward" not in vae.decoder.__dict__  # no tiling: nothing wrapped
    vae.enable_tiling()
    with patches.repeated_tiles(vae, tracker):
        assert "forward" in vae.decoder.__dict__ and "blend_v" in vae.__dict__
    assert "forward" not in vae.decoder.__dict__ and "blend_v" not in vae.__dict__


@pytest.mark.slow  # two tiled dry runs of a tiny Wan 2.1: about 10 s on 2 loaded cores
def test_a_video_vae_tile_replays_the_frame_caches_it_fills(tmp_path, monkeypatch):
    # Wan's decoder fills its list of each convolution's last frames (feat_cache) at every latent frame: a replayed
    # tile refills it, so the next frame's call sees the caches the first tile left (without: 6 of 9 frames and a
    # broadcast error in blend_h)
    from diffusers.models.autoencoders import autoencoder_kl_wan

    import families
    from pipemap.dryrun.run import traced

    pipe, call = families.build("wan_t2v", tmp_path)
    plan = pipemap.plan(pipe, hardware="cuda:0=1GiB,cpu=4GiB")
    call = {k: v for k, v in families.fresh(call).items() if k != "output_type"}
    call.update(height=320, width=448, num_frames=9)  # latents 40x56, 3 frames: 2x3 tiles of 4 shapes
    runs: list = []
    original = autoencoder_kl_wan.WanDecoder3d.forward
    monkeypatch.setattr(autoencoder_kl_wan.WanDecoder3d, "forward",
                        lambda self, *a, **k: runs.append(1) or original(self, *a, **k))
    once, _, _ = traced(pipe, plan, steps=1, vae_tiling=True, call=call)
    assert len(runs) == 4 * 3  # each tile shape's 3 frames
    runs.clear()
    monkeypatch.setattr(patches, "repeated_tiles", lambda vae, tracker: patches.contextlib.nullcontext())
    every, _, _ = traced(pipe, plan, steps=1, vae_tiling=True, call=call)
    assert len(runs) == 6 * 3
    assert once.ok, once.error
    assert _figures(once) == _figures(every)
