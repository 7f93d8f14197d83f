"""A placed pipeline as it changes: its models changed after dispatch followed (``follow``, ``change_check``; one
component at a time by ``hooks/changes.py``), a component replaced (``replace_component``), a model it gained placed,
and its ``from_pipe`` copies placed on its plan (``place_copy``). ``take_over`` records a pipeline as placed and swaps
its class for the guarded one (``guard.py``), which runs ``follow`` before each call: so these live together."""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..errors import ArgumentTypeError, ComponentChangedError
from ..hooks import PlacementHook, hook_component, hook_maker
from ..hooks.changes import follow_component, remember, unchanged
from ..hooks.resident import quiet
from ..inventory.live import module_bytes
from ..modes import Peak, facts, held
from ..plan import Placement, Plan
from ..runtime.placed import mark, placed, planned, replan
from .checks import components
from .guard import Around, guard, unguarded_class
from .moves import place_component
from .resetting import owners, reset, take_back


def take_over(pipe, plan: Plan, lock: Any = None) -> None:
    """Record ``pipe`` as placed by ``plan`` (its calls taking turns by ``lock`` where given, ``runtime.placed.mark``)
    and swap its class for the guarded one."""
    _watch_copies()
    mark(pipe, plan, lock)
    guard(pipe, _AROUND)  # calls from several threads take turns: a call's state lives on the pipeline


def attach(pipe, module: torch.nn.Module, hook: Any) -> None:
    """Hook ``module`` (placed) with ``hook`` for ``pipe``: the hook knows its pipeline (reset of a ``from_pipe`` copy
    finds the pipeline to unmark) and checks its model for changes at each call; the model as it is now is what a
    later change (a LoRA loaded) is compared with."""
    hook_component(module, hook)
    hook.owner = weakref.ref(pipe)
    hook.change_check = change_check(pipe, hook.component)
    remember(module)


# ---- a from_pipe copy of a placed pipeline ---------------------------------------------------------------------

_WATCHING = threading.Lock()


def _watch_copies() -> None:
    """Wrap diffusers' ``DiffusionPipeline.from_pipe`` once per process: a copy of a placed pipeline shares its
    models (and their hooks), and may bring new ones (``controlnet=cn``), which nothing would place."""
    from diffusers import DiffusionPipeline

    with _WATCHING:
        original = DiffusionPipeline.__dict__.get("from_pipe")
        if not isinstance(original, classmethod) or getattr(original.__func__, "_pipemap", False):
            return
        made_by = original.__func__

        @functools.wraps(made_by)
        def from_pipe(cls, pipeline, **kwargs):
            made = made_by(cls, pipeline, **kwargs)
            if planned(pipeline) is not None and planned(made) is None:
                place_copy(pipeline, made)
            return made

        from_pipe._pipemap = True  # type: ignore[attr-defined]
        setattr(DiffusionPipeline, "from_pipe", classmethod(from_pipe))  # noqa: B010 - a classmethod put back


def place_copy(pipe, made) -> None:
    """Place ``made``, a ``from_pipe`` copy of the placed ``pipe``, on ``pipe``'s plan: the models they share stay
    where they are (one hook, one place); a model only the copy has is planned in as ``follow`` places a new one
    (resident where room is left); the copy's calls take turns and follow as the original's do. ``pipemap.reset``
    of either resets both."""
    plan = planned(pipe)
    if plan is None:
        return
    modules = components(made)
    shared = tuple(p for p in plan.components if modules.get(p.component) is getattr(pipe, p.component, None))
    record = placed(pipe)
    # the copy's calls take turns with the original's, by its lock: their shared models' hooks keep one call's state
    # (what is onloaded, a change followed); with a lock of its own a copy's call re-hooked a shared model while
    # another copy's call was entering it (tests/test_everyday_threads.py)
    take_over(made, dataclasses.replace(plan, components=shared), record.lock if record is not None else None)
    if record is not None:  # reset of either resets both (weakly held)
        record.copies.add(made)
    follow(made)


# ---- a placed pipeline whose models change ---------------------------------------------------------------------


def change_check(pipe, name: str) -> Callable[[torch.nn.Module], bool]:
    """What the hook of ``pipe``'s component ``name`` runs at the start of each call (``PlacementHook.change_check``):
    the model's changes since followed (``hooks.changes.follow_component``) and the plan's sizes updated; True when
    it changed. Cheap when nothing changed (``hooks.changes.unchanged``)."""
    owner = weakref.ref(pipe)

    def check(module: torch.nn.Module) -> bool:
        if unchanged(module):
            return False
        found = owner()
        plan = planned(found) if found is not None else None
        if plan is None or name not in plan.device_map:
            return False
        if not follow_component(module, plan.placement(name), place_component):
            return False
        replan(found, _resized(plan, {name: module_bytes(module)}))
        return True

    return check


