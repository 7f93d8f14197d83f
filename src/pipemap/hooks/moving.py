"""What model offload and block streaming share: weights whose masters live in CPU RAM, onloaded into GPU buffers
through the device's queues (``streams.Queues``) and counted, and the ledger of what one dispatch holds where.

Why hooks of our own: accelerate's ``CpuOffload`` (diffusers' ``enable_model_cpu_offload``) copies each model back
to the CPU at the next model's call whatever room is left, from pageable memory, for one GPU; diffusers' group
offloading waits on the host for each prefetch and has one onload device per model. Here the CPU copy of every
tensor (the master, in one exact-size pinned buffer per group when the GPU is CUDA: ``packing``) is kept, so
eviction is free: the parameters point at their master again and the GPU buffer is released, no device-to-host copy.

On a plan remapped onto the CPU an onload from ``cpu`` to ``cpu`` copies into a new buffer, so weights are really
swapped in and out; the byte counters then count that logical traffic, the bytes a GPU run would move.
"""

from __future__ import annotations

import collections
import functools
import threading
import weakref
from collections.abc import Callable
from typing import Protocol

import torch

from ..runtime.streams import Queues, queues_for
from .mapped import Pages, Staging
from .packing import Group
from .resident import CallLock, PlacementHook


class Held(Protocol):
    """What ``LruCache`` asks of what holds room in it (a stream hook's buffers, ``hold``): its ledger (its
    pipeline), whether a call of it runs (then it is never evicted), evict and unload."""

    ledger: Ledger

    @property
    def busy(self) -> bool: ...

    def evict(self) -> None: ...

    def unload(self) -> None: ...

    def held_buffers(self) -> list[torch.Tensor]:
        """The GPU buffers ``unload`` would free."""
        ...

    def block_bytes(self, buffer: torch.Tensor) -> int:
        """The bytes the allocator counts for ``buffer``."""
        ...


class Cached(Held, Protocol):
    """What ``LruCache`` keeps onloaded (an ``offload.OffloadHook``): also its group and onload."""

    @property
    def group(self) -> Group: ...

    def onload(self) -> None: ...


class Ledger:
    """What one dispatch onloads: an LRU cache per execution device, the device memory each holds for onloaded
    weights (buffers, counted at their size) with the peak, and each device's queues (``streams``).

    Caches are keyed by device and room (``Placement.room``), so a plan remapped onto the CPU keeps one cache per
    original GPU (two GPUs of equal room then share one, which can only evict more).

    ``shared`` (a placed pipeline's ledger, ``hooks.hook_maker``; not the dry run's): its cache on a CUDA device is
    that device's one process-wide ``SharedCache``, so pipelines placed on one GPU evict each other's onloaded
    components, and its hooks take turns with theirs by one process-wide ``lock``. Its own ``lock`` otherwise.
    """

    def __init__(self, queues: Callable[[torch.device], Queues] = queues_for, shared: bool = False):
        self.make_queues = queues  # the dry run passes its stand-in queues, which tell its tracker what is weights
        self.shared = shared and torch.cuda.is_available()
        self.lock = SHARED_LOCK if self.shared else CallLock()
        self.caches: dict[tuple[str, int], LruCache] = {}
        self.live: collections.Counter = collections.Counter()
        self.peak: collections.Counter = collections.Counter()
        self._queues: dict[str, Queues] = {}
        self._staging: dict[str, Staging] = {}

    def shared_on(self, device: torch.device) -> SharedCache | None:
        """``device``'s process-wide cache when this ledger shares it (a placed pipeline's, on a GPU), else None."""
        return shared_cache(str(device)) if self.shared and device.type == "cuda" else None

    def cache(self, device: str, room: int) -> LruCache:
        if (device, room) not in self.caches:
            on_gpu = self.shared and torch.device(device).type == "cuda"
            self.caches[device, room] = shared_cache(device) if on_gpu else LruCache(room)
        return self.caches[device, room]

    def queues(self, device: torch.device) -> Queues:
        if str(device) not in self._queues:
            self._queues[str(device)] = self.make_queues(device)
        return self._queues[str(device)]

    def staging(self, device: torch.device) -> Staging:
        """The device's staging ring, which the groups read from their files pass through (``mapped``)."""
        if str(device) not in self._staging:
            self._staging[str(device)] = Staging(self.queues(device))
        return self._staging[str(device)]

    def add(self, device: str, size: int) -> None:
        self.live[device] += size
        self.peak[device] = max(self.peak[device], self.live[device])


