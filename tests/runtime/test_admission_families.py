"""admission across pipeline families (tests/families.py): each call shape measured by a dry run, requests run two
at once under the ledger on a two-GPU plan remapped onto the CPU, outputs equal to plain diffusers', no admission
above a device's memory. Families chosen for what changes a call's memory: an input image, a mask, a second text
encoder, a third, a prompt the pipeline does not pad (Qwen-Image), video frames."""

from __future__ import annotations

import pytest
import torch

import families
import pipemap
from pipemap.api import memory_for
from pipemap.modes import pool_slack

FAMILIES = ("sd_img2img", "sdxl_inpaint", "flux_fill", "sd3", "qwen_image", "wan_t2v")
ON_CPU = {"cuda:0": "cpu", "cuda:1": "cpu"}
ROOM = 64 * 2**20  # each GPU's memory beyond the budget the plan fills: the room the ledger admits activations in


def _two_gpus(pipe) -> str:
    """Two GPUs: the largest model fits one, the whole pipeline needs both (as tests/test_families.py plans)."""
    sizes = [c.bytes for c in pipemap.inspect(pipe).models]
    budget = max(int(0.6 * sum(sizes)), int(1.05 * max(sizes))) + ROOM
    return f"2x{budget + pool_slack(budget)}B,cpu=1GiB"  # what a GPU of this size keeps for CUDA's allocator too


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_requests_under_the_ledger_equal_plain(name):
    pipe, call = families.build(name)
    want = families.output(pipe(**families.fresh(call)))
    plan = pipemap.plan(pipe, hardware=_two_gpus(pipe), headroom=ROOM)
    pipemap.dispatch(pipe, plan.remap(ON_CPU))
    admission = memory_for(pipe, plan)
    needs = admission.needs(families.fresh(call))
    assert not admission.unmeasured and needs.peak[plan.execution_device] > 0
    outputs = pipemap.run_many(pipe, [families.fresh(call), families.fresh(call)], workers=2, plan=plan)
    for output in outputs:
        torch.testing.assert_close(families.output(output), want, atol=1e-5, rtol=0)
    memory = {d.device: d.memory for d in plan.devices}
    history = list(admission.ledger.history)
    assert history and all(total <= memory[d] for record in history for d, total in record.total.items())
    assert max(record.running for record in history) == 2  # 64 MiB of room holds both tiny requests at once
    pipemap.reset(pipe)
