"""dryrun/many: ``simulate_many``, the dry run of ``run_many``, on two stand-in GPUs for the tiny SD and Flux: every
device's peak with the requests overlapped within its budget, more than one request in flight where the room allows
it, a call too large for the plan refused with its figures; and a call's needs read from its course."""

from __future__ import annotations

import pytest

import pipemap
from pipemap import tiny
from pipemap.dryrun.many import Segment, measure, needs_from
from pipemap.runtime.admission import MemoryLedger

# tiny SD at 32x32: the unet (3.0 MiB) and text encoder (0.2) on cuda:0, whose 3.8 MiB of room beside them holds the
# unet's activations (1.6 MiB a call, 3.2 for two images) for two requests; the vae (2.5) on cuda:1, whose 2.5 MiB
# of room holds its decode (0.8 MiB an image).
# tiny Flux at 32x32: the vae (0.8 MiB) alone on cuda:0, the transformer and text encoders (0.8) on cuda:1.
HARDWARE = {"sd": "cuda:0=7MiB,cuda:1=5MiB,cpu=1GiB", "flux": "cuda:0=3MiB,cuda:1=3MiB,cpu=1GiB"}


def _calls(kind: str) -> list[dict]:
    base = dict(prompt="a tiny cat", num_inference_steps=2, height=32, width=32)
    if kind == "flux":
        base["max_sequence_length"] = tiny.FLUX_TOKENS
    # two images, two seeds of one shape, and one call 64 times the pixels: too large for any plan here
    return [base, dict(base, num_images_per_prompt=2), dict(base, prompt="another cat"),
            dict(base, height=256, width=256)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sd", "flux"])
def test_simulate_many_overlaps_requests_within_every_budget(kind):
    pipe = tiny.build(kind)
    plan = pipemap.plan(pipe, hardware=HARDWARE[kind], headroom=0.0)  # budget = memory: the room is what is left
    for workers in (2, 3):
        report = pipemap.simulate_many(pipe, plan, _calls(kind), workers=workers)
        assert report.ok and report.workers == workers
        budget = {d.device: d.budget for d in plan.devices}
        for device, peak in report.peak_bytes.items():
            assert peak <= budget[device], (device, peak, budget[device])
            assert report.reserved_bytes[device] <= budget[device]
            assert peak > report.weight_bytes[device] or device == "cpu"  # activations counted on every GPU
        assert report.most_in_flight > 1  # the room holds two requests: they ran at once
        ran = [c for c in report.calls if c.error is None]
        assert [c.index for c in ran] == [0, 1, 2] and all(c.end > c.start for c in ran)
        assert min(c.end for c in ran) > max(c.start for c in ran[:2])  # the first two overlapped in time
        (refused,) = report.refused
        error = refused.error
        assert refused.index == 3 and isinstance(error, pipemap.CallTooLargeError)
        room = MemoryLedger.of(plan).room(error.device)
        assert error.room == room and error.needs > room and error.needs == refused.peak[error.device]
        assert "a smaller size (about" in str(error) and error.memory == budget[error.device]
    assert "at most" in str(report) and "refused" in str(report)


@pytest.mark.slow
def test_replicas_are_covered_on_each_copy_s_device():
    # the parallel plan puts a unet copy on each GPU: a request's unet call reserves on both, where each copy
    # computes its part of the batch
    pipe = tiny.build("sd")
    plan = pipemap.plan(pipe, hardware="2x8MiB,cpu=1GiB", strategy="parallel", headroom=0.0)
    assert plan.placement("unet").replicas == ("cuda:1",)
    measured = measure(pipe, plan, dict(prompt="a cat", num_inference_steps=2, height=32, width=32))
    unet = measured.needs.extra["unet"]
    assert unet["cuda:0"] > 0 and unet["cuda:1"] > 0
    assert measured.needs.peak["cuda:1"] >= measured.report.activation_bytes["cuda:1"] > 0


def test_needs_from_a_course():
    # pipeline code holds 1 then leaves 2 after the text encoder; the unet peaks at 9 on cuda:0 and 1 on cuda:1
    course = (Segment(None, {"cuda:0": 1}, {"cuda:0": 1}, 3, "weights"),
              Segment("text_encoder", {"cuda:0": 4}, {"cuda:0": 2}, 10, "prompt encoding"),
              Segment("unet", {"cuda:0": 9, "cuda:1": 1}, {"cuda:0": 2, "cuda:1": 0}, 50, "denoising (step 1)"),
              Segment("unet", {"cuda:0": 8}, {"cuda:0": 3}, 50, "denoising (step 2)"))
    needs = needs_from(course)
    assert needs.rest == {"cuda:0": 3, "cuda:1": 0}  # what it holds between its components' calls
    assert needs.extra == {"text_encoder": {"cuda:0": 1}, "unet": {"cuda:0": 6, "cuda:1": 1}}
    assert needs.peak == {"cuda:0": 9, "cuda:1": 1}