class LruCache:
    """The offloaded components onloaded on one device, least recently used first, within ``room`` bytes."""

    def __init__(self, room: int):
        self._room = room
        self.loaded: collections.OrderedDict[Held, int] = collections.OrderedDict()
        self.holding: weakref.WeakSet[Held] = weakref.WeakSet()  # the members in ``loaded`` by ``hold``

    @property
    def room(self) -> int:
        return self._room

    def join(self, hook: Cached, room: int) -> None:
        """``hook`` onloads through this cache within ``room`` (its plan's): one ledger's cache has its own room."""

    def leave(self, hook: Cached) -> None:
        """``hook`` is detached: its room no longer counts."""

    def use(self, hook: Cached) -> None:
        if hook in self.loaded:
            self.loaded.move_to_end(hook)
            return
        # its tensors' bytes at the dtype in use (a vae upcast to float32 counts its float32 bytes), as the plan's
        # room counts them: the buffer's alignment gaps (``layout.nbytes``) would put a component exactly as large
        # as its room over it, and evict it after every call (a quantized one, of many small tensors, by 0.3%)
        size = hook.group.nbytes
        self._make_room(hook, size, lambda other: True)
        hook.onload()
        self.loaded[hook] = size

    def hold(self, hook: Held, size: int) -> None:
        """``hook`` (a stream hook: its buffers for a call, then its kept pieces) holds ``size`` bytes here from now
        (0: none). Room is made by evicting what other pipelines keep (least recently used first, never a running
        one): its own pipeline's plan already put its buffers beside its own offloaded components, so those stay."""
        self.drop(hook)
        self.holding.discard(hook)
        if size:
            self._make_room(hook, size, lambda other: other.ledger is not hook.ledger)
            self.loaded[hook] = size
            self.holding.add(hook)

    def _make_room(self, hook: Held, size: int, evictable: Callable[[Held], bool]) -> None:
        for other in list(self.loaded):
            if self.taken(hook.ledger) + size <= self.room:
                return
            if other is not hook and not other.busy and evictable(other):
                self.drop(other)
                other.evict()

    def taken(self, ledger: Ledger) -> int:
        """The bytes onloaded here, as ``ledger``'s plan counts them against its room: its own stream buffers are
        beside the room (planned apart), every other pipeline's are in it."""
        return sum(size for h, size in self.loaded.items() if not (h in self.holding and h.ledger is ledger))

    def drop(self, hook: Held) -> None:
        self.loaded.pop(hook, None)
        self.holding.discard(hook)

    def over(self, ledger: Ledger) -> bool:
        """Whether what is onloaded exceeds the room (a component larger than its room, onloaded for its call)."""
        return self.taken(ledger) > self.room


class SharedCache(LruCache):
    """One GPU's cache shared by every placed pipeline that offloads onto it (``shared_cache``): the second
    pipeline's onload evicts the first's kept VAE when room is short, and the other way round.

    Its room is the smallest of its members' rooms. Each plan's room is what it saw free on the GPU less its own
    resident weights and headroom: a plan made later saw the earlier pipelines' resident weights (and any component
    they kept onloaded) as taken, so its room is the smaller one, and the only one still true once those weights
    are there; the earlier plan's larger room counts memory they now take. The smallest is kept rather than the
    last one's, which also holds for a plan made on a budget of its own. A member detached (``pipemap.reset``)
    leaves, and the room is the smallest of the rest again. Headroom: the calls take turns (``SHARED_LOCK``), and
    the room kept free for activations is the planned-last pipeline's; a pipeline that planned a larger headroom
    than it gets no more than that.
    """

    def __init__(self) -> None:
        super().__init__(0)
        # weakly: a pipeline dropped without reset leaves by itself (its onloaded hooks stay until evicted)
        self.rooms: weakref.WeakKeyDictionary[Cached, int] = weakref.WeakKeyDictionary()

    @property
    def room(self) -> int:
        return min(self.rooms.values(), default=0)

    def join(self, hook: Cached, room: int) -> None:
        self.rooms[hook] = room

    def leave(self, hook: Cached) -> None:
        self.rooms.pop(hook, None)


