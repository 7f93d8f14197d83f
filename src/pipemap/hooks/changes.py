"""A placed component whose model changed after dispatch: LoRA loaded, switched, fused, unfused or deleted, an
IP-Adapter's projections, fused QKV projections, FreeU, ``load_state_dict``.

Each call of a placed component first asks ``unchanged`` (cheap: ``Seen``); only when that cannot say, the model
is compared with what it was when last placed (``Signature``: every tensor it holds, with its version
counter, and its module tree; for a component with copies also the plain state of every module: peft's active
adapters, scales and merged adapters, FreeU's factors, attention processors, which a copy has to share and a placed
model keeps where it is). On a change:

- a resident or split component gets its new tensors moved onto their devices;
- an offloaded or streamed one first writes what its onloaded copies hold back into the CPU masters (``fuse_lora``
  writes into the copy it finds, the one on the GPU), then gets a new hook over its tensors as they are now: every
  new tensor packed into its group (or block), the old groups unpinned;
- a component with copies (replicated, guidance branches, sequence shards) gets its copies made again from the home
  copy.

Why not diffusers' own bookkeeping: it follows none of this either (``enable_model_cpu_offload`` users re-enable
offload after loading a LoRA); and a copy of the model on another GPU, which only pipemap makes, shares no state with
its original.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..inventory.live import submodules
from ..plan import Placement
from ..quantized import restored, storage
from ..runtime.transfer import move_tensor
from .resident import PlacementHook, epoch, hook_component, quiet, unhook_component, unsigned, watch_changes

if TYPE_CHECKING:
    from .packing import Group

Place = Callable[[torch.nn.Module, Placement], Any]  # a component's tensors onto the devices of its placement

# what a module's __dict__ holds that is no state of the model: torch's own bookkeeping, the hooks' traces, a
# compiled call (a replica runs uncompiled), diffusers' hook registry (made by a pipeline's first ``cache_context``,
# empty then; a cache enabled in it sets ``_cache_config``, which is state)
_NOT_STATE = frozenset(torch.nn.Module().__dict__) | {
    "_hf_hook", "_old_forward", "forward", "encode", "decode", "tiled_encode", "tiled_decode", "_compiled_call_impl",
    "_pipemap_seen", "_diffusers_hook"}


@dataclass(frozen=True)
class Signature:
    """What a component's model is made of, as a digest: each tensor it holds (identity, version) and each module's
    plain state, hashed as they are met. Kept as a digest, not as those tuples: a tuple per tensor and per module
    state, kept on every component, was most of the memory a load added over diffusers' (issue 28); two signatures
    of one model that differ hash alike with odds of 2**-64."""

    tensors: int
    modules: int
    digest: int


def signature(module: torch.nn.Module, state: bool | None = None) -> Signature:
    """``module`` as its hook last saw it: an onloaded tensor counts as its CPU master, so onloading and evicting
    change nothing, and an in-place write into the master (``load_state_dict``) changes its version. ``state``: the
    modules' plain state too (``_state``); None: where its hook keeps copies of it (``_with_state``).

    One hash per module, of tuples built in comprehensions: every dispatch and every pipeline call takes this of
    every component, and a hash per tensor and a sorted state were a third of its time (issue 28: load time)."""
    masters = _masters(getattr(module, "_hf_hook", None))
    state = _with_state(module) if state is None else state
    tensors = modules = digest = 0
    for sub in submodules(module):
        found = sub.__dict__
        params, buffers = _held(found["_parameters"], masters), _held(found["_buffers"], masters)
        children = tuple([(name, id(child)) for name, child in found["_modules"].items()])
        digest = hash((digest, id(sub), type(sub), params, buffers, children, _state(found) if state else 0))
        tensors += len(params) + len(buffers)
        modules += 1
    return Signature(tensors, modules, digest)


def _held(store: dict[str, torch.Tensor | None], masters: dict[int, torch.Tensor]
          ) -> tuple[tuple[str, int, int], ...]:
    """``(key, identity, version)`` of each tensor in a module's ``_parameters`` or ``_buffers``, as its master."""
    if not store:
        return ()
    if masters:
        store = {key: masters.get(id(tensor), tensor) for key, tensor in store.items()}
    return tuple([(key, id(tensor), tensor._version) for key, tensor in store.items() if tensor is not None])


