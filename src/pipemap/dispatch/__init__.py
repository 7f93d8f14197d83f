"""Apply a plan to a pipeline in memory, and undo it.

``dispatch`` checks the pipeline against the plan, moves each component's tensors where the plan puts them and
attaches one hook at the root of each component, taken by mode from ``hooks.HOOKS``: the hook moves the component's
inputs to its device and its outputs to the pipeline's execution device, so the pipeline's own ``__call__`` runs
unchanged. ``dispatch`` is atomic: if placing any component fails, every tensor is put back where it was and the
error says which component failed. ``reset`` undoes a dispatch; ``stats`` reads what the hooks counted.

What pipemap keeps on a placed pipeline is one record (``runtime/placed.py``); its class swap, by which calls from
several threads take turns and an assigned model is placed, is ``dispatch/guard.py``. A placed pipeline's models
changed after dispatch are followed here (``follow``, ``change_check``), one component at a time by
``hooks/changes.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..errors import (
    ArgumentTypeError,
    CannotTravelError,
    ComponentChangedError,
    DispatchError,
    PipelineMappedError,
    PlanMismatchError,
)
from ..hooks import (
    Moved,
    PlacementHook,
    give_back_kept,
    hook_component,
    hook_maker,
    ledger_of,
    ranks_report,
    unhook_component,
)
from ..hooks.changes import follow_component, forget, remember, settle, unchanged
from ..hooks.resident import quiet
from ..inventory.live import module_bytes, submodules
from ..modes import Peak, facts, held, moves_weights
from ..plan import Placement, Plan, with_ranks
from ..quantized import movable, storage
from ..runtime.placed import mark, placed, planned, replan, unmark
from ..runtime.streams import Queues, queues_for
from ..runtime.transfer import ensure_safe_transfers, move_tensor, plan_devices, synchronize
from .guard import Around, guard, unguard, unguarded_class


@dataclass(frozen=True)
class Move:
    """One tensor ``place_module`` moved: enough to put it back if the dispatch fails later."""

    owner: torch.nn.Module
    store: str  # "_parameters" or "_buffers"
    key: str
    original: torch.Tensor
    device: torch.device
    data: torch.Tensor | None = None  # a parameter's .data before the move, which the move replaces in place

    def undo(self) -> None:
        # the data it had, not a copy back: nothing to allocate (a failed dispatch may be out of memory), and
        # nothing lost when the move went where data cannot come back from
        if self.data is not None and self.original.data is not self.data:
            self.original.data = self.data
        getattr(self.owner, self.store)[self.key] = self.original


def dispatch(pipe, plan: Plan, *, check_transfers: bool = True, ranks: str | None = None) -> None:
    """Place and hook every component of ``pipe`` as ``plan`` says; the pipeline's own call then runs unchanged.

    When the plan spans two GPUs or more, copies between them are checked first (``pipemap.check_transfers``,
    cached) and a pair that corrupts data is staged through CPU memory; ``check_transfers=False`` skips that.
    ``ranks`` (as ``pipemap.plan`` takes it: ``"auto"``, ``"process"``, ``"thread"``, ``"ray"``) overrides what the
    plan says runs its split's other ranks (``plan.ranks``).

    >>> pipe = DiffusionPipeline.from_pretrained("path/to/sdxl")                  # doctest: +SKIP
    >>> plan = pipemap.plan(pipe, hardware="2x24GiB")                             # doctest: +SKIP
    >>> pipemap.dispatch(pipe, plan); pipe.hf_device_map                          # doctest: +SKIP
    {'text_encoder': 'cuda:1', 'text_encoder_2': 'cuda:1', 'unet': 'cuda:0', 'vae': 'cuda:1'}

    A ``from_pipe`` copy of a placed pipeline runs on that pipeline's plan; dispatching the copy places it on
    ``plan`` instead, and with it the models it shares: the pipeline it was copied from (and its other copies)
    become copies of this one, on ``plan``. A pipeline that ``dispatch`` placed itself is refused: ``pipemap.reset``
    it first.
    """
    check_pipeline(pipe, "dispatch")
    if ranks is not None and isinstance(plan, Plan):
        plan = with_ranks(plan, ranks)
    give_back_kept()  # a plan counts what placed pipelines keep onloaded as free (``hooks.kept_bytes``): given back
    source = _copied_from(pipe)
    if source is None:
        place(pipe, plan, check_transfers=check_transfers)
    else:
        _replace_family(pipe, source, plan, check_transfers)


def _copied_from(pipe):
    """The placed pipeline ``pipe`` is a ``from_pipe`` copy of (its record lists ``pipe``), or None."""
    return next((owner for owner in _owners(pipe) if any(c is pipe for c in _copies(owner))), None)


def _replace_family(pipe, source, plan: Plan, check_transfers: bool) -> None:
    """``pipe``, a copy of the placed ``source``, placed on ``plan``; ``source`` and its other copies made copies of
    ``pipe``. Checked before anything moves; a placement that fails puts the family back on ``source``'s plan."""
    old = planned(source)
    assert old is not None
    _check(pipe, plan, shared=True)
    family = [source, *(c for c in _copies(source) if c is not pipe)]
    reset(source)  # every model of the family unhooked and back on the CPU; each pipeline unmarked
    try:
        place(pipe, plan, check_transfers=check_transfers)
    except Exception:
        place(source, old, check_transfers=False)
        for each in [pipe, *family[1:]]:
            place_copy(source, each)
        raise
    for each in family:
        place_copy(pipe, each)