# one cache and one call lock per process for the GPUs placed pipelines offload onto; a cache lives while one of
# its members' ledgers does (a test's fake CUDA gone with its pipelines leaves no cache behind)
_SHARED: weakref.WeakValueDictionary[str, SharedCache] = weakref.WeakValueDictionary()
_MAKING = threading.Lock()
# One lock, not one per GPU: one pipeline's moving hooks took turns by one lock before, on every GPU; per-GPU locks
# would let a pipeline offloading onto two GPUs run both at once, and two threads could take them in opposite orders.
SHARED_LOCK = CallLock()


def unload_shared() -> None:
    """Evict what placed pipelines keep onloaded on their GPUs between calls (after a running call: the lock)."""
    with SHARED_LOCK:
        for cache in list(_SHARED.values()):
            for hook in list(cache.loaded):
                hook.unload()  # not one running: a call inside another (the lock is re-entrant) keeps its own


def kept_shared() -> dict[str, int]:
    """The GPU bytes placed pipelines keep onloaded between calls, per device: what ``unload_shared`` would give
    back, counted without moving anything (each buffer as the allocator counted it: ``MovingHook.block_bytes``)."""
    kept: dict[str, int] = collections.Counter()
    with SHARED_LOCK:
        for device, cache in list(_SHARED.items()):
            for hook in list(cache.loaded):
                if not hook.busy:
                    kept[device] += sum(hook.block_bytes(buffer) for buffer in hook.held_buffers())
    return dict(kept)


def shared_cache(device: str) -> SharedCache:
    """The process-wide cache of what placed pipelines keep onloaded on ``device``."""
    with _MAKING:
        cache = _SHARED.get(device)
        if cache is None:
            cache = _SHARED[device] = SharedCache()
        return cache


