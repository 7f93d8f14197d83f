"""hooks/changes.py: what a model is made of (``signature``), and a placed component brought in line with it after a
change: written back, re-packed, re-hooked; on small modules placed on the CPU."""

from __future__ import annotations

import threading
import time

import torch

from pipemap.dispatch import place_component as _place
from pipemap.hooks import Ledger, OffloadHook, ReplicaHook, changes, hook_component, unhook_component
from pipemap.hooks.changes import follow_component, groups, remember, settle, signature
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
    with_state = signature(model, state=True)
    model.scale = 0.5  # plain state: an offloaded model keeps it where it is; followed only where a hook keeps copies
    assert signature(model) == before and signature(model, state=True) != with_state
    model.scale = 1.0
    with torch.no_grad():
        model.first.weight.copy_(torch.zeros(8, 8))  # load_state_dict's in-place copy: a new version
    assert signature(model) != before
    unhook_component(model)


class _Processor:
    """An attention processor: an object kept by identity."""


def test_signature_sees_every_kind_of_state_a_pipeline_changes():
    """Each change the pipelines make is seen (a plain value, an object replaced, a list or dict written into in
    place, a tensor replaced or added, a child replaced), and a model untouched keeps its signature."""
    model = Scaled()
    model.processor, model.adapters, model.factors = _Processor(), ["default"], {"b1": 1.2}
    changes = [
        lambda m: setattr(m, "scale", 2.0),
        lambda m: setattr(m, "processor", _Processor()),
        lambda m: m.adapters.append("style"),  # peft's active adapters: a list written into
        lambda m: m.factors.update(b1=1.3),  # FreeU's factors
        lambda m: setattr(m.first, "weight", torch.nn.Parameter(m.first.weight.detach().clone())),
        lambda m: m.first.register_buffer("mask", torch.ones(8)),
        lambda m: setattr(m, "second", torch.nn.Linear(8, 8)),
        lambda m: setattr(m.first, "in_features", 9),
    ]
    for change in changes:
        before = signature(model, state=True)
        assert signature(model, state=True) == before
        change(model)
        assert signature(model, state=True) != before, change
    assert signature(model) == signature(model, state=False)  # no hook keeping copies: tensors and tree only


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
    assert follow_component(model, placement, _place)
    fresh = model._hf_hook
    assert fresh is not hook and fresh.moved is hook.moved and fresh.lock is hook.lock
    grouped = {id(s.get()) for g in groups(fresh) for s in g.slots}
    assert {id(p) for p in model.parameters()} <= grouped
    assert not follow_component(model, placement, _place)  # nothing changed since
    out = model(x)
    unhook_component(model)
    torch.testing.assert_close(out, model(x), atol=0, rtol=0)


def test_a_plain_state_change_is_followed_only_where_the_hook_keeps_copies():
    """An offloaded model keeps its state where it is: a new scale needs nothing. A replicated one runs part of each
    call on a copy, which must get the new scale: its copies are made again."""
    torch.manual_seed(0)
    x = torch.randn(2, 8)
    offloaded = Scaled()
    _, placement = _offloaded(offloaded)
    offloaded.scale = 0.5
    assert not follow_component(offloaded, placement, _place)
    replicated = Scaled()
    replicated.load_state_dict(offloaded.state_dict())
    hook = ReplicaHook("model", "cpu", "cpu", ("cpu",))
    hook_component(replicated, hook)
    remember(replicated)
    copy = hook.replicas[0]
    replicated.scale = 0.5
    copies = Placement("model", "cpu", 1 << 20, "replicated", "cpu", replicas=("cpu",))
    assert follow_component(replicated, copies, _place)
    assert replicated._hf_hook.replicas[0] is not copy and replicated._hf_hook.replicas[0].scale == 0.5
    halves = torch.cat([offloaded(x[:1]), offloaded(x[1:])])  # a row at a time, as the replica splits the batch
    torch.testing.assert_close(replicated(x), halves, atol=0, rtol=0)  # both halves at the new scale
    unhook_component(offloaded)
    unhook_component(replicated)


def _replicated() -> tuple[Scaled, Placement]:
    model = Scaled()
    hook_component(model, ReplicaHook("model", "cpu", "cpu", ("cpu",)))
    remember(model)
    return model, Placement("model", "cpu", 1 << 20, "replicated", "cpu", replicas=("cpu",))


def test_a_placed_model_is_signed_just_before_the_next_change_to_any_module_lands(monkeypatch):
    """Placing takes no signature (a load, and calls that change nothing, hash no model): the first change to any
    module takes it first, of the model as placed. A change to another model is then no change of this one; a change
    to this one, made first after placing or later, is followed."""
    torch.manual_seed(0)
    signed: list[torch.nn.Module] = []
    taken = changes.signature
    monkeypatch.setattr(changes, "signature", lambda module, state=None: signed.append(module) or taken(module, state))
    model, copies = _replicated()
    model(torch.randn(2, 8))  # a call that changes nothing takes none either
    assert signed == []
    Scaled()  # building another module sets its attributes: the first change since placing
    assert signed == [model]
    assert not follow_component(model, copies, _place)  # the counter moved for another model
    model.scale = 0.5  # the record made again just above is signed before this lands
    assert follow_component(model, copies, _place) and model._hf_hook.replicas[0].scale == 0.5
    first, copies = _replicated()
    first.scale = 0.25  # the first change after placing is to the model itself
    assert follow_component(first, copies, _place) and first._hf_hook.replicas[0].scale == 0.25
    unhook_component(model)
    unhook_component(first)


def test_an_in_place_write_before_the_signature_is_taken_is_followed():
    """A write into a tensor moves no counter, only its version: the signature taken after it (at the next change
    of any module, or when follow asks) cannot be the model as placed, so it equals none and the copies are made
    again from the model as written."""
    torch.manual_seed(0)
    x = torch.randn(2, 8)
    for then in (lambda: None, Scaled):  # follow asks first; another module changes first
        model, copies = _replicated()
        with torch.no_grad():
            model.first.weight.mul_(2)
        then()
        assert model.__dict__["_pipemap_seen"].signature is changes.CHANGED
        assert follow_component(model, copies, _place)
        copy = model._hf_hook.replicas[0]
        torch.testing.assert_close(copy.first.weight, model.first.weight, atol=0, rtol=0)
        unhook_component(model)
        torch.testing.assert_close(copy(x), model(x), atol=0, rtol=0)


def test_a_change_another_thread_makes_while_a_signature_is_taken_waits_for_it(monkeypatch):
    """The first change after placing signs what waits; a change made meanwhile by another thread lands only after
    that signature is taken, else the signature would hold it and the change would never be followed."""
    torch.manual_seed(0)
    model, copies = _replicated()
    signing, taken = threading.Event(), changes.signature

    def slow(module, state=None):
        signing.set()
        time.sleep(0.3)  # the other thread's change comes now
        return taken(module, state)

    monkeypatch.setattr(changes, "signature", slow)
    signer = threading.Thread(target=Scaled)  # building a module: the first change since placing
    signer.start()
    assert signing.wait(5)
    model.scale = 0.5
    signer.join()
    monkeypatch.setattr(changes, "signature", taken)
    assert follow_component(model, copies, _place) and model._hf_hook.replicas[0].scale == 0.5
    unhook_component(model)