def place(pipe, plan: Plan, *, check_transfers: bool = True,
          queues: Callable[[torch.device], Queues] = queues_for, loaded: frozenset[str] = frozenset()) -> None:
    """``dispatch``, with ``queues`` making each device's copy queues (the dry run passes its stand-in queues), and
    ``loaded`` the models ``pipemap.load`` itself just loaded: those its plan keeps on the CPU whole are there
    already, every tensor (``from_pretrained`` loads there), so they are not walked (issue 38: load time)."""
    modules = _check(pipe, plan)
    if check_transfers:  # runs (cached) only when the plan spans two GPUs or more; stages corrupted pairs
        ensure_safe_transfers(plan_devices(plan))  # every GPU it copies between: execution GPUs and shards too
    with quiet():  # placing and hooking is no change of the models (``hooks.changes.unchanged``)
        _place_all(pipe, plan, modules, hook_maker(plan, queues), loaded)
    synchronize(plan_devices(plan))  # the placed weights ready for whatever stream calls first
    _take_over(pipe, plan)


def _place_all(pipe, plan: Plan, modules: dict[str, torch.nn.Module], make_hook,
               loaded: frozenset[str] = frozenset()) -> None:
    moves: list[Move] = []
    for placement in plan.components:
        module = modules[placement.component]
        try:
            if not (placement.component in loaded and placement.device == "cpu" and not placement.shards):
                _place(module, placement, moves)  # records each tensor as it moves, so a failure part-way undoes it
            _attach(pipe, module, make_hook(placement))
        except Exception as err:
            _undo(modules.values(), moves)
            if isinstance(err, CannotTravelError):
                raise  # the user's own input (a model that cannot travel to a worker): its own typed error
            raise DispatchError(placement.component, placement.device, err) from err


def reset(pipe) -> None:
    """Remove every pipemap hook and bring every component back to the CPU, as before ``dispatch``.

    >>> pipemap.reset(pipe); pipe.hf_device_map is None                           # doctest: +SKIP
    True
    """
    check_pipeline(pipe, "reset")
    pipes = [pipe, *_owners(pipe)]  # a from_pipe copy shares the models of the pipeline dispatch placed
    pipes += [c for p in list(pipes) for c in _copies(p) if all(c is not q for q in pipes)]
    for module in {id(m): m for p in pipes for m in _modules(p).values()}.values():
        _take_back(module)
    for each in pipes:
        _give_back(each)


def _take_back(module: torch.nn.Module) -> None:
    """``module`` unhooked and back on the CPU, as before dispatch: what was changed in place on the GPU (a fused
    LoRA) kept in its CPU masters, its worker processes stopped (``hooks/workers.py``; a rehook keeps them)."""
    settle(module)
    release = getattr(getattr(module, "_hf_hook", None), "release", None)
    if release is not None:
        release(module)
    unhook_component(module)
    place_module(module, "cpu")
    forget(module)


def _owners(pipe) -> list:
    owners = (getattr(getattr(m, "_hf_hook", None), "owner", None) for m in _modules(pipe).values())
    found = {id(p): p for p in (o() for o in owners if isinstance(o, weakref.ref)) if p is not None}
    return [p for p in found.values() if p is not pipe]


def _copies(pipe) -> tuple:
    record = placed(pipe)
    return () if record is None else tuple(record.copies)


def _give_back(pipe) -> None:
    unguard(pipe)
    unmark(pipe)  # hf_device_map back to the class's None, as before dispatch


def _place(module: torch.nn.Module, placement, moves: list[Move] | None = None) -> list[Move]:
    """A component's tensors onto its planned devices; a split component's blocks straight to theirs, so no GPU
    ever holds the whole of a component that was split because it fits none. Each move is appended to ``moves`` as
    it happens (see ``place_module``)."""
    moves = [] if moves is None else moves
    placed: set[int] = set()
    for path, device, _ in placement.shards:
        block = module.get_submodule(path)
        place_module(block, device, moves=moves)
        placed |= {id(m) for m in block.modules()}
    return place_module(module, placement.device, skip=placed, moves=moves)


