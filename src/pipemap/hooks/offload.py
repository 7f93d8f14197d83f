"""Model offload (mode ``"offload"``): the component lives in CPU RAM and is copied whole to its execution GPU when
called, kept there while that GPU's room allows; when room is needed the least recently used one is evicted
(``moving.LruCache``)."""

from __future__ import annotations

import torch

from ..plan import Placement
from .mapped import pin_from_map
from .moving import Ledger, MovingHook
from .packing import Group, slots
from .resident import outside_graphs


class OffloadHook(MovingHook):
    """The whole component onloaded at its call through its device's LRU cache, kept there while room allows.

    The buffer is allocated and filled on the compute queue, so once evicted it serves the next onload at once. The
    copy's event is kept while the weights stay onloaded: each call waits for it on its own compute queue, so a call
    on another CUDA stream (a caller's ``torch.cuda.stream``) never reads weights before they arrive.
    """

    from_disk = False  # its plan leaves it in its files (``Placement.disk_bytes``)

    def moved_groups(self) -> list[Group]:
        return [self.group] if hasattr(self, "group") else []

    @classmethod
    def for_placement(cls, p: Placement, execution_device: str, ledger: Ledger) -> OffloadHook:
        """The hook of an offloaded placement (``hooks.HOOKS``), onloaded within its GPU's ``room``."""
        hook = cls(p.component, p.execution_device, execution_device, ledger, p.room)
        hook.from_disk = bool(p.disk_bytes)
        return hook

    def init_hook(self, module):
        self.group = Group(slots(module.modules()).values(), self.component)
        self.cache = self.ledger.cache(str(self.device), self.room)
        self.cache.join(self, self.room)
        self.buffer: torch.Tensor | None = None
        self.copied = None  # the event of the copy into ``buffer``
        self.running = 0
        if self.from_disk:  # the disk tier: read from its files' maps at each onload, never pinned
            self.read_from_files([self.group])
        elif self.cuda:
            pin_from_map(self.group)
        self.watch_conversions(module)
        return module

    def pre_forward(self, module, *args, **kwargs):
        self.running += 1  # first: an onload that fails is undone by abort
        self.cache.use(self)
        self.queues.wait(self.copied)
        self.queues.reading(self.buffer)
        return super().pre_forward(module, *args, **kwargs)

    def post_forward(self, module, output):
        self.running -= 1
        # a room smaller than the component keeps none of it onloaded
        if not self.running and self.cache.over(self.ledger):
            self.cache.drop(self)
            self.evict()
        return super().post_forward(module, output)

    def abort(self, module) -> None:
        if self.running:
            self.running = 0
            self.cache.drop(self)
            if self.group.loaded:
                self.evict()

    @property
    def busy(self) -> bool:
        return bool(self.running)

    def onload(self) -> None:
        self.buffer, self.copied = self._onload(self.group)

    def evict(self) -> None:
        self._evict(self.group)
        assert self.buffer is not None  # evicted only when onloaded
        self._free(self.buffer, [self.copied])
        self.buffer = self.copied = None

    def held_buffers(self) -> list[torch.Tensor]:
        return [self.buffer] if self.buffer is not None and not self.running else []

    def unload(self) -> None:
        if self.group.loaded and not self.running:
            self.cache.drop(self)
            self.evict()

    def detach_hook(self, module):
        self.unwatch_conversions(module)
        self.cache.drop(self)
        self.cache.leave(self)
        if self.group.loaded:
            self.evict()
        self.group.unpin()  # after the last copy out of its pinned buffer ran
        self.leave_files()
        return module

    def __repr__(self) -> str:
        return f"OffloadHook({self.component!r}, device={self.device}, room={self.room})"


outside_graphs(OffloadHook)
