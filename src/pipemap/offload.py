"""Components that live in CPU RAM and run on a GPU: model offload and block streaming.

``"offload"``: the whole component is copied to its execution GPU when called and kept there while that GPU's room
allows; when room is needed the least recently used one is evicted. ``"stream"``: the component is copied block by
block (``inventory.stream_blocks``), the next block prefetched on a side CUDA stream while the current one computes,
each block evicted once it has run.

Why hooks of our own: accelerate's ``CpuOffload`` (diffusers' ``enable_model_cpu_offload``) copies each model back
to the CPU at the next model's call whatever room is left, from pageable memory, for one GPU; diffusers' group
offloading waits on the host for each prefetch and has one onload device per model. Here the CPU copy of every
tensor (the master, pinned when the GPU is CUDA) is kept, so eviction is free: the parameters point at their master
again and the GPU copy is released, no device-to-host copy.

On a plan remapped onto the CPU an onload from ``cpu`` to ``cpu`` clones the master, so weights are really swapped in
and out block by block; the byte counters then count that logical traffic, the bytes a GPU run would move.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Iterable

import torch

from .hooks import Moved, PlacementHook
from .inventory import stream_blocks
from .plan import Placement
from .transfer import move_tensor

_START = -1  # the block "before" the first one, in the recorded block order


def hook_for(placement: Placement, execution_device: str, ledger: Ledger) -> PlacementHook:
    """The hook that runs ``placement`` (mode ``"offload"`` or ``"stream"``) on its execution device."""
    kind = OffloadHook if placement.mode == "offload" else StreamHook
    return kind(placement.component, placement.execution_device, execution_device, ledger, placement.room)


def stats(pipe, reset: bool = False) -> dict[str, dict[str, int]]:
    """What each component's hook counted since dispatch: ``{component: {"calls", "h2d_bytes", "d2h_bytes"}}``.

    Bytes are weights moved (inputs and outputs are not counted); ``reset=True`` zeroes the counters after reading.

    >>> plan = pipemap.plan(pipe, hardware="cuda:0=8GiB", strategy="balanced_low_memory")      # doctest: +SKIP
    >>> pipemap.dispatch(pipe, plan); pipe("a cat"); pipemap.stats(pipe)["text_encoder"]       # doctest: +SKIP
    {'calls': 2, 'h2d_bytes': 492265168, 'd2h_bytes': 0}
    """
    out = {}
    for name, module in pipe.components.items():
        hook = getattr(module, "_hf_hook", None)
        if isinstance(getattr(hook, "moved", None), Moved):
            out[name] = dataclasses.asdict(hook.moved)
            if reset:
                hook.moved = Moved()
    return out


def onload_peaks(pipe) -> dict[str, int]:
    """The most bytes of offloaded or streamed weights each execution device held at once since dispatch."""
    for module in pipe.components.values():
        ledger = getattr(getattr(module, "_hf_hook", None), "ledger", None)
        if isinstance(ledger, Ledger):
            return dict(ledger.peak)
    return {}


# ---- tensors and their masters -----------------------------------------------------------------------------------


class _Slot:
    """One tensor of a component, a parameter or a buffer, with every module holding it, and its CPU master.

    Onloading puts a new Parameter (or buffer) on the device in the modules' dicts and evicting puts the master back:
    ``param.data = ...`` would keep the Parameter object, but PyTorch refuses it between a CPU and a meta fake tensor
    (the dry run), and evicting restores the very objects the pipeline had, so ``reset`` leaves it as it was.
    """

    __slots__ = ("store", "owners", "master", "onloaded")

    def __init__(self, store: str):
        self.store, self.owners = store, []  # "_parameters" or "_buffers"; (module, key) pairs
        self.master: torch.Tensor | None = None
        self.onloaded: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        owner, key = self.owners[0]
        return getattr(owner, self.store)[key]

    def set(self, tensor: torch.Tensor) -> None:
        for owner, key in self.owners:
            getattr(owner, self.store)[key] = tensor

    def set_data(self, tensor: torch.Tensor) -> None:
        """Replace what the held tensor stores, the Parameter object kept (pinning, keeping a dtype change)."""
        if self.store == "_parameters":
            self.get().data = tensor
        else:
            self.set(tensor)

    def wrap(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.store == "_parameters":
            return torch.nn.Parameter(tensor, requires_grad=self.master.requires_grad)
        return tensor


def _slots(modules: Iterable[torch.nn.Module]) -> dict[int, _Slot]:
    """Every tensor of ``modules`` once, keyed by the identity of its Parameter or buffer (non-persistent too)."""
    found: dict[int, _Slot] = {}
    for module in modules:
        for store in ("_parameters", "_buffers"):
            for key, tensor in getattr(module, store).items():
                if tensor is not None:
                    slot = found.setdefault(id(tensor), _Slot(store))
                    if (module, key) not in slot.owners:
                        slot.owners.append((module, key))
    return found


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _copy(master: torch.Tensor, device: torch.device, non_blocking: bool) -> torch.Tensor:
    if master.device == device:
        return master.clone()  # a plan remapped onto the CPU: swap for real, so the same code path runs
    if non_blocking:
        # transfer.move_tensor has no non_blocking; host-to-GPU copies are never staged (only GPU pairs are), and
        # from pinned memory this one is queued on the current stream without the host waiting for it.
        return master.to(device, non_blocking=True)
    return move_tensor(master, device)


class _Group:
    """Tensors moved together (a whole component, one block, or a streamed component's loose tensors)."""

    def __init__(self, slots: Iterable[_Slot]):
        self.slots = list(slots)
        self.loaded = False
        self.event = None  # set when prefetched on a side stream: the copy is done once it has passed

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(s.get()) for s in self.slots)

    def onload(self, device: torch.device, non_blocking: bool) -> int:
        moved = 0
        for slot in self.slots:
            slot.master = slot.get()  # what it holds while evicted: a `.to(dtype)` made meanwhile is kept
            slot.onloaded = slot.wrap(_copy(slot.master.detach(), device, non_blocking))
            slot.set(slot.onloaded)
            moved += _nbytes(slot.master)
        self.loaded = True
        return moved

    def evict(self) -> int:
        """Put every master back; returns the bytes copied back (only tensors whose dtype changed meanwhile)."""
        copied = 0
        for slot in self.slots:
            current = slot.get()
            slot.set(slot.master)
            if current.dtype != slot.master.dtype:  # converted while onloaded (vae.to(float32)): keep that
                slot.set_data(move_tensor(current.detach(), torch.device("cpu")))
                copied += _nbytes(current)
            slot.onloaded = None
        self.loaded, self.event = False, None
        return copied

    def pin(self) -> None:
        """Masters in page-locked memory: host-to-GPU copies then run at full speed and without the host waiting."""
        for slot in self.slots:
            tensor = slot.get()
            if tensor.device.type == "cpu" and not tensor.is_pinned():
                slot.set_data(tensor.detach().pin_memory())

    def unpin(self) -> None:
        for slot in self.slots:
            tensor = slot.get()
            if tensor.device.type == "cpu" and tensor.is_pinned():
                plain = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device="cpu")
                slot.set_data(plain.copy_(tensor.detach()))


