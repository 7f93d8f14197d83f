"""What pipemap keeps on a pipeline it placed: one record (``Placed``) under one key of the pipeline's
``__dict__``, read and written only through this module.

The record holds the plan the pipeline runs on, the lock its calls take turns by (``dispatch/guard.py``), the
``from_pipe`` copies placed on that plan (``reset`` of either resets both) and the memory ledger ``run_many`` and
serve admit its requests by (``api.memory_for``). The record is frozen: a changed plan is a new record that keeps the
lock, the copies and the ledger, so a thread that read the old one holds the same lock. Diffusers' own
``hf_device_map`` is written beside it, always from the record's plan.

The class swap (``dispatch/guard.py``) reads the lock here; a module's own memo of what it was when placed is
``hooks/changes.py``'s (``_pipemap_seen`` on each module).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from ..plan import Plan

KEY = "_pipemap"  # the one attribute pipemap sets on a placed pipeline (besides diffusers' hf_device_map)
# a new record is read, changed and written back: a plan moved by relief on a request's thread and a ledger kept by
# another thread's run_many must not write over each other
_WRITING = threading.Lock()


@dataclass(frozen=True)
class Placed:
    """A placed pipeline's record: its ``plan``; the re-entrant ``lock`` its calls take turns by; the ``from_pipe``
    ``copies`` placed on its plan (weakly held); the memory ledger ``api.memory_for`` made for it (``admission``)."""

    plan: Plan
    lock: Any = field(default_factory=threading.RLock)
    copies: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    admission: Any = None


def placed(pipe) -> Placed | None:
    """The record of a pipeline pipemap placed, or None."""
    return pipe.__dict__.get(KEY)


def planned(pipe) -> Plan | None:
    """The plan a pipeline was dispatched with (as it has changed since: a LoRA followed, a model added), or None."""
    record = placed(pipe)
    return None if record is None else record.plan


def mark(pipe, plan: Plan, lock: Any = None) -> Placed:
    """Record ``pipe`` as placed by ``plan``: a new record (no copies, no ledger) with a new lock, or ``lock`` (a
    ``from_pipe`` copy's: the lock of the pipeline whose models it shares)."""
    return _keep(pipe, Placed(plan) if lock is None else Placed(plan, lock=lock))


def replan(pipe, plan: Plan) -> None:
    """The placed ``pipe`` runs on ``plan`` now (a model followed, replaced, added, or moved to the host); its lock,
    copies and ledger stay."""
    with _WRITING:
        record = placed(pipe)
        if record is None or record.plan is not plan:
            record = Placed(plan) if record is None else dataclasses.replace(record, plan=plan)
        _keep(pipe, record)


def admission_of(pipe) -> Any:
    """The memory ledger kept on the placed ``pipe``'s record (``api.memory_for``), or None."""
    record = placed(pipe)
    return None if record is None else record.admission


def keep_admission(pipe, admission: Any) -> None:
    """Keep the memory ledger made for the placed ``pipe`` on its record (``api.memory_for``)."""
    with _WRITING:
        record = placed(pipe)
        if record is not None:
            pipe.__dict__[KEY] = dataclasses.replace(record, admission=admission)


def unmark(pipe) -> None:
    """Forget that ``pipe`` was placed: its record, and ``hf_device_map`` back to the class's None."""
    pipe.__dict__.pop(KEY, None)
    pipe.__dict__.pop("hf_device_map", None)


def _keep(pipe, record: Placed) -> Placed:
    # written into __dict__: no guarded ``__setattr__`` (dispatch/guard.py) or diffusers' config update runs for it
    pipe.__dict__[KEY] = record
    pipe.__dict__["hf_device_map"] = record.plan.device_map
    return record
