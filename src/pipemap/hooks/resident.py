"""A resident component (mode ``"resident"``): ``PlacementHook`` moves its inputs to the component's device and its
outputs to the pipeline's execution device. Every other pipemap hook derives from it.

Also here: attaching a hook to a component (``hook_component``: at its root, around the VAE methods diffusers routes
through ``apply_forward_hook``, with the component's call lock) and removing every trace of it
(``unhook_component``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module
from diffusers.utils.accelerate_utils import apply_forward_hook

from ..inventory.live import near_submodules, submodules
from ..runtime.admission import component_call
from ..runtime.transfer import move


@dataclass
class Moved:
    """What a component's hook counted: calls, and weight bytes moved host to device and back."""

    calls: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0


class CallLock:
    """A re-entrant lock a component's hook holds for the whole of each call, so calls from several threads (
    ``pipemap.run_many``) take turns on a component while different components run at once. A copy (a dry run
    deep-copies hooked modules) gets a lock of its own."""

    def __init__(self):
        self._lock = threading.RLock()

    def __enter__(self):
        self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()

    def __deepcopy__(self, memo) -> CallLock:
        return CallLock()


class PlacementHook(ModelHook):
    """Inputs to ``device``; outputs to the pipeline's execution device.

    ``execution_device`` is the attribute diffusers' ``DiffusionPipeline._execution_device`` reads from the first
    hooked component: it names the pipeline's execution device (where latents and embeddings live), which is why
    every pipemap hook carries that one, and the component's own device is ``device``.
    """

    rehooked_on_change = False  # a changed model gets a new hook (``changes.rehook``), not just its tensors placed
    # set by dispatch: at the start of each call, brings the component in line with its model if it changed since
    # (``dispatch.change_check``); True when it followed a change (the hook may have been replaced)
    change_check: Callable[[torch.nn.Module], bool] | None = None
    keeps_copies = False  # its calls run on copies of the model too: a change of plain state alone is followed

    def __init__(self, component: str, device: str, execution_device: str):
        self.component = component
        self.device = torch.device(device)
        self.execution_device = torch.device(execution_device)
        self.moved = Moved()
        self.lock = CallLock()
        self.inside = 0  # calls of this component running now (its root, a VAE method, a submodule called directly)
        self.written: list[list] = []  # per running call: the argument lists and dicts a move copied

    def pre_forward(self, module, *args, **kwargs):
        self.moved.calls += 1
        moved = move(args, self.device), move(kwargs, self.device)
        self.written.append(copied_containers((args, kwargs), moved))
        return moved

    def post_forward(self, module, output):
        if self.written:
            _write_back(self.written.pop())
        return move(output, self.execution_device)

    def enter_part(self, module, *args, **kwargs):
        """A submodule of the component called directly by pipeline code: as a call of the component."""
        return self.pre_forward(module, *args, **kwargs)

    def leave_part(self, module, output):
        return self.post_forward(module, output)

    def __repr__(self) -> str:
        return f"PlacementHook({self.component!r}, device={self.device}, execution_device={self.execution_device})"

    @classmethod
    def for_placement(cls, p, execution_device: str, ledger) -> PlacementHook:
        """The hook of a resident placement (``hooks.HOOKS``)."""
        return cls(p.component, p.device, execution_device)

    def renewed(self, p) -> PlacementHook:
        """A new hook of this one's kind for placement ``p`` (a changed model is hooked anew: ``changes.rehook``)."""
        return type(self).for_placement(p, str(self.execution_device), getattr(self, "ledger", None))

    def moved_groups(self) -> list:
        """The groups of tensors this hook moves to its device at each call (``packing.Group``): none here."""
        return []


def copied_containers(given, moved) -> list[tuple]:
    """The argument lists and dicts that moving the inputs copied (they held tensors elsewhere), with what the copy
    held: a callee may write into them. Wan's VAE passes its causal-convolution cache (``feat_cache``) and its
    position in it as lists that each block fills in; a block on another GPU must fill the caller's list."""
    pairs = list(zip(given[0], moved[0])) + [(v, moved[1][k]) for k, v in given[1].items()]
    return [(old, new, list(new) if isinstance(new, list) else dict(new)) for old, new in pairs
            if isinstance(old, (list, dict)) and type(new) is type(old) and new is not old]


