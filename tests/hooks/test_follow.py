"""hooks/follow.py: what a model is made of (``signature``), and a placed component brought in line with it after a
change: written back, re-packed, re-hooked; on small modules placed on the CPU."""

from __future__ import annotations

import torch

from pipemap.dispatch import _place
from pipemap.hooks import Ledger, OffloadHook, hook_component, unhook_component
from pipemap.hooks.follow import follow, groups, remember, settle, signature
from pipemap.plan import Placement


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.scale = 1.0

    def forward(self, x):
        return self.second(self.first(x)) * self.scale


def _offloaded(module: torch.nn.Module) -> tuple[OffloadHook, Placement]:
    placement = Placement("model", "cpu", 1 << 20, "offload", "cpu", 1 << 20)
    hook = OffloadHook.for_placement(placement, "cpu", Ledger())
    hook_component(module, hook)
    remember(module)
    return hook, placement


def test_onloading_and_evicting_change_no_signature_but_the_model_does():
    torch.manual_seed(0)
    model = Scaled()
    hook, _ = _offloaded(model)
    before = signature(model)
    model(torch.randn(2, 8))  # onloaded (kept by the LRU cache): new tensors in the modules, masters kept
    assert hook.group.loaded and signature(model) == before
    hook.evict()
    assert signature(model) == before
    model.scale = 0.5
    assert signature(model) != before
    model.scale = 1.0
    with torch.no_grad():
        model.first.weight.copy_(torch.zeros(8, 8))  # load_state_dict's in-place copy: a new version
    assert signature(model) != before
    unhook_component(model)


def test_settle_writes_an_onloaded_change_back_into_the_master():
    torch.manual_seed(0)
    model = Scaled()
    hook, _ = _offloaded(model)
    x = torch.randn(2, 8)
    model(x)  # onloaded
    model.first.weight.data += 1.0  # what fuse_lora does to the weight it finds: the onloaded copy
    want = model(x)
    settle(model)
    unhook_component(model)  # evicts: the masters back in the modules
    torch.testing.assert_close(model(x), want, atol=0, rtol=0)


def test_follow_packs_a_new_layer_into_the_group_and_keeps_the_counts():
    torch.manual_seed(0)
    model = Scaled()
    hook, placement = _offloaded(model)
    x = torch.randn(2, 8)
    model(x)
    model.second = torch.nn.Sequential(model.second, torch.nn.Linear(8, 8))  # a wrapper with new weights
    assert follow(model, placement, _place)
    fresh = model._hf_hook
    assert fresh is not hook and fresh.moved is hook.moved and fresh.lock is hook.lock
    grouped = {id(s.get()) for g in groups(fresh) for s in g.slots}
    assert {id(p) for p in model.parameters()} <= grouped
    assert not follow(model, placement, _place)  # nothing changed since
    out = model(x)
    unhook_component(model)
    torch.testing.assert_close(out, model(x), atol=0, rtol=0)
