"""Guidance branches at once, each split by its tokens (mode ``"guidance_sequence"``, strategy ``"parallel"`` on 4
GPUs or more): what vLLM-Omni and xDiT call CFG parallel with Ulysses inside. A denoiser the pipeline calls once per
guidance branch (Wan, Qwen-Image, Flux's true CFG) whose class carries diffusers' context-parallel plan runs each
step's first call split across one half of its GPUs (``sequence.py``: its tokens cut, Ulysses attention exchanging
within that half) and the step's second call split across the other half, started ahead from the step before as
``guidance.py`` starts it, and used only when the call that arrives has exactly its inputs.

So the two modes compose without a new mechanism: this is ``GuidanceHook`` whose own forward is a sequence split over
the first half (``modes.branch_devices``) and whose copy is a sequence split over the second. Each half is a group of
its own (threads meeting at their own exchange), so the two branches never wait for each other's collectives. A call
whose tokens do not divide runs whole on the denoiser's own GPU; the second branch's then misses.
"""

from __future__ import annotations

import functools
from concurrent.futures import Future

import torch

from ..modes import branch_devices
from .copies import CopiesHook, call_on
from .exchange import ThreadGroup, release, thread_groups
from .guidance import GuidanceHook, Inputs
from .replica import CallerState, replica
from .sequence import Unsplittable, check_splittable, enable_split, run_ranks


class GuidanceSequenceHook(GuidanceHook):
    """A denoiser on ``device`` with a copy on each of ``replicas``: ``device`` and the first half of the replicas
    split each step's first call, the second half each step's second call, started ahead.

    ``whole`` counts the calls that ran whole on ``device`` because their tokens did not divide.
    """

    def __init__(self, component: str, device: str, execution_device: str, replicas: tuple[str, ...]):
        super().__init__(component, device, execution_device, replicas)
        first, second = branch_devices(str(self.device), tuple(str(d) for d in self.replica_devices))
        self.share = len(first)  # GPUs per branch
        self.whole = 0
        self.branches: list[list[torch.nn.Module]] = []  # each branch's ranks, rank 0 first
        self.groups: list[list[ThreadGroup]] = []  # each branch's group, one ThreadGroup per rank
        self._second: Future | None = None  # the second branch's last call started ahead

    @staticmethod
    def copied(replicas: tuple[str, ...]) -> tuple[str, ...]:
        return replicas  # a copy on every one: the first branch's other ranks, then the second branch's

    @property
    def branch_gpus(self) -> tuple[tuple[torch.device, ...], tuple[torch.device, ...]]:
        return (self.device, *self.replica_devices[:self.share - 1]), self.replica_devices[self.share - 1:]

    def init_hook(self, module):
        check_splittable(self.component, module, self.share)
        home = replica(module, self.device)  # shares the module's weights; made before its forward is taken over
        module = super().init_hook(module)
        cut = self.share - 1
        self.branches = [[home, *self.replicas[:cut]], list(self.replicas[cut:])]
        self.groups = [thread_groups(self.share, f"{self.component}-{half}") for half in ("first", "second")]
        for ranks, groups in zip(self.branches, self.groups):
            for rank, (copy, group) in enumerate(zip(ranks, groups)):
                enable_split(copy, rank, group)
        return module

    def detach_hook(self, module):
        self._settled()
        module = super().detach_hook(module)
        for groups in self.groups:
            release(groups)
        self.branches, self.groups, self._second = [], [], None
        return module

    def forward_own(self, *args, **kwargs):
        """The first branch (and a second one not started ahead): split across the first half."""
        first, _ = self.branch_gpus
        state, inputs = CallerState.capture(first), (args, kwargs)
        ranks = self.branches[0]
        others = [functools.partial(call_on, copy, device, None, inputs, state)
                  for copy, device in zip(ranks[1:], first[1:])]
        try:
            return run_ranks(self.start, self.groups[0][0].exchange, functools.partial(ranks[0], *args, **kwargs),
                             others, first[1:])
        except Unsplittable:
            self.whole += 1
            return CopiesHook.forward_own(self, *args, **kwargs)

    def _start(self, upcoming: Inputs) -> Future:
        """The second branch started ahead on the second half; its rank 0's output is the call's (left there)."""
        self._settled()  # a missed call still running holds the second half's exchange
        _, second = self.branch_gpus
        state = CallerState.capture((self.device, *second))
        inputs = self._on_copy(upcoming, second[0])
        ranks = self.branches[1]
        calls = [functools.partial(call_on, copy, device, None, inputs, state) for copy, device in zip(ranks, second)]
        exchange = self.groups[1][0].exchange
        self._second = self.start(lambda: run_ranks(self.start, exchange, calls[0], calls[1:], second[1:]), second[0])
        return self._second

    def _settled(self) -> None:
        """Wait for the second branch's last call started ahead (used or missed) to end."""
        if self._second is not None:
            self._second.exception()
            self._second = None

    def __getstate__(self):
        return {**super().__getstate__(), "branches": [], "groups": [], "_second": None}


