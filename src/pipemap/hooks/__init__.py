"""The hooks wing: how a placed component runs, one hook per placement mode, chosen from one table by mode.

=============  ===============  ============  ====================================================================
mode           hook             file          what it does at each call
=============  ===============  ============  ====================================================================
resident       PlacementHook    resident.py   inputs to the component's device, outputs to the execution device
offload        OffloadHook      offload.py    the whole component copied from CPU RAM, kept while room allows
stream         StreamHook       stream.py     blocks copied through a few GPU buffers, the next ones prefetched
split          SplitHook        split.py      blocks on other GPUs, activations passed on between them
replicated     ReplicaHook      replica.py    the batch cut across copies of the component on several GPUs
guidance       GuidanceHook     guidance.py   each step's second guidance branch run ahead on a rank on another GPU,
                                              used only when the call that arrives has exactly its inputs
sequence       SequenceHook     sequence.py   the call's tokens split across ranks on several GPUs, attention
                                              exchanging keys and values (diffusers' context parallelism)
guidance_      GuidanceSeq-     guidance_     both: each step's first call's tokens split across half the GPUs,
sequence       uenceHook        sequence.py   its second call's across the other half, started ahead
=============  ===============  ============  ====================================================================

Every hook derives from ``PlacementHook`` (``resident.py``, which also attaches and removes hooks). ``moving.py`` is
what offload and stream share (onloading through ``streams.Queues``, the ledger of what one dispatch holds where);
``packing.py`` packs a group of tensors into one exact-size (pinned) host buffer.

The last four modes run ranks on other devices, each hook written once over one seam (``ranks.Ranks``, the hooks'
shared part ``copies.CopiesHook``): bring the component up on every rank, split the ranks into groups, submit parts
of a call to chosen ranks and take their outputs, close. What runs the ranks is the plan's ``ranks``: threads of this
process (``threads.py``, meeting in ``exchange.py``'s in-process group; always on the dry run's stand-ins), or a
worker process per GPU over ``torch.distributed`` (``workers.py`` rank 0's end, ``worker.py`` a worker's,
``groups.py``, ``payload.py``, ``launch.py``; Ray actors: ``ray_workers.py``). ``dispatch`` checks, places and
undoes; it knows no mode but through ``HOOKS``. Which hook a mode gets is its row of the mode table
(``pipemap.modes.TABLE``: ``hook``; ``ranks``: whether it runs ranks); ``HOOKS`` is a view of it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..modes import TABLE, Mode, facts, resolve_ranks
from ..plan import Placement, Plan
from ..runtime import transfer
from ..runtime.streams import Queues, queues_for
from .resident import CallLock, Moved, PlacementHook, hook_component, unhook_component

if TYPE_CHECKING:
    from .guidance import GuidanceHook
    from .moving import Ledger
    from .offload import OffloadHook
    from .replica import ReplicaHook
    from .sequence import SequenceHook
    from .split import SplitHook
    from .stream import StreamHook

# Each mode's hook (module, class) is its row of the mode table (``pipemap.modes.TABLE``); a mode's module is imported
# when a plan first uses the mode: a resident plan's first load then imports no streaming, offloading, copying or
# context-parallel code (issue 28). A mode that runs ranks (the table's ``ranks``) gets the plan's runtime for them
# (``Plan.ranks``: "process", the default where a plan splits a denoiser, "ray" or "thread") from ``hook_maker``.
# the built-in hooks and other names of the wing re-exported here, imported on first read like the hooks
_LAZY = {"Ledger": "moving"} | {TABLE[m].hook[1]: TABLE[m].hook[0].rpartition(".")[2] for m in Mode}


def _hook_class(name: str) -> type:
    """The class ``name`` of the module ``_LAZY`` names, imported now."""
    return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)


def _imported(where: tuple[str, str]) -> Any:
    module, name = where
    return getattr(importlib.import_module(module), name)


class _Hooks(Mapping):
    """``mode -> (placement, execution_device, ledger) -> hook``, each mode's module imported on first use; the
    modes are the mode table's (a mode a test registers there too)."""

    def __getitem__(self, mode: str) -> Callable[[Placement, str, Any], PlacementHook]:
        row = TABLE.get(mode)
        if row is None:
            raise KeyError(mode)
        return _imported(row.hook).for_placement

    def __iter__(self) -> Iterator[str]:
        return iter(TABLE)

    def __len__(self) -> int:
        return len(TABLE)


def runtime_of(plan: Plan) -> tuple[str, bool]:
    """What runs ``plan``'s split ranks (``Plan.ranks``; a plan that does not say, one made by hand: ``"auto"``'s
    choice now) and whether the user named it (``Plan.ranks_asked``)."""
    if plan.ranks is not None:
        return plan.ranks, plan.ranks_asked
    return resolve_ranks(None)