def _write_back(copied: list[tuple]) -> None:
    """What the callee wrote into the copies of its argument lists and dicts, written into the caller's own."""
    for old, new, before in copied:
        if isinstance(new, list):
            for i, item in enumerate(new):
                if i < len(before) and item is before[i]:
                    continue
                if i < len(old):
                    old[i] = item
                else:
                    old.append(item)
        else:
            old.update({k: v for k, v in new.items() if k not in before or v is not before[k]})


# diffusers' VAEs run `encode`/`decode` through `apply_forward_hook`, which calls `pre_forward(module)` with no
# arguments, so inputs would stay where they are; those methods get a wrapper of their own (found by this code).
_FORWARD_HOOK_CODE = apply_forward_hook(lambda self: None).__code__


def hook_component(module: torch.nn.Module, hook: ModelHook) -> None:
    """Attach ``hook`` at the component's root, to the methods diffusers routes through ``apply_forward_hook``, and
    to the submodules pipeline code may call directly (``_Entry``).

    A call that raises skips accelerate's ``post_forward``: a forward hook that always runs then tells the hook
    (``abort``, where it has one), so an offloaded or streamed component leaves nothing onloaded. Each call goes
    through ``admission.component_call``: the component's lock, and inside ``run_many`` or serve the memory its
    activations need (the hook is read there, at the call: an out-of-memory move may hook the module anew).
    """
    try:
        add_hook_to_module(module, hook)
    except BaseException:  # init_hook refused (a pinned registration, say): accelerate left its _old_forward
        module.__dict__.pop("_old_forward", None)
        raise
    if hasattr(hook, "abort"):
        hook.abort_handle = module.register_forward_hook(_aborting(hook), always_call=True)
    # accelerate's forward runs pre_forward, the call and post_forward; the lock spans them, exceptions included
    module.forward = functools.update_wrapper(functools.partial(_locked, module, module.forward), module.forward)
    for name in _hooked_methods(module):
        module.__dict__[name] = _wrap_method(module, getattr(type(module), name), hook)
    entry = _Entry(hook, module)
    for sub in near_submodules(module, ENTRY_DEPTH):  # the root is hooked itself
        sub.register_forward_pre_hook(entry.before, prepend=True, with_kwargs=True)
        sub.register_forward_hook(entry.after, with_kwargs=True, always_call=True)


# how deep below a component's root a submodule gets an entry: pipeline code reaches two levels in at most
# (``text_encoder.vision_tower``, ``text_encoder.text_model.final_layer_norm``); deeper modules would pay a hook check
# at every call of every layer for nothing
ENTRY_DEPTH = 2


class _Entry:
    """A submodule that pipeline code calls directly (Motif's ``text_encoder.vision_tower(...)``, CLIP skip's
    ``text_encoder.text_model.final_layer_norm(...)``) bypasses the hook at the component's root, and would meet
    inputs from another GPU. Called from outside a call of its component, it runs as a call of the component does:
    the component's lock held, its inputs moved to the component's device (an offloaded or streamed component
    onloaded), its outputs to the execution device. Inside a call of the component it does nothing."""

    def __init__(self, hook: ModelHook, root: torch.nn.Module):
        self.hook, self.root = hook, root
        self.handled: list[bool] = []  # per running submodule call, innermost last: whether this entry handled it

    def before(self, module, args, kwargs):
        if self.hook.inside:
            self.handled.append(False)
            return None
        self.hook.lock.__enter__()
        self.hook.inside += 1
        self.handled.append(True)  # before the move: `after` runs even when the move raises, and undoes this
        return self.hook.enter_part(self.root, *args, **kwargs)

    def after(self, module, args, kwargs, output):
        if not self.handled.pop():
            return None
        try:
            if output is None:  # torch passes None when the call raised
                if hasattr(self.hook, "abort"):
                    self.hook.abort(self.root)
                return None
            return self.hook.leave_part(self.root, output)
        finally:
            self.hook.inside -= 1
            self.hook.lock.__exit__()


def _aborting(hook: ModelHook):
    def after(module, args, output):
        if output is None:  # torch passes None when the forward raised
            hook.abort(module)

    return after


def unhook_component(module: torch.nn.Module) -> None:
    """Remove what ``hook_component`` added, leaving no trace in the module's ``__dict__``."""
    hook = getattr(module, "_hf_hook", None)
    if isinstance(hook, ModelHook) or "_old_forward" in module.__dict__:  # also a hook whose init_hook raised
        handle = getattr(hook, "abort_handle", None)
        if handle is not None:
            handle.remove()
        remove_hook_from_module(module)
        forward = module.__dict__.get("forward")
        if getattr(forward, "__func__", None) is type(module).forward:
            del module.__dict__["forward"]
    for name in _hooked_methods(module):
        module.__dict__.pop(name, None)
    _remove_entries(module)


