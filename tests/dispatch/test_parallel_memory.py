"""parallel under the memory ledger: ``pipemap.run_many`` on a tight two-GPU plan remapped onto the CPU gives the
outputs of the calls made one by one, and no admission ever puts a device above its memory."""

from __future__ import annotations

import pytest
import torch

import pipemap
from pipemap import tiny
from pipemap.api import memory_for
from pipemap.planner import forcing_hardware

ON_CPU = {"cuda:0": "cpu", "cuda:1": "cpu"}
# tiny SD, balanced with no headroom: unet and text encoder on cuda:0 (3.2 MiB), the vae on cuda:1 (2.5). Beside
# them 1.8 MiB of room on cuda:0: two 32x32 requests rest there (90 KiB each) beside one unet call (1.6 MiB), so a
# third request waits, and so does each unet call while the other request's runs.
TIGHT = "cuda:0=5MiB,cuda:1=4MiB,cpu=1GiB"


def _calls(n: int) -> list[dict]:
    return [dict(prompt=f"a tiny cat number {i}", num_inference_steps=2, height=32, width=32,
                 generator=torch.Generator().manual_seed(i), output_type="np") for i in range(n)]


@pytest.mark.slow
def test_run_many_on_a_tight_plan_equals_one_by_one_and_stays_in_memory():
    pipe = tiny.build("sd")
    pipe.set_progress_bar_config(disable=True)
    one_by_one = [torch.as_tensor(pipe(**call).images) for call in _calls(4)]
    plan = pipemap.plan(pipe, hardware=TIGHT, headroom=0.0)
    assert plan.device_map == {"vae": "cuda:1", "text_encoder": "cuda:0", "unet": "cuda:0"}
    pipemap.dispatch(pipe, plan.remap(ON_CPU))
    outputs = pipemap.run_many(pipe, _calls(4), workers=4, plan=plan)  # workers: an upper bound only
    for got, want in zip(outputs, one_by_one, strict=True):
        torch.testing.assert_close(torch.as_tensor(got.images), want, atol=0, rtol=0)
    admission = memory_for(pipe, plan)
    history = list(admission.ledger.history)
    memory = {d.device: d.memory for d in plan.devices}
    assert len(history) == 4 * (1 + 2 + 2 + 1)  # each request, its two text encoder, two unet and one vae calls
    for record in history:  # at every admission: the plan's weights and every reservation within memory
        assert all(total <= memory[device] for device, total in record.total.items()), record
    assert max(r.running for r in history) == 2  # memory, not the 4 workers, bounded the requests in flight
    assert admission.ledger.waits > 0 and admission.waiting == 0
    assert pipemap.run_many(pipe, _calls(1), plan=plan)[0].images.shape == (1, 32, 32, 3)
    assert memory_for(pipe, plan) is admission  # one ledger per placement: each shape measured once
    pipemap.reset(pipe)


@pytest.mark.slow
def test_a_call_too_large_for_the_plan_fails_alone_with_its_figures():
    pipe = tiny.build("sd")
    pipe.set_progress_bar_config(disable=True)
    plan = pipemap.plan(pipe, hardware=TIGHT, headroom=0.0)
    pipemap.dispatch(pipe, plan.remap(ON_CPU))
    large = dict(_calls(1)[0], height=128, width=128)
    results = pipemap.run_many(pipe, [large, _calls(1)[0]], return_exceptions=True, plan=plan)
    error = results[0]
    assert isinstance(error, pipemap.CallTooLargeError) and error.device == "cuda:0" and error.needs > error.room
    assert "denoising" in error.phase and "a smaller size (about 32x32 or less)" in str(error)
    assert results[1].images.shape == (1, 32, 32, 3)
    pipemap.reset(pipe)


def test_a_plan_without_a_gpu_has_no_ledger():
    pipe = tiny.build("sd")
    pipemap.dispatch(pipe, pipemap.plan(pipe, hardware="cpu=1GiB"))
    assert memory_for(pipe) is None and memory_for(tiny.build("sd")) is None  # no GPU; not placed
    pipemap.reset(pipe)


def test_a_streamed_pipeline_built_in_code_runs_many_alone_with_a_warning():
    # nothing to dry-run from (its weights in the hooks' buffers, no folder): each request runs alone, and says so,
    # where run_many once refused with PipelineMappedError
    pipe = tiny.build("sd")
    pipe.set_progress_bar_config(disable=True)
    one_by_one = [torch.as_tensor(pipe(**call).images) for call in _calls(3)]
    budget = int(forcing_hardware(pipemap.inspect(pipe), "balanced_ultra_low_memory").split(",")[0].split("=")[1])
    plan = pipemap.plan(pipe, hardware=f"cuda:0={budget + 2**20},cpu=1GiB", strategy="balanced_ultra_low_memory",
                        headroom={"cuda:0": "1MiB"})  # the forcing budget for weights, 1 MiB for a call
    assert any(p.mode == "stream" for p in plan.components)
    pipemap.dispatch(pipe, plan.remap(ON_CPU))
    with pytest.warns(RuntimeWarning, match="run alone"):
        outputs = pipemap.run_many(pipe, _calls(3), workers=2, plan=plan)
    for got, want in zip(outputs, one_by_one, strict=True):
        torch.testing.assert_close(torch.as_tensor(got.images), want, atol=0, rtol=0)
    admission = memory_for(pipe, plan)
    assert admission.unmeasured and max(r.running for r in admission.ledger.history) == 1
    assert "PipelineMappedError" in next(iter(admission.unmeasured.values()))
    pipemap.reset(pipe)
