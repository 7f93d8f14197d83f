"""``run_many`` and calls on a caller-chosen CUDA stream, under the fake CUDA (tests/fakecuda.py): several threads
and streams share one placed pipeline's offloaded, streamed and replicated components, with every copy and read
checked for ordering (the fixture fails a test on any race)."""

from __future__ import annotations

import threading

import pytest
import torch

import pipemap
from helpers import run
from pipemap import tiny
from pipemap.planner import forcing_hardware


def _calls(pipe, n: int) -> list[dict]:
    return [dict(tiny.default_call(pipe, "sd"), generator=torch.Generator().manual_seed(i)) for i in range(n)]


def _images(outputs) -> list[torch.Tensor]:
    return [torch.as_tensor(out.images) for out in outputs]


@pytest.mark.slow
def test_run_many_over_streamed_and_offloaded_components_on_fake_gpus(fake_cuda, tiny_folders):
    folder = tiny_folders["sd"]
    # the forcing budget kept for weights, and 2 MiB more on each GPU held back as headroom: room for two calls'
    # activations, which run_many's memory ledger admits by (issue 23)
    spec = forcing_hardware(pipemap.inspect(folder), "balanced_ultra_low_memory", 2)
    roomier = ",".join(f"{d}={int(b) + 2 * 2**20}" if d.startswith("cuda") else f"{d}={b}"
                       for d, b in (part.split("=") for part in spec.split(",")))
    plan = pipemap.plan(folder, hardware=roomier, strategy="balanced_ultra_low_memory",
                        headroom={"cuda:0": "2MiB", "cuda:1": "2MiB"})
    assert any(p.mode == "stream" for p in plan.components)
    pipe = pipemap.load(folder, plan=plan, progress=False)
    pipe.set_progress_bar_config(disable=True)
    one_by_one = _images(pipe(**call) for call in _calls(pipe, 3))
    together = _images(pipemap.run_many(pipe, _calls(pipe, 3), workers=2))
    for a, b in zip(together, one_by_one):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    pipemap.reset(pipe)


PLANS = {"stream": ("balanced_ultra_low_memory", None), "offload": ("balanced_low_memory", None),
         "replicas": ("parallel", "2x8MiB,cpu=1GiB")}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(PLANS))
def test_calls_on_a_caller_chosen_stream_then_on_another_thread(fake_cuda, tiny_folders, reference_outputs, kind):
    # what the first call leaves onloaded (resident pieces, a cached component) is read on the next call's stream
    folder = tiny_folders["sd"]
    strategy, hardware = PLANS[kind]
    gpus = 1 if kind == "offload" else 2
    plan = pipemap.plan(folder, hardware=hardware or forcing_hardware(pipemap.inspect(folder), strategy, gpus),
                        strategy=strategy, headroom=0.0)
    pipe = pipemap.load(folder, plan=plan, progress=False)
    outputs = []
    with torch.cuda.stream(torch.cuda.Stream(plan.execution_device)):
        outputs.append(run(pipe, "sd"))
    thread = threading.Thread(target=lambda: outputs.append(run(pipe, "sd")))
    thread.start()
    thread.join()
    for out in outputs:
        torch.testing.assert_close(out, reference_outputs["sd"], atol=1e-5, rtol=0)
    pipemap.reset(pipe)
