"""Guidance branches at once, each split by its tokens (mode ``"guidance_sequence"``, strategy ``"parallel"`` on 4
GPUs or more): what vLLM-Omni and xDiT call CFG parallel with Ulysses inside. A denoiser the pipeline calls once per
guidance branch (Wan, Qwen-Image, Flux's true CFG) whose class carries diffusers' context-parallel plan runs each
step's first call split across one half of its GPUs (``sequence.py``: its tokens cut, Ulysses attention exchanging
within that half) and the step's second call split across the other half, started ahead from the step before as
``guidance.py`` starts it, and used only when the call that arrives has exactly its inputs.

So the two modes compose without a new mechanism: this is ``GuidanceHook`` whose own forward is a sequence split over
the first half (``modes.branch_devices``) and whose copy is a sequence split over the second. Each half is a group of
its own (``Ranks.split`` with two halves), so the two branches never wait for each other's collectives, and a call to
one half never waits for the other half's call to be taken. A call
whose tokens do not divide runs whole on the denoiser's own GPU; the second branch's then misses.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_unflatten

from ..errors import PipemapError, Unsplittable
from ..modes import branch_devices
from .context import check_splittable
from .copies import CopiesHook
from .guidance import Failed, GuidanceHook, Inputs
from .sequence import split_call


class GuidanceSequenceHook(GuidanceHook):
    """A denoiser on ``device`` with a rank on each of ``replicas``: ``device`` and the first half of the replicas
    split each step's first call, the second half each step's second call, started ahead.

    ``whole`` counts the calls that ran whole on ``device`` because their tokens did not divide.
    """

    def __init__(self, component: str, device: str, execution_device: str, replicas: tuple[str, ...],
                 runtime: str = "thread", asked: bool = False):
        super().__init__(component, device, execution_device, replicas, runtime, asked)
        first, _ = branch_devices(str(self.device), tuple(str(d) for d in self.replica_devices))
        self.share = len(first)  # GPUs per branch
        self.whole = 0
        self.home: torch.nn.Module | None = None  # rank 0's copy here, a rank of the first half's group

    @staticmethod
    def copied(replicas: tuple[str, ...]) -> tuple[str, ...]:
        return replicas  # a rank on every one: the first branch's other ranks, then the second branch's

    @property
    def halves(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Each branch's ranks: rank 0 and the first ranks, then the rest."""
        return tuple(range(self.share)), tuple(range(self.share, 2 * self.share))

    @property
    def branches(self) -> list[list[torch.nn.Module]]:
        """Each branch's copies held in this process, rank 0's first (the second branch's: thread ranks' only)."""
        if self.home is None:
            return []
        return [[self.home, *self.replicas[:self.share - 1]], self.replicas[self.share - 1:]]

    def init_hook(self, module):
        check_splittable(self.component, module, self.share)
        return super().init_hook(module)

    def bring_up(self, module) -> None:
        """Every rank given the module and split in two halves, each a group of its own; rank 0 a copy here, a
        rank of the first half."""
        CopiesHook.bring_up(self, module)
        assert self.ranks is not None
        self.home = self.ranks.split(module, self.halves)

    def detach_hook(self, module):
        self.home = None
        return super().detach_hook(module)

    def forward_own(self, *args, **kwargs):
        """The first branch (and a second one not started ahead): split across the first half."""
        try:
            return split_call(self.live_ranks(), self.home, self.halves[0][1:], args, kwargs)
        except Unsplittable:
            self.whole += 1
            return CopiesHook.forward_own(self, *args, **kwargs)

    def _start(self, upcoming: Inputs) -> Any:  # a ``ranks.Pending``
        """The second branch started ahead on the second half; only its first rank answers (the gathered whole)."""
        inputs = tree_unflatten(list(upcoming.leaves), upcoming.spec)
        second = self.halves[1]
        try:
            return self.live_ranks().submit([inputs] * len(second), to=second,
                                            reply=(True,) + (False,) * (len(second) - 1), expected=(Unsplittable,))
        except PipemapError as err:  # the workers gone (stopped): this branch runs here, the next call starts anew
            return Failed(err)

    def __getstate__(self):
        return {**super().__getstate__(), "home": None}
