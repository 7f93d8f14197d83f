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


class _Net(torch.nn.Module):
    """Six 128x128 linear blocks: 64 KiB of float32 weights each, under a scale."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 128))
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(128, 128) for _ in range(6))

    def forward(self, x):
        x = x * self.scale
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def test_a_streamed_pipeline_evicts_another_pipelines_offloaded_component(fake_cuda, monkeypatch):
    # pipeline A offloads its net onto cuda:0 and keeps it there; pipeline B streams its net on the same GPU. B's
    # buffers take their room through the GPU's shared cache, evicting A's kept net; with its own buffers beside
    # it, the capped GPU runs out of memory (issue 39)
    import fakecuda
    from pipemap.hooks import HOOKS, Ledger, hook_component, unhook_component
    from pipemap.plan import Placement

    monkeypatch.setattr(fakecuda, "segment_size", lambda size: -(-size // fakecuda.ROUND) * fakecuda.ROUND)
    a, b = _Net(0), _Net(1)
    x = torch.linspace(-1, 1, 256).reshape(2, 128)
    expected = {"a": a(x), "b": b(x)}
    size = sum(p.numel() * 4 for p in a.parameters())  # 387 KiB
    fake_cuda.limit[0] = size + 64 * 1024  # A's net, or B's root and two block buffers: not both
    offload = Placement("net", "cpu", size, "offload", "cuda:0", size + 1024)
    streamed = Placement("net", "cpu", size, "stream", "cuda:0", 3 * 65 * 1024)
    hooks = {}
    for name, net, placement in [("a", a, offload), ("b", b, streamed)]:
        ledger = Ledger(shared=True)  # each pipeline its own ledger, as ``hooks.hook_maker`` makes them
        hooks[name] = HOOKS[placement.mode](placement, "cuda:0", ledger)
        hooks[name].lock = ledger.lock
        hook_component(net, hooks[name])
    try:
        for name in ["a", "b", "a", "b"]:
            net = a if name == "a" else b
            torch.testing.assert_close(net(x.to("cuda:0")).cpu(), expected[name])
            torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated(0) <= fake_cuda.limit[0]
        cache = hooks["a"].cache
        assert hooks["b"].cache is cache and hooks["a"].ledger is not hooks["b"].ledger
        assert not hooks["a"].group.loaded and not cache.loaded  # evicted by B's last call, which keeps nothing
    finally:
        for net in (a, b):
            unhook_component(net)


@pytest.mark.slow
def test_a_plan_moves_nothing_and_counts_what_other_pipelines_keep_as_free(fake_cuda, tiny_folders,
                                                                           reference_outputs, monkeypatch):
    # sd keeps its vae onloaded after its call; planning sdxl on this machine counts that memory as free without
    # evicting it (a plan moves nothing), and plans exactly as after the eviction; loading sdxl then evicts it
    import fakecuda
    from pipemap.hooks import give_back_kept, kept_bytes

    monkeypatch.setattr(Hardware.detect.__func__, "__defaults__", (0,))
    monkeypatch.setattr(fakecuda, "segment_size", lambda size: -(-size // fakecuda.ROUND) * fakecuda.ROUND)
    fake_cuda.limit.update({0: 6 * MiB, 1: 3 * MiB})
    asked = {"strategy": "balanced_low_memory", "headroom": "2MiB"}
    sd = pipemap.load(tiny_folders["sd"], progress=False, **asked)
    torch.testing.assert_close(run(sd, "sd"), reference_outputs["sd"], atol=1e-5, rtol=0)
    vae = sd.vae._hf_hook
    assert vae.group.loaded and kept_bytes()["cuda:0"] >= vae.group.nbytes
    before = torch.cuda.memory_allocated(0)
    kept = pipemap.plan(tiny_folders["sdxl"], **asked)
    assert vae.group.loaded and list(vae.cache.loaded) == [vae]  # the plan moved nothing
    assert torch.cuda.memory_allocated(0) == before
    give_back_kept()
    assert not vae.group.loaded and kept_bytes() == {}
    after = pipemap.plan(tiny_folders["sdxl"], **asked)
    def gpus(plan):  # the host's free RAM moves on its own between two plans
        return [d for d in plan.devices if d.device != "cpu"]

    assert gpus(kept) == gpus(after) and _rooms(kept) == _rooms(after)  # as if evicted first
    torch.testing.assert_close(run(sd, "sd"), reference_outputs["sd"], atol=1e-5, rtol=0)
    assert vae.group.loaded
    sdxl = pipemap.load(tiny_folders["sdxl"], plan=kept, progress=False)  # placing its weights evicts sd's vae
    assert not vae.group.loaded
    for kind, pipe in [("sdxl", sdxl), ("sd", sd)]:
        torch.testing.assert_close(run(pipe, kind), reference_outputs[kind], atol=1e-5, rtol=0)
    pipemap.reset(sd)
    pipemap.reset(sdxl)
