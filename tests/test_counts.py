"""Counted work as values: sums, steps, pieces by module, the JSON round trip and the call's shape key."""

from __future__ import annotations

import torch

from pipemap.counts import ComponentCounts, Counts, Tally, shape_of

STEP = Tally(flops=10.0, fp32_flops=0.0, bytes=6.0, memory_bytes=4.0, kernels=3)
UNET = ComponentCounts("unet", per_step=STEP, calls_per_step=2.0,
                       pieces=(("down.0.conv", Tally(flops=2.0)), ("down.0.attn.q", Tally(flops=1.0)),
                               ("up.1", Tally(flops=2.0))))
VAE = ComponentCounts("vae", once=Tally(flops=7.0, kernels=5), calls_once=1.0)


def test_a_component_works_once_plus_once_a_step():
    assert UNET.total(4) == STEP.scaled(4) and UNET.calls(4) == 8
    assert UNET.per_call(4) == STEP.scaled(0.5)
    assert VAE.total(50) == VAE.once and VAE.per_call(50) == VAE.once


def test_work_inside_a_module_path_and_coarser_pieces_keep_the_sums():
    assert UNET.inside("down.0").flops == 3.0 and UNET.inside("").flops == 5.0 and UNET.inside("down.0.c").flops == 0
    coarse = UNET.coarse(2)
    assert dict(coarse.pieces) == {"down.0": Tally(flops=3.0), "up.1": Tally(flops=2.0)}


def test_counts_iterate_the_loop_past_the_steps_asked_and_round_trip_through_json():
    counts = Counts("StableDiffusionPipeline", (("height", "512"),), 50, (UNET, VAE), "float16", extra_steps=1)
    assert counts.iterations() == 51 and counts.iterations(10) == 11
    assert counts.total(10) == STEP.scaled(11) + VAE.once
    back = Counts.from_dict(counts.to_dict(), origin="cached")
    assert back == counts.__class__(**{**counts.__dict__, "origin": "cached"})
    assert counts["vae"] is VAE and counts.get("controlnet") is None


def test_the_shape_of_a_call_leaves_out_the_steps_and_describes_tensors():
    image = torch.zeros(1, 3, 64, 64)
    assert shape_of({"num_inference_steps": 4, "height": 64, "generator": object()}) == \
        shape_of({"num_inference_steps": 50, "height": 64})
    assert shape_of({"image": image}) == (("image", "<Tensor (1, 3, 64, 64) torch.float32>"),)
    assert shape_of({"height": 64}) != shape_of({"height": 128})