class MovingHook(PlacementHook):
    """What offload and stream hooks share: weights in CPU RAM, run on ``device``, counted in ``moved``.

    A failure inside the component's call (an out-of-memory error, most likely) skips accelerate's
    ``post_forward``; ``dispatch.hook_component`` then calls ``abort``, which evicts what the call onloaded, so the
    next call starts with the memory the first one had.
    """

    rehooked_on_change = True

    def __init__(self, component: str, device: str, execution_device: str, ledger: Ledger, room: int):
        super().__init__(component, device, execution_device)
        self.ledger, self.room = ledger, room
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.queues = ledger.queues(self.device)
        self.from_files: dict[int, Pages] = {}  # id(group) -> its pages in a file's map, for groups on the disk
        self.allocated: dict[int, int] = {}  # id(buffer) -> the bytes the CUDA allocator counted for it (``_alloc``)

    def _onload(self, group: Group, buffer: torch.Tensor | None = None, after=None, side: bool = False):
        """Copy ``group`` into ``buffer`` (a new one of its own when None) once ``after`` passed; returns the
        buffer and the copy's event."""
        if self.cuda:
            group.repin()
        own = buffer is None
        if buffer is None:
            buffer = self._alloc(group.layout.nbytes)
        try:
            copies = group.install(buffer)
            if id(group) in self.from_files:  # the disk tier: through the staging ring, then its pages let go
                event = self._staged(group, buffer, copies, after, side)
            else:
                event = self.queues.copy(copies, after=after, side=side, name=group.name)
        except BaseException:  # nothing half onloaded: the masters back, the buffer freed
            if group.loaded:
                group.evict()
            if own:
                self._free(buffer)
            raise
        group.copied(event)  # its pinned buffer is not unregistered before this copy ran
        self.moved.h2d_bytes += group.nbytes
        return buffer, event

    def _staged(self, group: Group, buffer: torch.Tensor, copies, after, side: bool):
        staging = self.ledger.staging(self.device)
        masters = [master for _, master in copies]
        pages = self.from_files[id(group)]
        if pages.written(masters):  # written in place since (``fuse_lora``): its private pages are kept from now
            pages = self.from_files[id(group)] = Pages(masters)
        pages.check(self.component)  # the file changed under the map: a typed error, not its new bytes or SIGBUS
        if after is None:
            # the ring copies on the side queue, into a buffer from the compute queue's pool: memory that work
            # already queued there (an activation just freed, an evicted component) may still use; so the copy
            # waits for the compute queue's current point
            after = self.queues.record()
        event = staging.copy(buffer, group.layout, masters, after, group.name, pages)
        if not side:  # asked for on the compute queue, so ordered before every use: make it so
            self.queues.wait(event)
        return event

    def read_from_files(self, groups) -> None:
        """These groups stay in their files (the disk tier): never pinned, read through the device's staging ring
        at each onload, their pages given back after; the dry run counts them on the disk. A hook with none is no
        user of the ring (it would hold the ring's page-locked slots past the last reader's detach)."""
        groups = list(groups)
        if not groups:
            return
        staging = self.ledger.staging(self.device)
        staging.users.add(id(self))
        for group in groups:
            self.from_files[id(group)] = Pages(s.get() for s in group.slots)
            staging.need(group.layout.nbytes)
        self.queues.on_disk(s.get() for group in groups for s in group.slots)

    def leave_files(self) -> None:
        """At detach: this hook reads no more through its device's staging ring (the last one gives it back)."""
        if self.from_files:
            self.from_files = {}
            self.ledger.staging(self.device).leave(self)

    def _alloc(self, nbytes: int) -> torch.Tensor:
        before = torch.cuda.memory_allocated(self.device) if self.cuda else 0
        buffer = self.queues.alloc(nbytes)  # first: an allocation that fails (out of memory) is not counted
        if self.cuda:  # the allocator's figure, bounded: another thread's allocation meanwhile is not counted
            least = -(-nbytes // 512) * 512
            self.allocated[id(buffer)] = min(max(least, torch.cuda.memory_allocated(self.device) - before),
                                          least + 2**21)
        self.ledger.add(str(self.device), nbytes)
        return buffer

    def _free(self, buffer: torch.Tensor, copies=()) -> None:
        self.allocated.pop(id(buffer), None)
        self.ledger.add(str(self.device), -buffer.numel())
        self.queues.free(buffer, copies)

    def _evict(self, group: Group) -> None:
        self.moved.d2h_bytes += group.evict()

    def watch_conversions(self, module: torch.nn.Module) -> None:
        """A ``.to(dtype)`` of the component (the SDXL pipeline upcasts its VAE for each decode) first gives back
        what is onloaded between calls: converted on the GPU, the weights would sit in new tensors beside the
        buffer the plan counted; converted in CPU RAM, the next call onloads them at their new size."""
        module.__dict__["_apply"] = functools.partial(_converting, self, module)

    def unwatch_conversions(self, module: torch.nn.Module) -> None:
        module.__dict__.pop("_apply", None)

    @property
    def busy(self) -> bool:
        """Whether a call of the component runs now (what it holds is then never evicted)."""
        return False

    def unload(self) -> None:
        """Give back what is onloaded between calls (nothing while a call runs)."""

    def held_buffers(self) -> list[torch.Tensor]:
        """The GPU buffers ``unload`` would free now."""
        return []

    def block_bytes(self, buffer: torch.Tensor) -> int:
        """The bytes the CUDA allocator counted for ``buffer`` (``_alloc``): a block's unsplit rest included (a
        cached large block is not split for a rest under 1 MiB), so what its eviction gives back; else its size
        at CUDA's 512-byte granularity."""
        return self.allocated.get(id(buffer), -(-buffer.numel() // 512) * 512)

    def abort(self, module) -> None:
        """Undo what an unfinished call onloaded (its ``post_forward`` never ran)."""


def _converting(hook: MovingHook, module: torch.nn.Module, fn, recurse: bool = True):
    # under the hooks' call lock: a conversion from another thread (diffusers' from_pipe ends in the copy's
    # ``.to(dtype)`` of every shared model) waits for the running call, so it neither evicts what that call onloads
    # nor sets the weights' ``.data`` back to their masters under it; a call's own conversion (re-entrant) goes on
    with hook.lock:
        hook.unload()
        return type(module)._apply(module, fn, recurse)