def place_module(module: torch.nn.Module, device: str | torch.device, skip: set[int] | frozenset[int] = frozenset(),
                 moves: list[Move] | None = None) -> list[Move]:
    """Move every parameter and buffer not yet on ``device`` there, through the one transfer function; returns what
    it moved, so a failed dispatch can put exactly that back (a load places most tensors already where they go).
    Each move is appended to ``moves`` (when given) before the tensor is replaced, so a failure at any tensor leaves
    the caller a record of every tensor already moved.

    ``module.to`` would do for real tensors, but it reassigns every tensor even when already in place (which fake
    weights of a dry run refuse) and bypasses pipemap's safe-copy routing.
    """
    target = torch.device(device)
    moves = [] if moves is None else moves
    for sub in submodules(module):
        if id(sub) in skip:
            continue
        for key, param in sub._parameters.items():
            if param is not None and param.device != target:
                moves.append(Move(sub, "_parameters", key, param, param.device, param.data))
                _move_parameter(sub, key, param, target)
        for key, buffer in sub._buffers.items():
            if buffer is not None and buffer.device != target:
                moves.append(Move(sub, "_buffers", key, buffer, buffer.device))
                sub._buffers[key] = move_tensor(buffer, target)
    return moves


def _move_parameter(owner: torch.nn.Module, key: str, param: torch.nn.Parameter, target: torch.device) -> None:
    moved = move_tensor(param.data, target)
    try:
        param.data = moved  # keeps the Parameter object, so tied weights stay tied
    except RuntimeError:
        pass
    if param.device != target:  # fake tensors of a dry run refuse (or ignore) .data across devices
        owner._parameters[key] = torch.nn.Parameter(moved, requires_grad=param.requires_grad)


def _check(pipe, plan: Plan, shared: bool = False) -> dict[str, torch.nn.Module]:
    """``plan`` places exactly ``pipe``'s models, which nothing else hooks (``shared``: except pipemap, for a copy's
    family about to be re-placed)."""
    check_pipeline(pipe, "dispatch")
    if not isinstance(plan, Plan):
        raise ArgumentTypeError("plan", plan, "a pipemap.Plan, as pipemap.plan() returns")
    if planned(pipe) is not None and not shared:
        raise PipelineMappedError("dispatching a pipeline that pipemap already placed")
    modules = _modules(pipe)
    for name, module in ({} if shared else modules).items():
        if isinstance(getattr(module, "_hf_hook", None), PlacementHook):
            raise PlanMismatchError(name, "pipemap placed it for another pipeline that shares it (a copy made with "
                                    "from_pipe or from its components): pipemap.follow(pipe) places this one on "
                                    "that plan; to plan anew, pipemap.reset(pipe) (both are reset) and dispatch")
        if getattr(module, "_hf_hook", None) is not None:
            raise PlanMismatchError(name, f"it already carries the hook {type(module._hf_hook).__name__} (from "
                                    "enable_model_cpu_offload or a device_map); call pipe.remove_all_hooks() first")
    planned_names = {p.component for p in plan.components}
    for name in modules:
        if name not in planned_names:
            raise PlanMismatchError(name, "the pipeline has this model but the plan does not place it; re-plan from "
                                    "this pipeline (pipemap.plan(pipe, ...)) or add it to the device map")
    for name in planned_names:
        if name not in modules:
            raise PlanMismatchError(name, f"the plan places it but the pipeline has no such model (it has: "
                                    f"{', '.join(modules)})")
    _check_standins(modules, plan)
    for p in plan.components:
        if moves_weights(p.mode):
            _check_movable(p.component, modules[p.component])
    return modules


def _check_movable(name: str, module: torch.nn.Module) -> None:
    for path, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if not movable(tensor):
            raise PlanMismatchError(name, f"its tensor {path} is a {type(tensor).__name__}, which offload and "
                                    "streaming cannot pack (it keeps state outside its storage); place it resident "
                                    f"(strategy={{{name!r}: 'cuda:0'}}) or quantize it with torchao or quanto")


def check_pipeline(pipe, operation: str) -> None:
    """A diffusers pipeline (anything with a ``components`` dict), or an ``ArgumentTypeError`` naming ``operation``.
    A diffusers pipeline class (its ``components`` a property) passes without building the dict: diffusers
    builds it anew at each read, from the signature of ``__init__`` (issue 38: load time)."""
    kind = type(pipe)
    if getattr(kind, "config_name", None) == "model_index.json" and isinstance(getattr(kind, "components", None),
                                                                               property):
        return
    if not isinstance(getattr(pipe, "components", None), dict):
        raise ArgumentTypeError(f"{operation}(pipe)", pipe, "a loaded diffusers pipeline (DiffusionPipeline)")


