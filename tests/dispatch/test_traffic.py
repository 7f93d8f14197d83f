"""Bytes moved per image (``pipemap.dispatch.traffic``): a pipemap plan beside diffusers'
``enable_model_cpu_offload`` on the same pipeline, on the CPU (GPU plans remapped)."""

from __future__ import annotations

import pytest

import pipemap
from helpers import models_of, pipeline_state, plain_pipeline, run
from pipemap import tiny
from pipemap.dispatch import traffic
from pipemap.dispatch.traffic import MovedBytes, total_bytes
from pipemap.hooks import packing
from pipemap.planner import forcing_hardware

OFFLOADING = ("balanced_low_memory", "balanced_ultra_low_memory")
DENOISERS = ("unet", "controlnet")


def _moved(stats) -> dict[str, int]:
    return {name: c["h2d_bytes"] + c["d2h_bytes"] for name, c in stats.items()}


def _sizes(pipe) -> dict[str, int]:
    return {n: packing.Group(packing.slots(m.modules()).values()).nbytes for n, m in models_of(pipe).items()}


def test_nothing_moves_when_everything_fits(tiny_folders):
    pipe = plain_pipeline(tiny_folders["sdxl"])
    fits = pipemap.plan(pipe, hardware="cuda:0=1GiB,cpu=1GiB", strategy="balanced_low_memory", headroom=0.0)
    result = traffic.bytes_moved_per_image(pipe, fits.remap({"cuda:0": "cpu"}), **tiny.default_call(pipe, "sdxl"))
    assert set(_moved(result.pipemap).values()) == {0} and result.ratio == 0.0


def test_only_the_text_encoders_move_when_the_rest_fits(tiny_folders):
    pipe = plain_pipeline(tiny_folders["sdxl"])
    inv, sizes = pipemap.inspect(pipe), _sizes(pipe)
    rest = inv["unet"].bytes + inv["vae"].bytes + max(inv["text_encoder"].bytes, inv["text_encoder_2"].bytes)
    gpu_plan = pipemap.plan(inv, hardware=f"cuda:0={rest + 4096},cpu=1GiB", strategy="balanced_low_memory",
                            headroom=0.0)
    assert {p.component for p in gpu_plan.components if p.mode == "offload"} == {"text_encoder", "text_encoder_2"}
    result = traffic.bytes_moved_per_image(pipe, gpu_plan.remap({"cuda:0": "cpu"}), **tiny.default_call(pipe, "sdxl"))
    # each text encoder once per image (room for one at a time), the unet and vae never
    assert _moved(result.pipemap) == {"vae": 0, "text_encoder": sizes["text_encoder"],
                                      "text_encoder_2": sizes["text_encoder_2"], "unet": 0}
    # diffusers' model offload moves every model in and out: 2x the bytes of the pipeline per image
    assert _moved(result.diffusers) == {n: 2 * s for n, s in sizes.items()}
    assert result.ratio == pytest.approx((sizes["text_encoder"] + sizes["text_encoder_2"]) / (2 * sum(sizes.values())))
    assert result.ratio <= 1.0  # 0.039


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sd", "controlnet"])
def test_text_encoder_called_twice_moves_once(tiny_folders, kind):
    pipe = plain_pipeline(tiny_folders[kind])
    inv, sizes = pipemap.inspect(pipe), _sizes(pipe)
    gpu_plan = pipemap.plan(inv, hardware=forcing_hardware(inv, "balanced_low_memory", 1),
                            strategy="balanced_low_memory", headroom=0.0)
    # one GPU: the cheapest set that fits moves the text encoder and the vae (the denoisers stay)
    assert {p.component for p in gpu_plan.components if p.mode == "offload"} == {"text_encoder", "vae"}
    result = traffic.bytes_moved_per_image(pipe, gpu_plan.remap({"cuda:0": "cpu"}), **tiny.default_call(pipe, kind))
    assert result.pipemap["text_encoder"]["calls"] == 2  # the prompt and the negative prompt
    assert _moved(result.pipemap) == {n: sizes[n] if n in ("text_encoder", "vae") else 0 for n in sizes}
    assert result.ratio <= 1.0


@pytest.mark.slow  # over 2 s: out of the quick subset
@pytest.mark.parametrize("strategy", OFFLOADING)
@pytest.mark.parametrize("kind", tiny.KINDS)
def test_bytes_moved_at_most_diffusers_model_offload(tiny_folders, kind, strategy):
    pipe = plain_pipeline(tiny_folders[kind])
    gpu_plan = pipemap.plan(pipe, hardware=forcing_hardware(pipemap.inspect(pipe), strategy, 1), strategy=strategy,
                            headroom=0.0)
    result = traffic.bytes_moved_per_image(pipe, gpu_plan.remap({"cuda:0": "cpu"}), **tiny.default_call(pipe, kind))
    assert 0 < result.ratio <= 1.0
    assert all(result.pipemap[d]["h2d_bytes"] == 0 for d in DENOISERS if d in result.pipemap)
    assert not any(hasattr(m, "_hf_hook") for m in models_of(pipe).values()) and pipe.hf_device_map is None


def test_model_offload_stats_leave_the_pipeline_as_it_was(tiny_folders):
    pipe = plain_pipeline(tiny_folders["sd"])
    run(pipe, "sd")  # transformers installs hooks of its own at the first call
    before = pipeline_state(pipe)
    counts = traffic.model_offload_stats(pipe, **tiny.default_call(pipe, "sd"))
    assert counts["unet"]["calls"] == 2 and counts["text_encoder"]["calls"] == 2
    assert _moved(counts) == {n: 2 * s for n, s in _sizes(pipe).items()}
    after = pipeline_state(pipe)
    for name in models_of(pipe):  # module.to() gives buffers new tensor objects: diffusers' doing, not compared
        assert after[name][:2] + after[name][3:] == before[name][:2] + before[name][3:]
    assert after["pipe"] == before["pipe"]


def _counts(h2d: int, d2h: int = 0, calls: int = 1) -> dict[str, int]:
    return {"calls": calls, "h2d_bytes": h2d, "d2h_bytes": d2h}


def test_total_bytes_counts_both_directions():
    assert total_bytes({"unet": _counts(100, 30), "vae": _counts(5)}) == 135
    assert total_bytes({}) == 0


def test_ratio_is_pipemap_over_diffusers_and_zero_when_nothing_moves():
    moved = MovedBytes({"unet": _counts(0), "vae": _counts(10, 0, 2)},
                       {"unet": _counts(60, 60), "vae": _counts(20, 20)})
    assert (moved.pipemap_bytes, moved.diffusers_bytes) == (10, 160) and moved.ratio == 10 / 160
    assert MovedBytes({"vae": _counts(0)}, {"vae": _counts(0)}).ratio == 0.0  # no division by zero
