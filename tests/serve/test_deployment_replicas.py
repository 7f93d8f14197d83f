"""``pipemap serve --ray`` asks Ray for every GPU the plan computes on, the denoiser's replicas included."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

import pipemap  # noqa: E402
from pipemap.serve.deployment import gpus  # noqa: E402


def test_a_replica_asks_for_the_gpus_of_its_denoiser_copies():
    # SDXL on 4x80GiB "parallel": text encoders, VAE and UNet on cuda:0..2, UNet copies on cuda:1..3
    plan = pipemap.plan("stable-diffusion-xl-base-1.0", hardware="4x80GiB,cpu=64GiB", strategy="parallel")
    assert "cuda:3" in plan.placement("unet").replicas and "cuda:3" not in plan.device_map.values()
    assert gpus(plan) == 4
