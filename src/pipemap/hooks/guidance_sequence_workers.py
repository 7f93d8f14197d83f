"""Guidance branches at once, each split by its tokens, on worker processes (mode ``"guidance_sequence"`` with
``PIPEMAP_WORKERS=process`` or ``ray``): ``guidance_sequence.GuidanceSequenceHook`` with every rank but this
process's a worker process (``workers.py``).

One group joins this process (rank 0) and a worker per other GPU; each branch's ranks then make a group of their own
out of it (``Workers.split`` with two halves: ranks 0..k-1 for the first branch, k..2k-1 for the second), so each
half's Ulysses attention exchanges only within the half and the two halves never wait for each other. Each step's
first call runs here on rank 0's copy with the first half's workers (``sequence_workers.split_on_workers``); its
second call is started ahead on the second half as ``guidance_workers`` starts it (the exact-match speculation kept:
used only when the call that arrives has exactly its inputs), and only the second half's first rank sends its output
back. A call to one half never waits for the other half's call to be received (``Workers.send`` drains only the calls
of the ranks it sends to).
"""

from __future__ import annotations

from typing import Any

from torch.utils._pytree import tree_unflatten

from ..errors import PipemapError
from .changes import signature
from .copies import CopiesHook
from .guidance import Inputs
from .guidance_sequence import GuidanceSequenceHook
from .guidance_workers import Ahead, Failed
from .sequence import Unsplittable, check_splittable, enable_split
from .sequence_workers import split_on_workers
from .worker import Source, caller_state
from .workers import OnWorkers, Workers, plain_copy


class ProcessGuidanceSequenceHook(OnWorkers, GuidanceSequenceHook):
    """``GuidanceSequenceHook`` whose ranks but rank 0 are worker processes, one per device of ``replicas``."""

    thread_hook = GuidanceSequenceHook

    def __init__(self, component: str, device: str, execution_device: str, replicas: tuple[str, ...]):
        super().__init__(component, device, execution_device, replicas)
        self.workers: Workers | None = None
        self.home: Any = None  # rank 0's copy here, sharing the module's weights, a rank of the first half's group

    @property
    def halves(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Each branch's ranks in the workers' group: this process and the first workers, then the rest."""
        return tuple(range(self.share)), tuple(range(self.share, 2 * self.share))

    def init_on_workers(self, module):
        check_splittable(self.component, module, self.share)
        self._home, self._made = module, signature(module, state=True)  # what ``copy_is_current`` compares with
        self.attach_workers(module)
        self.take_forward(module)
        return module

    def detach_hook(self, module):  # the workers stay: a new hook over the module (a followed change) reuses them
        module = super().detach_hook(module)
        self.workers = self._module = self.home = None
        return module

    def bring_up(self, module) -> None:
        """Workers given the module and split in two halves; rank 0 a copy here, a rank of the first half."""
        assert self.workers is not None  # set by attach_workers
        self.workers.sync(plain_copy(module), Source.of(module))
        first = self.workers.split(self.halves)
        home = plain_copy(module)  # new workers, new groups: rank 0 made anew over its half's too
        enable_split(home, 0, first)
        self.home = home

    def forward_own(self, *args, **kwargs):
        """The first branch: rank 0 here with the first half's workers."""
        try:
            return split_on_workers(self.running_workers(), self.home, self.halves[0][1:], args, kwargs)
        except Unsplittable:
            self.whole += 1
            return CopiesHook.forward_own(self, *args, **kwargs)

    def _start(self, upcoming: Inputs) -> Any:  # a Future's part: ``result()``
        inputs = tree_unflatten(list(upcoming.leaves), upcoming.spec)
        _, second = self.halves
        try:
            workers = self.running_workers()
            call = workers.send([inputs] * len(second), caller_state(), reply=(True,) + (False,) * (len(second) - 1),
                                expected=(Unsplittable,), to=second)
        except PipemapError as err:  # the workers gone (stopped): this branch runs here, the next call starts anew
            return Failed(err)
        return Ahead(workers, call)

    def __getstate__(self):  # a deep copy (the dry run's fake module) leaves the workers behind
        return {**super().__getstate__(), "workers": None, "_module": None, "home": None}

    def __repr__(self) -> str:
        copies = ", ".join(str(d) for d in self.replica_devices)
        return f"ProcessGuidanceSequenceHook({self.component!r}, device={self.device}, workers=[{copies}])"

