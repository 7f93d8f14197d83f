"""Pinned host buffers live exactly as long as their group, under the fake CUDA (tests/fakecuda.py), whose driver
answers a registration overlapping a live one with error 712: unregistered by reset, by the group's collection
(``del pipe`` without reset), and by a dispatch that fails part-way; never for an empty group."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import pipemap
from helpers import plain_pipeline
from pipemap.hooks import HOOKS, Ledger, hook_component, packing, unhook_component
from pipemap.plan import DeviceUse, Placement, Plan


def _plan(models, mode: str) -> Plan:
    return Plan("test", tuple(Placement(n, "cpu", 1, mode, "cuda:0", 10**9) for n in models),
                (DeviceUse("cuda:0", 10**10, 10**10, 0), DeviceUse("cpu", 10**10, 10**10, 0)), "cuda:0")


def _models(pipe) -> list[str]:
    return [n for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)]


@pytest.mark.slow  # over 2 s: out of the quick subset
@pytest.mark.parametrize("mode", ["offload", "stream"])
def test_a_pipeline_dropped_without_reset_leaves_nothing_pinned(fake_cuda, tiny_folders, mode):
    pipe = plain_pipeline(tiny_folders["sd"])
    pipemap.dispatch(pipe, _plan(_models(pipe), mode))
    assert fake_cuda.registered and packing.pinned_bytes() == sum(fake_cuda.registered.values())
    alive = weakref.ref(pipe)
    del pipe  # a notebook cell run again, a service reloading its model
    gc.collect()
    assert alive() is None and not fake_cuda.registered and packing.pinned_bytes() == 0


@pytest.mark.slow
def test_components_dropped_without_reset_never_meet_a_stale_registration(fake_cuda):
    # before, the freed-but-registered addresses came back to the next group within a few rounds: error 712
    for _ in range(5):
        net = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4)))
        hook_component(net, HOOKS["offload"](Placement("te", "cpu", 1, "offload", "cuda:0", 10**6), "cuda:0",
                                             Ledger()))
        net(torch.ones(1, 64, device="cuda:0"))
        del net
        gc.collect()
        assert not fake_cuda.registered


def test_a_dispatch_refused_part_way_leaves_nothing_registered(fake_cuda, tiny_folders, monkeypatch):
    pipe = plain_pipeline(tiny_folders["sd"])
    before = {n: sorted(vars(getattr(pipe, n))) for n in _models(pipe)}
    real, count = fake_cuda.cudart.cudaHostRegister, []

    def fourth_refused(ptr, size, flags):
        count.append(1)
        return 2 if len(count) == 4 else real(ptr, size, flags)  # cudaErrorMemoryAllocation

    monkeypatch.setattr(fake_cuda.cudart, "cudaHostRegister", fourth_refused)
    with pytest.raises(pipemap.DispatchError, match="CUDA error"):
        pipemap.dispatch(pipe, _plan(_models(pipe), "stream"))
    assert len(count) == 4 and not fake_cuda.registered and packing.pinned_bytes() == 0
    assert {n: sorted(vars(getattr(pipe, n))) for n in _models(pipe)} == before  # no _old_forward left either


def test_a_block_of_empty_tensors_is_streamed_without_pinning(fake_cuda):
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Identity(), torch.nn.Linear(8, 8))
    net[1].register_buffer("nothing", torch.empty(0))
    expected = net(torch.ones(2, 8))
    pieces = (("0", 288), ("1", 0), ("2", 288))
    hook = HOOKS["stream"](Placement("te", "cpu", 1, "stream", "cuda:0", 288, (), pieces, (), 0, 1), "cuda:0", Ledger())
    hook_component(net, hook)
    empty = hook.blocks[1]
    assert empty.slots and empty.layout.nbytes == 0 and empty.host is None  # the driver refuses size 0
    torch.testing.assert_close(net(torch.ones(2, 8, device="cuda:0")).cpu(), expected)
    assert len(fake_cuda.registered) == 2
    unhook_component(net)