def follow(pipe) -> None:
    """Bring a placed pipeline in line with its models as they are now (``hooks.changes``); every call of the
    pipeline does it first. A model added since dispatch (an IP-Adapter's image encoder) is placed where room is
    left, and one that no longer fits where it is raises ``ComponentChangedError``.

    >>> pipe.load_lora_weights(folder, weight_name="lora.safetensors")                  # doctest: +SKIP
    >>> pipemap.follow(pipe)   # what pipe(...) does first; the LoRA layers now live where the unet does  # +SKIP
    """
    plan = planned(pipe)
    if plan is None:
        owner = next(iter(owners(pipe)), None)  # a copy sharing a placed pipeline's models (made by hand)
        if owner is not None and planned(owner) is not None:
            place_copy(owner, pipe)
        return
    placements = {p.component: p for p in plan.components}
    modules = components(pipe)
    if set(placements) - set(modules):  # set to None through the config: nothing left to place
        plan = dataclasses.replace(plan, components=tuple(p for p in plan.components if p.component in modules))
    changed = []
    for name, module in modules.items():
        if name not in placements:
            plan = _adopt(pipe, plan, name, module)
        elif not isinstance(getattr(module, "_hf_hook", None), PlacementHook):
            continue  # its hook removed by hand: nothing pipemap placed to follow (a dry run names the device mix)
        elif follow_component(module, placements[name], place_component):
            changed.append(name)
    if changed:
        plan = _resized(plan, {n: module_bytes(getattr(pipe, n)) for n in changed})
    replan(pipe, plan)


def replace_component(pipe, name: str, module) -> None:
    """Put ``module`` in place of the placed pipeline's component ``name`` (``pipe.unet = module`` does the same),
    placed as the old one was; the old one is unhooked and back on the CPU. ``None`` removes the component.
    ``pipemap.replace`` is its old name (the same function).

    >>> pipemap.replace_component(pipe, "unet", other_unet)                              # doctest: +SKIP
    """
    plan = planned(pipe)
    if plan is None or name not in plan.device_map:
        raise ComponentChangedError(name, "it is not a component pipemap placed on this pipeline",
                                    "assign it as usual; pipemap.dispatch places a pipeline that has no plan")
    if module is not None and not isinstance(module, torch.nn.Module):
        raise ArgumentTypeError(f"replace_component(pipe, {name!r}, module)", module, "a torch module, or None")
    placement = plan.placement(name)
    if module is not None:
        _check_room(plan, placement, module)
    old = getattr(pipe, name, None)
    if isinstance(old, torch.nn.Module):
        take_back(old)  # its worker processes too: the new module gets its own
    setattr_of: Any = unguarded_class(pipe).__setattr__
    setattr_of(pipe, name, module)
    if module is None:
        plan = dataclasses.replace(plan, components=tuple(p for p in plan.components if p.component != name))
    else:
        _hook_new(pipe, plan, placement, module)
        plan = _resized(plan, {name: module_bytes(module)})
    replan(pipe, plan)


replace = replace_component  # the old public name (``pipemap.replace``), kept: read it as ``replace_component``
_AROUND = Around(follow=follow, replace=replace_component, reset=reset)  # what the guarded class runs of ours


def _check_room(plan: Plan, placement: Placement, module: torch.nn.Module) -> None:
    size = module_bytes(module)
    peak = facts(placement.mode).peak
    if peak is Peak.ONLOADED:  # it must fit the room its GPU keeps for onloaded ones
        need, room = size, placement.room
    else:  # what it holds at home must fit its device's budget beside the rest (streamed: its room was planned)
        use = next((d for d in plan.devices if d.device == placement.device), None)
        if use is None or peak is Peak.STREAMED:
            return
        need = held(dataclasses.replace(placement, bytes=size), placement.device)
        room = use.budget - use.used + held(placement, placement.device)
    if need > room:
        raise ComponentChangedError(placement.component, f"the new model needs {size} bytes and its placement has "
                                    f"room for {room}", "pipemap.reset(pipe), assign it, then "
                                    "pipemap.dispatch(pipe, pipemap.plan(pipe, ...))")


def _hook_new(pipe, plan: Plan, placement: Placement, module: torch.nn.Module) -> None:
    """Place and hook ``module`` as ``placement`` says, sharing the dispatch's ledger and moving lock."""
    make = hook_maker(plan, beside=[getattr(m, "_hf_hook", None) for m in components(pipe).values()])
    with quiet():
        place_component(module, placement)
        attach(pipe, module, make(placement))


def _adopt(pipe, plan: Plan, name: str, module: torch.nn.Module) -> Plan:
    """A model the pipeline gained after dispatch, placed resident on the device with the most room left for it."""
    size = module_bytes(module)
    rooms = sorted(((d.budget - d.used, d.device) for d in plan.devices if d.device != "cpu"), reverse=True)
    rooms = rooms or [(next((d.budget - d.used for d in plan.devices), 0), "cpu")]
    room, device = rooms[0]
    if size > room:
        raise ComponentChangedError(name, f"the pipeline gained it after dispatch; it needs {size} bytes and the "
                                    f"most room left is {room} on {device}",
                                    "pipemap.reset(pipe), then pipemap.dispatch(pipe, pipemap.plan(pipe, ...))")
    placement = Placement(name, device, size)
    # its use counted as every other placement's (``modes.device_use``)
    plan = plan.with_components((*plan.components, placement),
                                notes=(*plan.notes, f"{name}: added after dispatch, placed on {device}"))
    _hook_new(pipe, plan, placement, module)
    return plan


def _resized(plan: Plan, sizes: dict[str, int]) -> Plan:
    """``plan`` with the bytes of the components of ``sizes`` as they are now; each device's use moves by as much
    (a replicated denoiser's copies too; a split one's growth counted on its home GPU)."""
    return plan.with_components(tuple(dataclasses.replace(p, bytes=sizes.get(p.component, p.bytes))
                                      for p in plan.components))