def _check_standins(modules: dict[str, torch.nn.Module], plan: Plan) -> None:
    """A plan on stand-in devices (``meta:N``) applies only to a dry run's fake weights: moving real weights to the
    meta device would destroy them."""
    for p in plan.components:
        devices = (p.device, p.execution_device, *(d for _, d, _ in p.shards))
        if any(d.startswith("meta") for d in devices):
            tensor = next(modules[p.component].parameters(), None)
            if tensor is not None and not isinstance(storage(tensor)[0], FakeTensor):  # a quantized one: its data
                raise PlanMismatchError(p.component, "the plan puts it on a dry run's stand-in device (meta), which "
                                        "holds no data: its weights would be lost. Plan for real devices")


def _modules(pipe) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}


def _undo(modules, moves: list[Move]) -> None:
    for module in modules:
        unhook_component(module)
        forget(module)
    for moved in reversed(moves):
        moved.undo()


def _take_over(pipe, plan: Plan) -> None:
    """Record ``pipe`` as placed by ``plan`` and swap its class for the guarded one."""
    _watch_copies()
    mark(pipe, plan)
    guard(pipe, _AROUND)  # calls from several threads take turns: a call's state lives on the pipeline


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
    modules = _modules(made)
    shared = tuple(p for p in plan.components if modules.get(p.component) is getattr(pipe, p.component, None))
    _take_over(made, dataclasses.replace(plan, components=shared))
    record = placed(pipe)
    if record is not None:  # reset of either resets both (weakly held)
        record.copies.add(made)
    follow(made)


# ---- what the hooks counted ----------------------------------------------------------------------------------


def stats(pipe, reset: bool = False) -> dict[str, dict[str, Any]]:
    """What each component's hook counted since dispatch: ``{component: {"calls", "h2d_bytes", "d2h_bytes"}}``;
    for a split component also what runs its other ranks and why (``"ranks"``, ``"ranks_why"``; ``"exchange"``
    where its ranks exchange through host memory: ``hooks.ranks_report``).

    Bytes are weights moved (inputs and outputs are not counted); ``reset=True`` zeroes the counters after reading.

    >>> plan = pipemap.plan(pipe, hardware="cuda:0=8GiB", strategy="balanced_low_memory")      # doctest: +SKIP
    >>> pipemap.dispatch(pipe, plan); pipe("a cat"); pipemap.stats(pipe)["text_encoder"]       # doctest: +SKIP
    {'calls': 2, 'h2d_bytes': 492265168, 'd2h_bytes': 0}
    """
    out = {}
    for name, module in pipe.components.items():
        hook: Any = getattr(module, "_hf_hook", None)
        if isinstance(getattr(hook, "moved", None), Moved):
            out[name] = dataclasses.asdict(hook.moved)
            if reset:
                hook.moved = Moved()
        ranks = ranks_report(hook)
        if ranks:
            out.setdefault(name, {}).update(ranks)
    return out


def onload_peaks(pipe) -> dict[str, int]:
    """The most bytes of offloaded or streamed weights each execution device held at once since dispatch."""
    for module in pipe.components.values():
        ledger = ledger_of(getattr(module, "_hf_hook", None))
        if ledger is not None:
            return dict(ledger.peak)
    return {}


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
        if not follow_component(module, plan.placement(name), _place):
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
        owner = next(iter(_owners(pipe)), None)  # a copy sharing a placed pipeline's models (made by hand)
        if owner is not None and planned(owner) is not None:
            place_copy(owner, pipe)
        return
    placements = {p.component: p for p in plan.components}
    modules = _modules(pipe)
    if set(placements) - set(modules):  # set to None through the config: nothing left to place
        plan = dataclasses.replace(plan, components=tuple(p for p in plan.components if p.component in modules))
    changed = []
    for name, module in modules.items():
        if name not in placements:
            plan = _adopt(pipe, plan, name, module)
        elif not isinstance(getattr(module, "_hf_hook", None), PlacementHook):
            continue  # its hook removed by hand: nothing pipemap placed to follow (a dry run names the device mix)
        elif follow_component(module, placements[name], _place):
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
        _take_back(old)  # its worker processes too: the new module gets its own
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
    make = hook_maker(plan, beside=[getattr(m, "_hf_hook", None) for m in _modules(pipe).values()])
    with quiet():
        _place(module, placement)
        _attach(pipe, module, make(placement))


def _attach(pipe, module: torch.nn.Module, hook: Any) -> None:
    """Hook ``module`` (placed) with ``hook`` for ``pipe``: the hook knows its pipeline (reset of a ``from_pipe`` copy
    finds the pipeline to unmark) and checks its model for changes at each call; the model as it is now is what a
    later change (a LoRA loaded) is compared with."""
    hook_component(module, hook)
    hook.owner = weakref.ref(pipe)
    hook.change_check = change_check(pipe, hook.component)
    remember(module)


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