def _masters(hook: Any) -> dict[int, torch.Tensor]:
    return {id(s.onloaded): s.master for g in groups(hook) if g.loaded for s in g.slots
            if s.onloaded is not None and s.master is not None}


def _state(found: dict[str, Any]) -> int:
    """A hash of a module's plain state: its ``__dict__`` less torch's own bookkeeping (``_NOT_STATE``), in any
    order. Values hash as themselves where they can (numbers, strings, tuples of them; an object by identity: an
    attention processor replaced or kept); a dict or list by its contents (``_frozen``)."""
    items = [(key, found[key]) for key in found.keys() - _NOT_STATE]
    try:
        return hash(frozenset(items))
    except TypeError:  # a value that does not hash (a list, a dict)
        return hash(frozenset([(key, _frozen(value)) for key, value in items]))


_PLAIN = (bool, int, float, str, torch.dtype, torch.device)


def _frozen(value: Any, depth: int = 3) -> Any:
    if value is None or type(value) in _PLAIN or isinstance(value, _PLAIN):  # the exact type first: the usual case
        return value
    if depth and isinstance(value, dict):
        return ("dict", tuple((str(k), _frozen(v, depth - 1)) for k, v in value.items()))
    if depth and isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return (type(value).__name__, tuple(_frozen(v, depth - 1) for v in items))
    return (type(value).__name__, id(value))  # an object (an attention processor): replaced or kept


def groups(hook: Any) -> list[Group]:
    """The groups of tensors a moving hook moves (none for the others)."""
    # asked of the hook, not by its class: this module (imported by dispatch) then needs no hook module beyond the
    # resident one, and a plan that moves nothing imports no moving code (issue 28)
    return hook.moved_groups() if isinstance(hook, PlacementHook) else []


class Seen:
    """A component as last placed: its ``Signature``, and what the cheap check at each call reads (``unchanged``):
    the change counter then (``resident.epoch``) and the sum of its tensors' version counters (each only grows, so
    an in-place write into any of them, ``load_state_dict`` or ``weight.mul_(2)``, moves the sum).

    The signature is taken late: just before the next change to any module lands (``resident.unsigned``), or when
    asked for. Until the counter moves no module changed, so the model is still as placed, but for in-place writes,
    which the version sum tells: if it moved, the signature is ``CHANGED``, equal to none. A load, and calls that
    change nothing, then hash no model (issue 38: load time)."""

    __slots__ = ("_signature", "epoch", "tensors", "versions", "_module", "__weakref__")

    def __init__(self, module: torch.nn.Module):
        self.tensors = _tensors(module)  # as their masters, like the signature: onloading changes nothing
        self.epoch = epoch()
        self.versions = _versions(self.tensors)
        self._signature: Signature | object | None = None
        self._module = weakref.ref(module)
        unsigned(self)

    @property
    def signature(self) -> Signature | object:
        if self._signature is None:
            self.sign()
        return self._signature

    def sign(self) -> None:
        """Take the signature now (no change has landed since placing, unless the counter moved: see above)."""
        if self._signature is not None:
            return
        module = self._module()
        placed_as_now = self.epoch == epoch() and _versions(self.tensors) == self.versions
        self._signature = signature(module) if module is not None and placed_as_now else CHANGED

    def unchanged(self) -> bool:
        return self.epoch == epoch() and _versions(self.tensors) == self.versions

    def settle(self) -> None:
        """What a call of the model wrote into its own tensors is no change (the signature's versions are not
        compared again unless the counter moves; then the whole signature is). A signature not taken yet is then
        taken with them: the call's check found the model as placed, so only the call wrote them."""
        self.versions = _versions(self.tensors)


