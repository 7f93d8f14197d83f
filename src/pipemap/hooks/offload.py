"""Model offload (mode ``"offload"``): the component lives in CPU RAM and is copied whole to its execution GPU when
called, kept there while that GPU's room allows; when room is needed the least recently used one is evicted
(``moving.LruCache``)."""

from __future__ import annotations

import torch

from ..plan import Placement
from .mapped import pin_from_map
from .moving import Ledger, MovingHook
from .packing import Group, slots


class OffloadHook(MovingHook):
    """The whole component onloaded at its call through its device's LRU cache, kept there while room allows.

    The buffer is allocated and filled on the compute queue, so once evicted it serves the next onload at once.
    """

    from_disk = False  # its plan leaves it in its files (``Placement.disk_bytes``)

    @classmethod
    def for_placement(cls, p: Placement, execution_device: str, ledger: Ledger) -> OffloadHook:
        """The hook of an offloaded placement (``hooks.HOOKS``), onloaded within its GPU's ``room``."""
        hook = cls(p.component, p.execution_device, execution_device, ledger, p.room)
        hook.from_disk = bool(p.disk_bytes)
        return hook

    def init_hook(self, module):
        self.group = Group(slots(module.modules()).values(), self.component)
        self.cache = self.ledger.cache(str(self.device), self.room)
        self.buffer: torch.Tensor | None = None
        self.running = 0
        if self.from_disk:  # the disk tier: read from its files' maps at each onload, never pinned
            self.read_from_files([self.group])
        elif self.cuda:
            pin_from_map(self.group)
        return module

    def pre_forward(self, module, *args, **kwargs):
        self.running += 1  # first: an onload that fails is undone by abort
        self.cache.use(self)
        return super().pre_forward(module, *args, **kwargs)

    def post_forward(self, module, output):
        self.running -= 1
        return super().post_forward(module, output)

    def abort(self, module) -> None:
        if self.running:
            self.running = 0
            self.cache.drop(self)
            if self.group.loaded:
                self.evict()

    def onload(self) -> None:
        self.buffer, _ = self._onload(self.group)

    def evict(self) -> None:
        self._evict(self.group)
        self._free(self.buffer)
        self.buffer = None

    def detach_hook(self, module):
        self.cache.drop(self)
        if self.group.loaded:
            self.evict()
        self.group.unpin()
        return module

    def __repr__(self) -> str:
        return f"OffloadHook({self.component!r}, device={self.device}, room={self.room})"
