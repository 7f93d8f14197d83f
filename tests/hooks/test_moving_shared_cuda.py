"""Two pipelines placed in one process on one GPU, under the fake CUDA (tests/fakecuda.py): they share what is
onloaded there (``moving.SharedCache``), so one's onload evicts what the other kept, and their calls take turns by
one lock (issue 39, the scenario ``repro_two_pipelines_oom.py``)."""

from __future__ import annotations

import pytest
import torch

import pipemap
from helpers import run
from pipemap import Hardware
from pipemap.runtime.placed import planned

MiB = 2**20


def _rooms(plan) -> set[int]:
    return {p.room for p in plan.components if p.mode == "offload"}


@pytest.mark.slow
def test_two_pipelines_offloading_onto_one_gpu_alternate_calls(fake_cuda, tiny_folders, reference_outputs,
                                                               monkeypatch):
    import fakecuda

    # planned on this machine as the fake shows it (no 512 MiB reserve: the fake has no CUDA context)
    monkeypatch.setattr(Hardware.detect.__func__, "__defaults__", (0,))
    # each cudaMalloc exactly the block asked for: the scenario is the ledgers' arithmetic on MiB-sized components,
    # which CUDA's 2 and 20 MiB segments would swallow whole (tests/test_fakecuda.py covers the segments)
    monkeypatch.setattr(fakecuda, "segment_size", lambda size: -(-size // fakecuda.ROUND) * fakecuda.ROUND)
    fake_cuda.limit.update({0: 6 * MiB, 1: 3 * MiB})
    asked = {"strategy": "balanced_low_memory", "headroom": "2MiB"}
    sd = pipemap.load(tiny_folders["sd"], progress=False, **asked)
    alone = _rooms(pipemap.plan(tiny_folders["sdxl"], **asked))  # with sd's resident text encoder on cuda:0
    torch.testing.assert_close(run(sd, "sd"), reference_outputs["sd"], atol=1e-5, rtol=0)
    assert sd.vae._hf_hook.group.loaded  # kept onloaded after its call
    sdxl = pipemap.load(tiny_folders["sdxl"], progress=False, **asked)
    # planned after sd's call: sd's kept vae (2.5 MiB) was given back first, so it counts as room, not as used
    # memory (the room is smaller only by what else sd's call left allocated: 512 bytes)
    assert not sd.vae._hf_hook.group.loaded
    assert 0 <= min(alone) - min(_rooms(planned(sdxl))) < 64 * 1024 < sd.vae._hf_hook.group.nbytes
    rooms = {"sd": _rooms(planned(sd)), "sdxl": _rooms(planned(sdxl))}
    assert [len(r) for r in rooms.values()] == [1, 1] and min(rooms["sd"]) > min(rooms["sdxl"])
    cache = sd.unet._hf_hook.cache
    assert cache is sdxl.vae._hf_hook.cache and cache.room == min(rooms["sdxl"])  # the smaller room
    assert sd.unet._hf_hook.lock is sdxl.unet._hf_hook.lock
    for kind, pipe in [("sdxl", sdxl), ("sd", sd), ("sdxl", sdxl)]:
        torch.testing.assert_close(run(pipe, kind), reference_outputs[kind], atol=1e-5, rtol=0)
    assert torch.cuda.max_memory_allocated(0) <= 6 * MiB
    assert list(cache.loaded) == [sdxl.vae._hf_hook]  # the last call's vae kept, sd's evicted by sdxl's unet
    pipemap.reset(sd)  # drops only its own: sdxl's kept vae stays, and the room is sdxl's alone
    assert list(cache.loaded) == [sdxl.vae._hf_hook] and sdxl.vae._hf_hook.group.loaded
    assert cache.room == min(rooms["sdxl"])
    torch.testing.assert_close(run(sdxl, "sdxl"), reference_outputs["sdxl"], atol=1e-5, rtol=0)
    pipemap.reset(sdxl)
    assert not cache.loaded and not cache.rooms
