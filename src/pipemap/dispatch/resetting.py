"""Undoing a dispatch: every pipemap hook removed and every model back on the CPU (``reset``), for a pipeline and the
``from_pipe`` copies that share its models; and a failed placement's moves put back (``undo``)."""

from __future__ import annotations

import weakref

import torch

from ..hooks import unhook_component
from ..hooks.changes import forget, settle
from ..runtime.placed import placed, unmark
from .checks import check_pipeline, components
from .guard import unguard
from .moves import Move, place_module


def reset(pipe) -> None:
    """Remove every pipemap hook and bring every component back to the CPU, as before ``dispatch``.

    >>> pipemap.reset(pipe); pipe.hf_device_map is None                           # doctest: +SKIP
    True
    """
    check_pipeline(pipe, "reset")
    pipes = [pipe, *owners(pipe)]  # a from_pipe copy shares the models of the pipeline dispatch placed
    pipes += [c for p in list(pipes) for c in copies_of(p) if all(c is not q for q in pipes)]
    for module in {id(m): m for p in pipes for m in components(p).values()}.values():
        take_back(module)
    for each in pipes:
        unguard(each)
        unmark(each)  # hf_device_map back to the class's None, as before dispatch


def take_back(module: torch.nn.Module) -> None:
    """``module`` unhooked and back on the CPU, as before dispatch: what was changed in place on the GPU (a fused
    LoRA) kept in its CPU masters, its worker processes stopped (``hooks/workers.py``; a rehook keeps them)."""
    settle(module)
    release = getattr(getattr(module, "_hf_hook", None), "release", None)
    if release is not None:
        release(module)
    unhook_component(module)
    place_module(module, "cpu")
    forget(module)


def owners(pipe) -> list:
    """The other placed pipelines whose hooks ``pipe``'s models carry (``pipe`` a ``from_pipe`` copy of them)."""
    found_owners = (getattr(getattr(m, "_hf_hook", None), "owner", None) for m in components(pipe).values())
    found = {id(p): p for p in (o() for o in found_owners if isinstance(o, weakref.ref)) if p is not None}
    return [p for p in found.values() if p is not pipe]


def copies_of(pipe) -> tuple:
    """The ``from_pipe`` copies placed on ``pipe``'s plan (its record's)."""
    record = placed(pipe)
    return () if record is None else tuple(record.copies)


def undo(modules, moves: list[Move]) -> None:
    """A placement that failed part-way: ``modules`` unhooked and the tensors ``moves`` moved put back."""
    for module in modules:
        unhook_component(module)
        forget(module)
    for moved in reversed(moves):
        moved.undo()
