"""Model offload with CUDA on, under the fake CUDA (tests/fakecuda.py): the LRU cache on one GPU, a cached component
called on another stream, a VAE upcast while cached, and reset right after a call."""

from __future__ import annotations

import threading

import pytest
import torch
from diffusers import AutoencoderKL

import fakecuda
from pipemap.hooks import HOOKS, Ledger, OffloadHook, hook_component, unhook_component
from pipemap.plan import Placement


def _net(width: int = 64) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.GELU(), torch.nn.Linear(width, 8))


def _offloaded(module: torch.nn.Module, ledger: Ledger, room: int = 10**6, name: str = "text_encoder") -> OffloadHook:
    hook = HOOKS["offload"](Placement(name, "cpu", 1, "offload", "cuda:0", room), "cuda:0", ledger)
    hook_component(module, hook)
    return hook


def test_components_evicting_each_other_on_one_gpu(fake_cuda):
    ledger = Ledger()
    a, b = _net(64), _net(48)
    room = max(sum(p.numel() * 4 for p in m.parameters()) for m in (a, b)) + 256  # one at a time
    expected = [m(torch.ones(2, 8)) for m in (a, b)]
    hooks = [_offloaded(a, ledger, room, "a"), _offloaded(b, ledger, room, "b")]
    x = torch.ones(2, 8).to("cuda:0")
    outs = [m(x) for _ in range(3) for m in (a, b)]
    for i, out in enumerate(outs):
        torch.testing.assert_close(out.cpu(), expected[i % 2])
    assert [h.moved.h2d_bytes // h.group.nbytes for h in hooks] == [3, 3]  # evicted at each other's call
    assert torch.cuda.max_memory_allocated(0) < 2 * room  # never both at once
    for m in (a, b):
        unhook_component(m)


def test_a_cached_component_called_on_another_stream_waits_for_its_copy(fake_cuda):
    module = _net()
    _offloaded(module, Ledger())
    x = torch.ones(2, 8).to("cuda:0")
    torch.cuda.synchronize()
    caller = torch.cuda.Stream("cuda:0")
    caller.wait_stream(torch.cuda.current_stream())

    def on(stream):
        with torch.cuda.stream(stream):
            module(x)

    for stream in (None, caller):  # onloaded on the default stream, kept, then read on the caller's
        thread = threading.Thread(target=on, args=(stream,))
        thread.start()
        thread.join()
    unhook_component(module)


def test_dropping_the_copy_event_is_caught(fake_cuda, monkeypatch):
    # the defect this replaces: the onload's event dropped, a later call on another stream reads too early
    fake_cuda.expect_races = True
    monkeypatch.setattr(OffloadHook, "onload", lambda self: setattr(self, "buffer", self._onload(self.group)[0]))
    module = _net()
    _offloaded(module, Ledger())
    x = torch.ones(2, 8).to("cuda:0")
    module(x)
    with torch.cuda.stream(torch.cuda.Stream("cuda:0")):
        module(x)
    races = fake_cuda.take()
    assert races and {(r.earlier.op, r.later.kind) for r in races} == {("copy_ h2d", "read")}
    unhook_component(module)


@pytest.mark.parametrize("mode", ["offload", "stream"])
def test_reset_right_after_a_call_waits_for_the_copies_out_of_pinned_memory(fake_cuda, mode):
    # the output is left on the GPU (output_type="pt" or "latent"): the host never waited for the copies
    module = _net()
    hook = HOOKS[mode](Placement("vae", "cpu", 1, mode, "cuda:0", 10**6), "cuda:0", Ledger())
    hook_component(module, hook)
    module(torch.ones(2, 8).to("cuda:0"))
    unhook_component(module)  # what pipemap.reset does: the fixture fails on an unregistration with a copy in flight
    assert not fake_cuda.registered


def test_a_vae_upcast_while_cached_holds_nothing_beside_the_planned_room(fake_cuda):
    # SDXL's force_upcast: vae.to(float32) before each decode, back after; bfloat16 stands in for float16 here
    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=(32, 32), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=32).eval()
    vae = vae.to(torch.bfloat16)
    z = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        expected = vae.float().decode(z).sample
    vae = vae.to(torch.bfloat16)
    hook = _offloaded(vae, Ledger(), name="vae")
    z = z.to("cuda:0")
    with torch.no_grad():
        vae.decode(z.to(torch.bfloat16))  # onloaded, and left in its cache
    held = []
    vae.decoder.register_forward_pre_hook(lambda m, a: held.append((torch.cuda.memory_allocated(0),
                                                                    hook.ledger.live["cuda:0"])))
    for _ in range(2):
        vae.to(torch.float32)
        with torch.no_grad():
            out = vae.decode(z).sample
        vae.to(torch.bfloat16)
        assert torch.cuda.memory_allocated(0) - z.numel() * 4 - out.numel() * 4 <= 1024  # nothing kept but z, out
        torch.testing.assert_close(out.cpu(), expected)
    float32 = sum(p.numel() * 4 for p in vae.parameters())
    for allocated, counted in held:  # at decode: the float32 weights in one buffer the ledger counts, no more
        assert float32 <= counted <= allocated <= counted + 16 * 1024
    assert all(fakecuda.on_device(p) is False for p in vae.parameters())
    unhook_component(vae)