def _remove_entries(module: torch.nn.Module) -> None:
    """The submodule entries, found by their owner (a deep copy of a hooked module holds copies of them)."""
    for sub in submodules(module):
        for hooks in (sub._forward_pre_hooks, sub._forward_hooks):
            for key in [k for k, f in hooks.items() if isinstance(getattr(f, "__self__", None), _Entry)]:
                del hooks[key]
                for extra in (sub._forward_pre_hooks_with_kwargs, sub._forward_hooks_with_kwargs,
                              sub._forward_hooks_always_called):
                    extra.pop(key, None)


def _hooked_methods(module: torch.nn.Module) -> list[str]:
    names = []
    for name in ("encode", "decode", "tiled_encode", "tiled_decode"):
        function = getattr(type(module), name, None)
        if getattr(function, "__code__", None) is _FORWARD_HOOK_CODE:
            names.append(name)
    return names


def _wrap_method(module, function, hook: ModelHook):
    # the function under `apply_forward_hook`, whose own `pre_forward(module)` would count the call twice and enter
    # a streaming hook twice; a nested call (decode -> tiled_decode) runs plain inside the outer one
    raw = getattr(function, "__wrapped__", function).__get__(module)

    @functools.wraps(raw)
    def wrapper(*args, **kwargs):
        def call(hook):  # under the component's lock: another thread's call of this component waits (run_many)
            if hook.inside:
                return raw(*args, **kwargs)
            if _followed(module, hook):  # rehooked: the new hook's wrapper runs the call
                return getattr(module, function.__name__)(*args, **kwargs)
            hook.inside += 1
            try:
                with quiet():
                    moved_args, moved_kwargs = hook.pre_forward(module, *args, **kwargs)
                    output = raw(*moved_args, **moved_kwargs)
            except BaseException:
                if hasattr(hook, "abort"):
                    hook.abort(module)
                raise
            finally:
                hook.inside -= 1
            try:
                with quiet():
                    return hook.post_forward(module, output)
            finally:
                _settled(module)

        return component_call(module, call)

    return wrapper


def _locked(module: torch.nn.Module, forward, *args, **kwargs):
    def call(hook):
        if _followed(module, hook):  # a new hook placed the changed model: its own forward runs the call
            return module.forward(*args, **kwargs)
        hook.inside += 1
        _hush(1)
        try:
            return forward(*args, **kwargs)
        except Exception:
            raise  # torch runs the always-called forward hook: ``abort`` (``hook_component``)
        except BaseException:  # Ctrl-C: torch runs no forward hook, so the call's onloads and copies end here
            if hasattr(hook, "abort") and hook.inside == 1:
                hook.abort(module)
            raise
        finally:
            _hush(-1)
            hook.inside -= 1
            if not hook.inside:
                hook.written.clear()  # what a call that raised left behind
                _settled(module)

    return component_call(module, call)


def _followed(module: torch.nn.Module, hook) -> bool:
    """At the start of an outermost call: the model's changes since its last call followed (a LoRA or FreeU set
    from ``callback_on_step_end`` between two steps); True when that replaced ``hook``."""
    if hook.inside or hook.change_check is None:
        return False
    return bool(hook.change_check(module)) and module.__dict__.get("_hf_hook") is not hook


def _settled(module: torch.nn.Module) -> None:
    """After a call: what the model's own call wrote into its tensors is no change (``changes.Seen.settle``)."""
    seen = module.__dict__.get("_pipemap_seen")
    if seen is not None:
        seen.settle()


# ---- what changed since: a counter moved by every change to any module made outside a placed component's call ----
# A placed component is checked at the start of each call (``changes.unchanged``); hashing its whole model there would
# cost ~10 ms a call on a full SDXL UNet, so the check reads this counter and its tensors' version counters instead,
# and hashes the model only when one of them moved. torch's module registration hooks see modules, parameters and
# buffers set; torch.nn.Module.__setattr__ (wrapped once, on the first dispatch) sees plain attributes (peft's active
# adapter and disable flag, FreeU's factors, an attention processor). The components' own calls (and pipemap's own
# placing) run ``quiet``: what a model sets on itself while it runs (Wan's VAE caches) is no change.

