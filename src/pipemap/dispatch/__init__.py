"""Apply a plan to a pipeline in memory, and undo it.

``dispatch`` checks the pipeline against the plan, moves each component's tensors where the plan puts them and
attaches one hook at the root of each component, taken by mode from ``hooks.HOOKS``: the hook moves the component's
inputs to its device and its outputs to the pipeline's execution device, so the pipeline's own ``__call__`` runs
unchanged. ``dispatch`` is atomic: if placing any component fails, every tensor is put back where it was and the
error says which component failed. ``reset`` undoes a dispatch; ``stats`` reads what the hooks counted.

This package's modules, each one concern: ``placing`` (``dispatch``, ``place``), ``checks`` (what is checked before
anything moves), ``moves`` (tensors moved, each move undoable), ``resetting`` (``reset``), ``following`` (a placed
pipeline's models changed after dispatch, followed one component at a time by ``hooks/changes.py``; a component
replaced; ``from_pipe`` copies), ``counters`` (``stats``), ``guard`` (the class swap by which calls from several
threads take turns and an assigned model is placed), ``relief``, ``loading``, ``parallel``, ``traffic``. What
pipemap keeps on a placed pipeline is one record (``runtime/placed.py``). This file only hands names on.
"""

from __future__ import annotations

from ..runtime.placed import planned
from .checks import check_pipeline
from .counters import onload_peaks, stats
from .following import change_check, follow, place_copy, replace, replace_component
from .moves import Move, place_component, place_module
from .placing import dispatch, place
from .resetting import reset

__all__ = ["Move", "change_check", "check_pipeline", "dispatch", "follow", "onload_peaks", "place",
           "place_component", "place_copy", "place_module", "planned", "replace", "replace_component", "reset",
           "stats"]
