"""The dry run's defects of earlier rounds (issue 28): advice for a VAE without tiling, HunyuanImage 2.1's VAE
attention on 3-D tensors, and a model class it cannot build, named in the report instead of raised."""

from __future__ import annotations

import json
import shutil

import pytest

import families
import pipemap
from helpers import plain_pipeline


def _vae_alone(pipe, room: int) -> pipemap.Plan:
    """The VAE alone on cuda:1 with ``room`` bytes, the rest on a roomy cuda:0."""
    others = {c.name: "cuda:0" for c in pipemap.inspect(pipe).models if c.name != "vae"}
    return pipemap.plan(pipe, hardware=f"cuda:0=1GiB,cuda:1={room},cpu=1GiB", strategy={**others, "vae": "cuda:1"},
                        headroom=0.0)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "advised"), [("stable_video_diffusion", False), ("sd_img2img", True)])
def test_tiling_advice_only_for_a_vae_that_tiles(name, advised):
    # VAE decode peaks above cuda:1's memory; SVD's temporal decoder has no tiling (enable_tiling raises), so no
    # advice and no failure; an AutoencoderKL gets the tiled dry run's verdict
    pipe, call = families.build(name)
    weights = pipemap.inspect(pipe)["vae"].bytes
    report = pipemap.simulate(pipe, _vae_alone(pipe, weights + 1024), **families.fresh(call))
    assert report.ok, report.error
    assert report.peak_phase["cuda:1"].startswith("VAE decode")
    assert report.peak_bytes["cuda:1"] > weights + 1024
    assert bool(report.advice) == advised
    assert all("enable_tiling" in line for line in report.advice)


@pytest.mark.slow
def test_hunyuan_image_21_vae_attention_on_3d_tensors(tmp_path):
    pipe, call = families.build("hunyuan_image21")
    pipe.save_pretrained(tmp_path)
    plain = plain_pipeline(str(tmp_path))
    plan = pipemap.plan(str(tmp_path), hardware="2x200MiB,cpu=1GiB", headroom=0.0)
    from_folder = pipemap.simulate(str(tmp_path), plan, **families.fresh(call))
    from_pipeline = pipemap.simulate(plain, plan, **families.fresh(call))
    assert from_folder.ok, from_folder.error
    assert from_pipeline.ok, from_pipeline.error
    assert from_folder.peak_bytes == from_pipeline.peak_bytes


@pytest.mark.slow
def test_a_model_the_dry_run_cannot_build_is_named_in_the_report(tiny_folders, tmp_path):
    # a UNet whose config names a block class diffusers does not have: the report says which component and class
    folder = shutil.copytree(tiny_folders["sd"], tmp_path / "sd")
    plan = pipemap.plan(folder, hardware="2x1GiB,cpu=1GiB", headroom=0.0)
    config = folder / "unet" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "mid_block_type": "NoSuchMidBlock"}))
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    report = pipemap.simulate(folder, plan)
    assert not report.ok
    assert report.error.component == "unet" and report.error.operation == "stand-in build"
    assert "UNet2DConditionModel" in report.error.message and "NoSuchMidBlock" in report.error.message
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before
