"""Pipeline families (tests/families.py) placed on two fake GPUs (tests/fakecuda.py) by each moving strategy: the
CUDA path of offload, streaming and replicas on diffusers' own components of many families, equal to plain and with
no race. The CPU-remapped runs of every family are in test_families.py."""

from __future__ import annotations

import gc

import pytest
import torch

import families
import pipemap
from pipemap.dispatch import dispatch
from pipemap.planner import forcing_hardware

CASES = [("sd_inpaint", "balanced_low_memory"), ("sdxl_img2img", "balanced_ultra_low_memory"),
         ("flux_fill", "balanced_ultra_low_memory"), ("sd3", "balanced_ultra_low_memory"),
         ("qwen_image", "balanced_ultra_low_memory"), ("wan_t2v", "balanced_low_memory"),
         ("ltx", "balanced_ultra_low_memory"), ("latte", "balanced_low_memory"), ("mochi", "parallel")]


def _hardware(inventory, strategy: str) -> str:
    if strategy == "parallel":  # room for a second copy of the denoiser
        sizes = [c.bytes for c in inventory.models]
        return f"2x{max(int(0.6 * sum(sizes)), int(1.05 * max(sizes)))}B,cpu=1GiB"
    return forcing_hardware(inventory, strategy, gpus=2)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "strategy"), CASES)
def test_family_on_fake_gpus_equals_plain(fake_cuda, name, strategy):
    pipe, call = families.build(name)
    reference = families.output(pipe(**families.fresh(call)))
    plan = pipemap.plan(pipe, hardware=_hardware(pipemap.inspect(pipe), strategy), strategy=strategy, headroom=0.0)
    mode = {"balanced_low_memory": "offload", "balanced_ultra_low_memory": "stream", "parallel": "replicated"}
    assert any(p.mode == mode[strategy] for p in plan.components), plan
    dispatch(pipe, plan)
    out = families.output(pipe(**families.fresh(call)))
    torch.testing.assert_close(out.cpu() if isinstance(out, torch.Tensor) else out, reference, atol=1e-5, rtol=0)
    pipemap.reset(pipe)
    del pipe
    gc.collect()
    assert not fake_cuda.registered