# ---- budgets -----------------------------------------------------------------------------------------------------


class Ledger:
    """What one dispatch onloads: an LRU cache per execution device and the bytes onloaded on each, with the peak.

    Caches are keyed by device and room (``Placement.room``), so a plan remapped onto the CPU keeps one cache per
    original GPU (two GPUs of equal room then share one, which can only evict more).
    """

    def __init__(self):
        self.caches: dict[tuple[str, int], _Cache] = {}
        self.live: collections.Counter = collections.Counter()
        self.peak: collections.Counter = collections.Counter()

    def cache(self, device: str, room: int) -> _Cache:
        return self.caches.setdefault((device, room), _Cache(room))

    def add(self, device: str, size: int) -> None:
        self.live[device] += size
        self.peak[device] = max(self.peak[device], self.live[device])


class _Cache:
    """The offloaded components onloaded on one device, least recently used first, within ``room`` bytes."""

    def __init__(self, room: int):
        self.room = room
        self.loaded: collections.OrderedDict[OffloadHook, int] = collections.OrderedDict()

    def use(self, hook: OffloadHook) -> None:
        if hook in self.loaded:
            self.loaded.move_to_end(hook)
            return
        size = hook.group.nbytes
        for other in list(self.loaded):
            if sum(self.loaded.values()) + size <= self.room:
                break
            self.drop(other)
            other.evict()
        hook.onload()
        self.loaded[hook] = size

    def drop(self, hook: OffloadHook) -> None:
        self.loaded.pop(hook, None)


# ---- hooks -------------------------------------------------------------------------------------------------------


class _MovingHook(PlacementHook):
    """What offload and stream hooks share: weights in CPU RAM, run on ``device``, counted in ``moved``."""

    def __init__(self, component: str, device: str, execution_device: str, ledger: Ledger, room: int):
        super().__init__(component, device, execution_device)
        self.ledger, self.room = ledger, room
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()

    def _onload(self, group: _Group) -> None:
        size = group.onload(self.device, self.cuda)
        self.moved.h2d_bytes += size
        self.ledger.add(str(self.device), size)

    def _evict(self, group: _Group) -> None:
        self.ledger.add(str(self.device), -group.nbytes)
        self.moved.d2h_bytes += group.evict()