CHANGED = object()  # the signature of a model changed before its signature was taken: equal to no signature


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of ``module``, as its master where its hook has it onloaded."""
    masters = _masters(getattr(module, "_hf_hook", None))
    found = []
    for sub in submodules(module):
        for store in (sub.__dict__["_parameters"], sub.__dict__["_buffers"]):
            if store:
                found += [masters.get(id(t), t) for t in store.values() if t is not None]
    return found


def _versions(tensors: list[torch.Tensor]) -> int:
    return sum([t._version for t in tensors])


def remember(module: torch.nn.Module) -> None:
    """Record ``module`` as placed now (after ``dispatch`` hooked it, or after a follow)."""
    watch_changes()
    module.__dict__["_pipemap_seen"] = Seen(module)


def unchanged(module: torch.nn.Module) -> bool:
    """Whether ``module`` is surely as last placed: nothing changed any module since (outside placed calls) and no
    tensor of it was written in place. Cheap (a sum of version counters); False means "compare its signature"."""
    seen = module.__dict__.get("_pipemap_seen")
    return seen is not None and seen.unchanged()


def _with_state(module: torch.nn.Module) -> bool:
    """Whether a change of the modules' plain state alone is followed: only where the hook keeps copies of the
    model. A model placed, moved or streamed keeps its state where it is, so such a change needs nothing; leaving it
    out halves the signature a load and each call take (issue 28)."""
    return bool(getattr(getattr(module, "_hf_hook", None), "keeps_copies", False))


def forget(module: torch.nn.Module) -> None:
    module.__dict__.pop("_pipemap_seen", None)


def follow_component(module: torch.nn.Module, placement: Placement, place: Place) -> bool:
    """Bring a placed component's hook and tensors in line with its model as it is now; True if it had changed."""
    seen = module.__dict__.get("_pipemap_seen")
    if seen is not None and seen.unchanged():
        return False
    hook = getattr(module, "_hf_hook", None)
    # under the component's call lock: a from_pipe copy shares the model, and its call (under a call lock of its
    # own) may be running it; read and re-hooked under that call, the model looks changed (its weights onloaded)
    # and its hook would go from under it
    lock = hook.lock if isinstance(hook, PlacementHook) else contextlib.nullcontext()
    with lock, quiet():  # pipemap's own placing is no change of the model
        if seen is not None and signature(module) == seen.signature:
            remember(module)  # the counter moved for another model, or a write left it as it was: seen now
            return False
        if isinstance(hook, PlacementHook) and hook.rehooked_on_change:
            rehook(module, hook, placement, place)
        else:
            place(module, placement)
        remember(module)
    return True


def rehook(module: torch.nn.Module, hook: PlacementHook, placement: Placement, place: Place) -> None:
    """A new hook of the same kind over ``module`` as it is now: the onloaded copies written back, the old hook
    removed (masters back in place, buffers unpinned), every tensor placed anew, then hooked again."""
    settle(module)
    fresh = hook.renewed(placement)
    fresh.lock, fresh.moved = hook.lock, hook.moved  # one lock with the hooks it takes turns with; counts go on
    fresh.change_check = hook.change_check
    unhook_component(module)
    place(module, placement)
    hook_component(module, fresh)


def settle(module: torch.nn.Module) -> None:
    """Write what the onloaded copies of ``module`` hold back into their CPU masters: an in-place change made while
    they were onloaded (``fuse_lora``, ``unfuse_lora``) then survives eviction and ``reset``."""
    for group in groups(getattr(module, "_hf_hook", None)):
        if not group.loaded:
            continue
        for slot in group.slots:
            current, master = slot.get(), slot.master
            assert master is not None  # loaded groups have their masters
            if current is not slot.onloaded:  # the model put a new tensor there: it is the master now
                slot.master = _on_host(current)
            elif _same_layout(current, master):
                for into, source in zip(storage(master), storage(current)):
                    into.detach().copy_(source.detach())
            else:
                slot.master = _on_host(current)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return type(a) is type(b) and [(t.dtype, t.shape) for t in storage(a)] == [(t.dtype, t.shape) for t in storage(b)]


def _on_host(tensor: torch.Tensor) -> torch.Tensor:
    return restored(tensor, [move_tensor(t.detach(), torch.device("cpu")) for t in storage(tensor)])
