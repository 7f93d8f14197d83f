"""A placed pipeline's class swap: its calls take turns, its changes wait for the running call, an assigned model
is placed, and what would undo the placement behind pipemap's back is refused.

A call's state lives on the pipeline object (the scheduler's step, ``_guidance_scale``), so two calls at once from
several threads would silently corrupt each other: they take turns (re-entrant; ``pipemap.run_many`` runs twins
instead). Python looks ``__call__`` up on the class, so the placed pipeline gets a subclass of its own class (same
name, module and behaviour, made once per class) whose ``__call__`` holds the record's lock (``runtime/placed.py``)
and follows the models' changes first; whose methods that change models (diffusers' loader mixins, FreeU, fused
projections) wait for the running call; whose ``__setattr__`` places a model assigned in place of a placed one
(``pipe.unet = other``); and which refuses ``copy.deepcopy`` and pickling. ``pipe.to`` and diffusers' offloads are
refused on the instance; diffusers' own undo (``reset_device_map``, ``remove_all_hooks``) resets. ``unguard`` gives
all of it back.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import PipelineMappedError
from ..hooks.resident import changed
from ..runtime.placed import placed, planned

# diffusers' methods that would move or re-hook the placed models: refused on the instance while it is placed
_GUARDED = ("to", "enable_model_cpu_offload", "enable_sequential_cpu_offload", "enable_group_offload",
            "reset_device_map", "remove_all_hooks")


@dataclass(frozen=True)
class Around:
    """What a guarded pipeline runs of dispatch's (which this module cannot import: dispatch imports it): ``follow``
    before each call, ``replace`` for a placed model assigned, ``reset`` for diffusers' own undo."""

    follow: Callable[[Any], None]
    replace: Callable[[Any, str, Any], None]
    reset: Callable[[Any], None]


_GUARDS: dict[tuple[type, Around], type] = {}
_GUARDS_LOCK = threading.Lock()


def guard(pipe, around: Around) -> None:
    """Swap the placed ``pipe``'s class for its guarded one (its record, ``placed.mark``, holds the lock its calls
    take turns by) and refuse what would undo the placement; ``unguard`` gives the class back."""
    for name in _GUARDED:
        pipe.__dict__[name] = refuse(f"pipe.{name}()")
    pipe.__dict__["reset_device_map"] = functools.partial(around.reset, pipe)  # diffusers' own undo does ours
    pipe.__dict__["remove_all_hooks"] = functools.partial(around.reset, pipe)  # half removed: half placed
    pipe.__class__ = _guarded(unguarded_class(pipe), around)


def unguard(pipe) -> None:
    for name in _GUARDED:
        pipe.__dict__.pop(name, None)
    pipe.__class__ = unguarded_class(pipe)


def unguarded_class(pipe) -> type:
    """The pipeline's own class, under the guarded one if it has it."""
    return type(pipe).__dict__.get("_pipemap_unguarded", type(pipe))


def refuse(operation: str) -> Callable[..., Any]:
    """A method that raises ``PipelineMappedError`` naming ``operation``."""

    def refused(*args, **kwargs):
        raise PipelineMappedError(operation)

    return refused


def _guarded(cls: type, around: Around) -> type:
    with _GUARDS_LOCK:
        if (cls, around) not in _GUARDS:
            body = {**_changing_methods(cls), "__call__": _taking_turns(cls.__call__, around.follow),
                    "_pipemap_unguarded": cls,
                    "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
                    # a copy would hold the hooks, their locks, threads and device copies of the placed models:
                    # refused by name (the guarded class is not importable and a lock not picklable: raw errors)
                    "__setattr__": _replacing(cls, around.replace), "__deepcopy__": refuse("copy.deepcopy(pipe)"),
                    "__reduce_ex__": refuse("pickling the pipeline")}
            _GUARDS[cls, around] = type(cls.__name__, (cls,), body)
        return _GUARDS[cls, around]


def _taking_turns(call, follow: Callable[[Any], None]):
    @functools.wraps(call)
    def taking_turns(self, *args, **kwargs):
        record = placed(self)
        if record is None:  # a new pipeline of the class (``type(pipe)(...)``) that no dispatch marked
            return call(self, *args, **kwargs)
        with record.lock:
            # a LoRA loaded, fused or switched since the last call: placed before this one. A change made during the
            # call (from callback_on_step_end) is followed at the next call of the component (``change_check``);
            # what the models' own calls set on themselves (Wan's VAE caches) runs quiet and is no change
            follow(self)
            return call(self, *args, **kwargs)

    return taking_turns


# the pipeline methods that change its models (diffusers' loader mixins, FreeU, fused projections): called from
# another thread, they wait for the running call and apply whole after it; their own changes are marked (peft's
# merged adapters are a list appended to, which no hook of torch sees)
_CHANGING = ("load_", "unload_", "fuse_", "unfuse_", "set_", "enable_", "disable_", "delete_")


def _changing_methods(cls: type) -> dict[str, Any]:
    found = {}
    for name in dir(cls):
        if name.startswith(_CHANGING) and name not in _GUARDED:
            method = inspect.getattr_static(cls, name, None)
            if inspect.isfunction(method):
                found[name] = _changing(method)
    return found


def _changing(method):
    @functools.wraps(method)
    def changing(self, *args, **kwargs):
        record = placed(self)
        if record is None:
            return method(self, *args, **kwargs)
        with record.lock:
            changed()
            try:
                return method(self, *args, **kwargs)
            finally:
                changed()

    return changing


def _replacing(cls: type, replace: Callable[[Any, str, Any], None]):
    setattr_of: Any = cls.__setattr__

    def __setattr__(self, name: str, value) -> None:
        plan = planned(self)
        if plan is not None and name in plan.device_map and value is not self.__dict__.get(name):
            replace(self, name, value)  # ``pipe.unet = other``: placed as the old one was, or a typed error
        else:
            setattr_of(self, name, value)

    return __setattr__