_counter = itertools.count(1)
_epoch = 0
_local = threading.local()
_installed = threading.Lock()
_watching: list[bool] = []
# the records of models placed since the counter last moved whose signature is not taken yet (``changes.Seen``): each
# is taken just before the next change lands, the first time the counter moves. A load and a call that changes
# nothing then hash no model (the signature was a third of what dispatch added to a load, issue 38). By ``id``, each a
# weak reference: a dict's truth is what the hot ``__setattr__`` below asks, and a dropped model's record goes with it
_unsigned: dict[int, weakref.ref] = {}
_signing = threading.Lock()


def unsigned(seen) -> None:
    """``seen`` (with a ``sign()``) signed just before the next change to any module lands."""
    _unsigned[id(seen)] = weakref.ref(seen)


def _sign_waiting() -> None:
    """Sign every record waiting (``unsigned``), before the change that called this lands; under a lock, and each
    record left waiting until it is signed, so that a change another thread makes meanwhile finds it waiting and
    waits for the lock (it would be taken into the signatures)."""
    with _signing:
        waiting = list(_unsigned.items())
        for _, ref in waiting:
            seen = ref()
            if seen is not None:
                seen.sign()
        for key, ref in waiting:
            if _unsigned.get(key) is ref:
                del _unsigned[key]


def epoch() -> int:
    """The change counter now: moves at each change to any module made outside a placed call."""
    return _epoch


def changed() -> None:
    """Move the change counter (a change made where no hook of torch sees it: a pipeline's loader method)."""
    global _epoch
    if not getattr(_local, "quiet", 0):
        if _unsigned:
            _sign_waiting()
        _epoch = next(_counter)  # a fresh value, never one a check recorded: no lost update can hide a change


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Changes made by this thread inside the block do not move the counter (a component's own call, a placing)."""
    _hush(1)
    try:
        yield
    finally:
        _hush(-1)


def _hush(step: int) -> None:
    _local.quiet = getattr(_local, "quiet", 0) + step


def quietly(work: Callable[[], object]) -> Callable[[], object]:
    """``work`` run ``quiet`` on whatever thread runs it (a copy's part of a call, on a pool thread)."""
    def run() -> object:
        with quiet():
            return work()

    return run


def watch_changes() -> None:
    """Install, once per process, what moves the change counter (see above)."""
    with _installed:
        if _watching:
            return
        registered = torch.nn.modules.module
        registered.register_module_module_registration_hook(_on_registration)
        registered.register_module_parameter_registration_hook(_on_registration)
        registered.register_module_buffer_registration_hook(_on_registration)
        torch.nn.Module.__setattr__ = _watched_setattr(torch.nn.Module.__setattr__)  # type: ignore[method-assign]
        _watching.append(True)


def _on_registration(module, name, value) -> None:
    changed()  # torch calls these before the module, parameter or buffer is set: the signatures waiting see it not


def _watched_setattr(setattr_of):
    @functools.wraps(setattr_of)
    def __setattr__(self, name: str, value) -> None:
        global _epoch
        if getattr(_local, "quiet", 0):
            setattr_of(self, name, value)
            return
        if _unsigned:  # ``changed``, inlined: every attribute set on any module in the process comes here, a load's
            _sign_waiting()  # thousands too (issue 38: load time); the signatures waiting taken before it lands
        setattr_of(self, name, value)
        _epoch = next(_counter)

    return __setattr__


def outside_graphs(cls: type) -> None:
    """Each hook method of ``cls`` run eagerly, between compiled graphs; called below each hook class.

    ``module.compile()`` and ``compile_repeated_blocks`` compile the module's whole call, hooks included: dynamo
    would trace the hooks' bookkeeping (queues, events, the LRU cache) into the graph and guard on it (a new onloaded
    tensor each call, a recompile each call). Done where each class is defined, so importing one hook's module alone
    (``hooks.HOOKS`` imports a mode's module on first use) still wraps it."""
    for name in ("pre_forward", "post_forward", "_enter", "_leave"):
        if name in cls.__dict__:
            setattr(cls, name, torch.compiler.disable(cls.__dict__[name], recursive=True))


outside_graphs(PlacementHook)
# the bookkeeping of each call, eager between graphs as the hooks' is: traced, a compiled ``module.compile()`` would
# guard on the change counter and every tensor's version (a recompile at each call)
_followed = torch.compiler.disable(_followed, recursive=True)
_settled = torch.compiler.disable(_settled, recursive=True)
_hush = torch.compiler.disable(_hush, recursive=True)
