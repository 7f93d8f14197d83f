"""The hooks wing: how a placed component runs, one hook per placement mode, chosen from one table by mode.

=============  ===============  ============  ====================================================================
mode           hook             file          what it does at each call
=============  ===============  ============  ====================================================================
resident       PlacementHook    resident.py   inputs to the component's device, outputs to the execution device
offload        OffloadHook      offload.py    the whole component copied from CPU RAM, kept while room allows
stream         StreamHook       stream.py     blocks copied through a few GPU buffers, the next ones prefetched
split          SplitHook        split.py      blocks on other GPUs, activations passed on between them
replicated     ReplicaHook      replica.py    the batch cut across copies of the component on several GPUs
guidance       GuidanceHook     guidance.py   each step's second guidance branch run ahead on a copy on another GPU,
                                              used only when the call that arrives has exactly its inputs
sequence       SequenceHook     sequence.py   the call's tokens split across copies on several GPUs, attention
                                              exchanging keys and values (diffusers' context parallelism)
=============  ===============  ============  ====================================================================

Every hook derives from ``PlacementHook`` (``resident.py``, which also attaches and removes hooks). ``moving.py`` is
what offload and stream share (onloading through ``streams.Queues``, the ledger of what one dispatch holds where);
``packing.py`` packs a group of tensors into one exact-size (pinned) host buffer; ``copies.py`` is what guidance and
sequence share (copies, threads, the forward they replace); ``exchange.py`` is the in-process process group a
sequence split exchanges through. ``dispatch`` checks, places and
undoes; it knows no mode but through ``HOOKS``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..plan import Placement, Plan
from ..streams import Queues, queues_for
from .guidance import GuidanceHook
from .moving import Ledger
from .offload import OffloadHook
from .replica import ReplicaHook
from .resident import CallLock, Moved, PlacementHook, hook_component, unhook_component
from .sequence import SequenceHook
from .split import SplitHook
from .stream import StreamHook

# mode -> ``(placement, execution_device, ledger) -> hook``
HOOKS: dict[str, Callable[[Placement, str, Ledger], PlacementHook]] = {
    "resident": PlacementHook.for_placement,
    "offload": OffloadHook.for_placement,
    "stream": StreamHook.for_placement,
    "split": SplitHook.for_placement,
    "replicated": ReplicaHook.for_placement,
    "guidance": GuidanceHook.for_placement,
    "sequence": SequenceHook.for_placement,
}
MOVING = ("offload", "stream")  # modes whose hooks move weights: one ledger, and one call at a time among them


def _outside_graphs(cls: type) -> None:
    # ``module.compile()`` and ``compile_repeated_blocks`` compile the module's whole call, hooks included: dynamo
    # would trace the hooks' bookkeeping (queues, events, the LRU cache) into the graph and guard on it (a new
    # onloaded tensor each call, a recompile each call). Each hook method runs eagerly, between graphs, instead.
    for name in ("pre_forward", "post_forward", "_enter", "_leave"):
        if name in cls.__dict__:
            setattr(cls, name, torch.compiler.disable(cls.__dict__[name], recursive=True))


for _hook in (PlacementHook, OffloadHook, StreamHook, SplitHook, ReplicaHook):
    _outside_graphs(_hook)


def hook_maker(plan: Plan, queues: Callable[[torch.device], Queues] = queues_for
               ) -> Callable[[Placement], PlacementHook]:
    """``placement -> hook`` for one dispatch of ``plan``: the moving hooks share one ledger of what is onloaded
    where (and evict each other), so they take turns (one lock); ``queues`` makes each device's copy queues."""
    ledger = Ledger(queues)
    moving = CallLock()

    def make(p: Placement) -> PlacementHook:
        hook = HOOKS[p.mode](p, plan.execution_device, ledger)
        if p.mode in MOVING:
            hook.lock = moving
        return hook

    return make


__all__ = ["HOOKS", "MOVING", "CallLock", "GuidanceHook", "Ledger", "Moved", "OffloadHook", "PlacementHook",
           "ReplicaHook", "SequenceHook", "SplitHook", "StreamHook", "hook_component", "hook_maker",
           "unhook_component"]
