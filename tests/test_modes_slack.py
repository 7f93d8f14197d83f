"""The caching allocator's slack in budgets and dry runs (``pipemap.modes.slack``): what a plan keeps per stream pool,
and, under the fake CUDA (its allocator has CUDA's segments), the smallest GPU a plan accepts holds the load and
the call."""

from __future__ import annotations

import pytest
import torch

import pipemap
from helpers import inventory, plain_pipeline, run
from pipemap import tiny
from pipemap.errors import DoesNotFitError
from pipemap.modes import POOL_SLACK, SLACK_FROM, slack
from pipemap.plan import Placement
from pipemap.planner import budgets

MIB = 2**20


def test_a_gpu_budget_keeps_one_pools_slack_and_a_stand_in_gpu_none():
    hardware = pipemap.Hardware.parse(f"cuda:0=1GiB,cuda:1={SLACK_FROM - 1},cpu=1GiB")
    got = budgets(hardware, 0.0)
    assert got == {"cuda:0": 2**30 - POOL_SLACK, "cuda:1": SLACK_FROM - 1, "cpu": 2**30}


def test_a_moved_component_keeps_its_side_pools_slack_on_the_gpu_it_runs_on():
    placements = (Placement("unet", "cuda:0", 100 * MIB), Placement("vae", "cpu", 50 * MIB, "offload", "cuda:0"),
                  Placement("text_encoder", "cuda:1", 10 * MIB))
    assert slack(placements, "cuda:0", 2**30) == 2 * POOL_SLACK  # the default stream's pool and the copies'
    assert slack(placements, "cuda:1", 2**30) == POOL_SLACK
    assert slack(placements, "cpu", 2**30) == 0
    assert slack(placements, "cuda:0", SLACK_FROM - 1) == 0


def test_an_offloading_plan_shows_the_side_pool_in_its_budget():
    # a 140 MiB GPU, headroom 0: 118 MiB after the default pool's slack. The 120 MiB do not fit whole; the unet
    # (60) stays with room for one moved component (30) and the side pool's slack (22) of the copies that move it
    inv = inventory(("text_encoder", 30 * MIB), ("unet", 60 * MIB), ("vae", 30 * MIB))
    made = pipemap.plan(inv, "cuda:0=140MiB,cpu=1GiB", strategy="balanced_low_memory", headroom=0.0)
    assert {p.component: p.mode for p in made.components} == {"text_encoder": "offload", "unet": "resident",
                                                                "vae": "offload"}
    gpu = next(d for d in made.devices if d.device == "cuda:0")
    assert (gpu.budget, gpu.used) == (140 * MIB - 2 * POOL_SLACK, 90 * MIB)


def _smallest_gpu(folder: str, strategy: str) -> int:
    """The smallest GPU (to 1 MiB) on which ``strategy`` plans the pipeline with the default headroom."""
    low, high = 1, 4096
    while low < high:
        middle = (low + high) // 2
        try:
            pipemap.plan(folder, hardware=f"cuda:0={middle}MiB,cpu=4GiB", strategy=strategy)
            high = middle
        except DoesNotFitError:
            low = middle + 1
    return low * MIB


@pytest.mark.slow
def test_the_smallest_gpu_balanced_plans_on_loads_and_calls_within_its_cap(fake_cuda, tmp_path):
    # tiny SD at scale 4: unet 48 MiB, vae 40 MiB, text encoder 2.6 MiB, whose weights take blocks of both pools'
    # sizes: without the slack, the smallest GPU it planned on (101 MiB) ran out while loading (86.5 MiB allocated,
    # 3.5 MiB cached, a 20 MiB segment asked for)
    folder = str(tiny.save("sd", tmp_path / "sd", variant_fp16=False, scale=4))
    smallest = _smallest_gpu(folder, "balanced")
    assert smallest > SLACK_FROM
    fake_cuda.gpus = 1
    torch.cuda.set_per_process_memory_fraction(smallest / fake_cuda.memory, 0)  # the cap is on reserved bytes
    plan = pipemap.plan(folder, hardware=f"cuda:0={smallest},cpu=4GiB", strategy="balanced")
    pipe = pipemap.load(folder, plan=plan, progress=False)
    got = run(pipe, "sd")
    assert fake_cuda.peak_reserved[0] <= smallest
    torch.testing.assert_close(got, run(plain_pipeline(folder), "sd"), atol=1e-5, rtol=0)
    pipemap.reset(pipe)