HOOKS: Mapping[str, Callable[[Placement, str, Any], PlacementHook]] = _Hooks()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = _hook_class(name)
        globals()[name] = value  # later reads skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def hook_maker(plan: Plan, queues: Callable[[torch.device], Queues] = queues_for, *, beside: Iterable[Any] = ()
               ) -> Callable[[Placement], PlacementHook]:
    """``placement -> hook`` for ``plan``'s placements, the one maker of pipemap's hooks: the hooks that move weights
    share one ledger of what is onloaded where (and evict each other), so they take turns (one lock). ``beside``: the
    hooks already on the pipeline's components (a model placed after dispatch, components moved to the host on an
    out-of-memory error): a moving one among them gives its ledger and lock. ``queues`` makes each device's copy
    queues for a new ledger; with the real ones (``queues_for``) the ledger shares each GPU's cache and the lock with
    the other pipelines placed in this process (``moving.SharedCache``); the dry run's stand-ins keep their own."""
    moving = next((h for h in beside if ledger_of(h) is not None), None)
    # the ledger, made with the first moving hook: none for a plan without one, so no moving code is imported
    shared: list[Any] = [] if moving is None else [moving.ledger]
    locks: list[CallLock] = [] if moving is None else [moving.lock]

    def ledger() -> Ledger:
        if not shared:
            from .moving import Ledger  # here: only a plan that moves weights needs the moving code

            shared.append(Ledger(queues, shared=queues is queues_for))
        return shared[0]

    def make(p: Placement) -> PlacementHook:
        if TABLE[p.mode].ranks:  # its ranks run by the plan's runtime (``copies.CopiesHook``)
            hook = _imported(TABLE[p.mode].hook).for_placement(p, plan.execution_device, None, *runtime_of(plan))
        else:
            hook = HOOKS[p.mode](p, plan.execution_device, ledger() if facts(p.mode).moves_weights else None)
        if facts(p.mode).moves_weights:
            if not locks:
                locks.append(ledger().lock)
            hook.lock = locks[0]
        return hook

    return make


def ranks_report(hook: Any) -> dict[str, str]:
    """What runs a split component's other ranks, as ``pipemap.stats`` reports it: ``ranks`` (``"process"``,
    ``"ray"`` or ``"thread"``), ``ranks_why`` and, where the copy check staged a pair of its devices, ``exchange``
    (its ranks exchange through host memory). Empty for a hook that keeps no copies."""
    devices = getattr(hook, "replica_devices", ())
    if not devices:
        return {}
    runtime = getattr(hook, "runtime", "thread")
    fallback = getattr(hook, "fallback", None)
    if fallback:  # ranks="auto" chose workers, and the hook ran threads after all (``copies.CopiesHook``)
        why = f"ranks='auto' chose worker processes, but {fallback}"
    elif runtime == "thread":
        why = "asked for (ranks='thread' or PIPEMAP_WORKERS=thread), or the dry run's stand-ins"
    else:
        why = "asked for by name" if hook.asked else "ranks='auto': worker processes wherever a plan splits"
    report = {"ranks": runtime, "ranks_why": why}
    devices_text = [str(hook.device), *(str(d) for d in devices)]
    staged = transfer.exchange_line(hook.component, devices_text)
    return report | ({"exchange": staged} if staged else {})


def give_back_kept() -> None:
    """Evict what placed pipelines keep onloaded on their GPUs between calls (``moving.SharedCache``), before a plan
    reads this machine's free memory: it is room their caches give up when short, not used memory; counted as used,
    a pipeline planned after another's call would get a room smaller by the other's kept VAE, and the shared room
    (the smallest) would shrink for both."""
    moving = sys.modules.get(f"{__name__}.moving")  # not imported: no pipeline moves weights (issue 28)
    if moving is not None:
        moving.unload_shared()


def kept_bytes() -> dict[str, int]:
    """The GPU bytes placed pipelines keep onloaded between calls (``moving.SharedCache``), per device, counted
    without moving them: a plan made on this machine counts them as free (``pipemap.plan`` moves nothing), and
    ``dispatch`` gives them back (``give_back_kept``) before it places weights there."""
    moving = sys.modules.get(f"{__name__}.moving")  # not imported: no pipeline moves weights (issue 28)
    return moving.kept_shared() if moving is not None else {}


def ledger_of(hook: Any) -> Ledger | None:
    """The ledger of a hook that moves weights, else None. Asked of the hook, not by ``isinstance(..., Ledger)``: a
    pipeline whose plan moves nothing then never imports the moving code (issue 28)."""
    return getattr(hook, "ledger", None) if isinstance(hook, PlacementHook) else None  # only a moving hook has one


__all__ = ["HOOKS", "CallLock", "GuidanceHook", "Ledger", "Moved", "OffloadHook", "PlacementHook",
           "ReplicaHook", "SequenceHook", "SplitHook", "StreamHook", "give_back_kept", "hook_component", "hook_maker",
           "kept_bytes", "ranks_report", "runtime_of", "unhook_component"]
