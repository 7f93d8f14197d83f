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


def _placed(folder: str):
    # planned on this machine as the fake shows it (no 512 MiB reserve: the fake has no CUDA context); the second
    # is planned with the first's resident text encoder already on cuda:0
    return pipemap.load(folder, hardware=Hardware.detect(reserve=0), strategy="balanced_low_memory",
                        headroom="2MiB", progress=False)


@pytest.mark.slow
def test_two_pipelines_offloading_onto_one_gpu_alternate_calls(fake_cuda, tiny_folders, reference_outputs):
    fake_cuda.limit.update({0: 6 * MiB, 1: 3 * MiB})
    sd, sdxl = _placed(tiny_folders["sd"]), _placed(tiny_folders["sdxl"])
    # each offloads its unet and vae onto cuda:0 within a room planned alone: 3.78 MiB for sd, 3.33 MiB for sdxl
    # (which saw sd's text encoder); sd's vae (2.5 MiB) kept after its call beside sdxl's unet (3.2 MiB) is over
    # the 6 MiB limit, so each call must evict what the other pipeline kept
    rooms = {kind: {p.room for p in planned(pipe).components if p.mode == "offload"}
             for kind, pipe in (("sd", sd), ("sdxl", sdxl))}
    assert [len(r) for r in rooms.values()] == [1, 1] and min(rooms["sd"]) > min(rooms["sdxl"])
    cache = sd.unet._hf_hook.cache
    assert cache is sdxl.vae._hf_hook.cache and cache.room == min(rooms["sdxl"])  # the smaller room
    assert sd.unet._hf_hook.lock is sdxl.unet._hf_hook.lock
    for kind, pipe in [("sd", sd), ("sdxl", sdxl)] * 2:
        torch.testing.assert_close(run(pipe, kind), reference_outputs[kind], atol=1e-5, rtol=0)
    assert torch.cuda.max_memory_allocated(0) <= 6 * MiB
    assert sd.unet._hf_hook.moved.h2d_bytes == 2 * sd.unet._hf_hook.group.nbytes  # evicted between its calls
    assert list(cache.loaded) == [sdxl.vae._hf_hook]  # the last call's vae kept, sd's evicted by sdxl's unet
    pipemap.reset(sd)  # drops only its own: sdxl's kept vae stays, and the room is sdxl's alone
    assert list(cache.loaded) == [sdxl.vae._hf_hook] and sdxl.vae._hf_hook.group.loaded
    assert cache.room == min(rooms["sdxl"])
    torch.testing.assert_close(run(sdxl, "sdxl"), reference_outputs["sdxl"], atol=1e-5, rtol=0)
    pipemap.reset(sdxl)
    assert not cache.loaded and not cache.rooms