class OffloadHook(_MovingHook):
    """The whole component onloaded at its call through its device's LRU cache, kept there while room allows."""

    def init_hook(self, module):
        self.group = _Group(_slots(module.modules()).values())
        self.cache = self.ledger.cache(str(self.device), self.room)
        if self.cuda:
            self.group.pin()
        return module

    def pre_forward(self, module, *args, **kwargs):
        self.cache.use(self)
        return super().pre_forward(module, *args, **kwargs)

    def onload(self) -> None:
        self._onload(self.group)

    def evict(self) -> None:
        self._evict(self.group)

    def detach_hook(self, module):
        self.cache.drop(self)
        if self.group.loaded:
            self.evict()
        self.group.unpin()
        return module

    def __repr__(self) -> str:
        return f"OffloadHook({self.component!r}, device={self.device}, room={self.room})"


class StreamHook(_MovingHook):
    """The component's loose tensors onloaded for its call; its blocks one by one, the next one prefetched.

    The block order is learnt as the component runs (the last block seen after each block), so the first call
    prefetches nothing it has not seen and a wrong guess costs only a copy: a block that finds another one
    prefetched evicts it first, so at most two blocks are in flight.
    """

    def init_hook(self, module):
        blocks = [b for _, b in stream_blocks(module)]
        every = _slots(module.modules())
        owner: dict[int, int] = {}
        for index, block in enumerate(blocks):
            for key in _slots(block.modules()):
                owner[key] = index if key not in owner else _START  # shared by two blocks: it stays for the call
        groups: dict[int, list[_Slot]] = collections.defaultdict(list)
        for key, slot in every.items():
            groups[owner.get(key, _START)].append(slot)
        self.root, self.blocks = _Group(groups[_START]), [_Group(groups[i]) for i in range(len(blocks))]
        self.handles = [h for i, b in enumerate(blocks) if self.blocks[i].slots for h in self._attach(i, b)]
        self.next_of: dict[int, int] = {}
        self.previous, self.prefetched, self.depth = _START, None, 0
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        if self.cuda:
            for group in [self.root, *self.blocks]:
                group.pin()
        return module

    def _attach(self, index: int, block: torch.nn.Module) -> list:
        return [block.register_forward_pre_hook(functools.partial(self._enter, index)),
                block.register_forward_hook(functools.partial(self._leave, index), always_call=True)]

    def pre_forward(self, module, *args, **kwargs):
        if self.depth == 0:
            self._onload(self.root)
            self.previous = _START
            self._prefetch(self.next_of.get(_START))
        self.depth += 1
        return super().pre_forward(module, *args, **kwargs)  # counts the call

    def post_forward(self, module, output):
        self.depth -= 1
        if self.depth == 0:
            for group in [self.root, *self.blocks]:
                if group.loaded:
                    self._evict(group)
            self.prefetched = None
        return super().post_forward(module, output)

    def _enter(self, index: int, block, args) -> None:
        group = self.blocks[index]
        if self.prefetched is not None and self.prefetched != index and self.blocks[self.prefetched].loaded:
            self._evict(self.blocks[self.prefetched])  # a wrong guess: keep two blocks in flight at most
        if not group.loaded:
            self._onload(group)
        elif group.event is not None:
            self._wait(group)
        self.prefetched = None
        self.next_of[self.previous] = index
        self.previous = index
        self._prefetch(self.next_of.get(index))

    def _leave(self, index: int, block, args, output) -> None:
        if self.blocks[index].loaded:
            self._evict(self.blocks[index])

    def _prefetch(self, index: int | None) -> None:
        if index is None or self.blocks[index].loaded:
            return
        group = self.blocks[index]
        if self.stream is None:
            self._onload(group)  # no CUDA stream: onload now, the same bytes in flight, no overlap
        else:
            with torch.cuda.stream(self.stream):
                self._onload(group)
                group.event = torch.cuda.Event()
                group.event.record(self.stream)
        self.prefetched = index

    def _wait(self, group: _Group) -> None:
        # the compute stream waits for the copy on the GPU, the host does not; the copies were made on the side
        # stream, so tell the allocator they are used on this one or it may reuse their memory too early
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(group.event)
        for slot in group.slots:
            slot.onloaded.record_stream(compute)
        group.event = None

    def detach_hook(self, module):
        for handle in self.handles:
            handle.remove()
        for group in [self.root, *self.blocks]:
            if group.loaded:
                self._evict(group)
            group.unpin()
        return module

    def __repr__(self) -> str:
        return f"StreamHook({self.component!r}, device={self.device}, blocks={len(self.blocks)})"
