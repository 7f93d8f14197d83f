"""One call's tokens split across GPUs (mode ``"sequence"``, strategy ``"parallel"``): a transformer with a copy on
each of its ``replicas`` runs every call on all of them at once, each on its share of the tokens, their attention
exchanging queries, keys and values (Ulysses: an all-to-all before the attention, one after it).

What is split, where, and how attention exchanges are diffusers' own context parallelism: the model class's
``_cp_plan`` (which inputs and layer outputs to cut along which dimension, which output to gather) and the attention
backends' context-parallel path (``dispatch_attention_fn`` with a ``ParallelConfig``, Ulysses attention). diffusers
runs it on a ``torch.distributed`` process group with one process per GPU, each running the whole pipeline; pipemap
keeps the pipeline in the caller's process, and the other ranks are what the plan's ``ranks`` names
(``ranks.Ranks``): worker processes in a ``torch.distributed`` group with this one (``workers.py``), or threads
meeting in an in-process group (``threads.py``, ``exchange.py``). Each rank's copy is made a rank of the split by
``context.enable_split`` (diffusers' own split and gather hooks with the rank read from pipemap's instead of from the
default process group torch.distributed would need).

Rank 0 is a copy on the transformer's own GPU that shares its weights, run in the calling thread; its output is the
call's. At each call the inputs go whole to every rank (each cuts its own share, as diffusers' ranks do), and all run
at once. A call whose tokens do not divide among the GPUs raises ``Unsplittable`` on every rank at the same layer,
before any exchange: it then runs whole on the transformer's own GPU.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from ..errors import Unsplittable
from .context import check_splittable
from .copies import CopiesHook

if TYPE_CHECKING:
    from .ranks import Ranks


class SequenceHook(CopiesHook):
    """A transformer on ``device`` with a rank on each of ``replicas``: each call's tokens split across all of them.

    ``home`` is rank 0's copy, here, sharing the module's weights. ``whole`` counts the calls that ran whole on
    ``device`` because their tokens did not divide among the GPUs.
    """

    def __init__(self, component: str, device: str, execution_device: str, replicas: tuple[str, ...],
                 runtime: str = "thread", asked: bool = False):
        super().__init__(component, device, execution_device, replicas, runtime, asked)
        self.home: torch.nn.Module | None = None
        self.whole = 0

    def init_hook(self, module):
        check_splittable(self.component, module, 1 + len(self.replica_devices))
        return super().init_hook(module)

    def bring_up(self, module) -> None:
        """Every rank given the module and made a rank of the split; rank 0 a copy here (made anew with new
        workers: a new group)."""
        super().bring_up(module)
        assert self.ranks is not None
        self.home = self.ranks.split(module)

    def detach_hook(self, module):
        self.home = None
        return super().detach_hook(module)

    def run(self, *args, **kwargs):
        try:
            return split_call(self.live_ranks(), self.home, (), args, kwargs)
        except Unsplittable:
            self.whole += 1
            return self.forward_own(*args, **kwargs)

    def __getstate__(self):
        return {**super().__getstate__(), "home": None}


def split_call(ranks: Ranks, home: torch.nn.Module | None, to: tuple[int, ...], args: tuple, kwargs: dict) -> Any:
    """One split call: the whole inputs sent to the ranks ``to`` (every other rank where empty), each cutting its
    own share, as diffusers' ranks do; rank 0's copy ``home`` run here meanwhile; its output (the gathered whole:
    the other ranks keep theirs). ``Unsplittable`` where the tokens do not divide (every rank met it at the same
    layer, before any exchange: the caller runs the call whole)."""
    assert home is not None  # set by bring_up
    count = len(to) or len(ranks.devices)
    pending = ranks.submit([(args, kwargs)] * count, to=to, reply=False, expected=(Unsplittable,))
    return ranks.together(pending, functools.partial(home, *args, **kwargs))
