"""Components that live in CPU RAM and run on a GPU: model offload and block streaming.

``"offload"``: the whole component is copied to its execution GPU when called and kept there while that GPU's room
allows; when room is needed the least recently used one is evicted. ``"stream"``: the component is copied block by
block (``StreamSpec``; by default ``inventory.stream_blocks``) through a fixed set of GPU buffers reused in turn, the
next blocks prefetched on the copy queue while the current one computes. Every copy, wait and free goes through
``streams.Queues``: CUDA streams on a GPU, their model on stand-in devices and the CPU, so the dry run and the CPU
tests run this very code and see its memory bound.

Why hooks of our own: accelerate's ``CpuOffload`` (diffusers' ``enable_model_cpu_offload``) copies each model back
to the CPU at the next model's call whatever room is left, from pageable memory, for one GPU; diffusers' group
offloading waits on the host for each prefetch and has one onload device per model. Here the CPU copy of every
tensor (the master, in one exact-size pinned buffer per group when the GPU is CUDA) is kept, so eviction is free:
the parameters point at their master again and the GPU buffer is released, no device-to-host copy.

On a plan remapped onto the CPU an onload from ``cpu`` to ``cpu`` copies into a new buffer, so weights are really
swapped in and out block by block; the byte counters then count that logical traffic, the bytes a GPU run would move.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .granularity import layout
from .hooks import Moved, PlacementHook
from .inventory import live_component, stream_blocks
from .plan import Placement
from .streams import Queues, aligned, queues_for, stream_charge
from .transfer import move_tensor

_START = -1  # the block "before" the first one, in the recorded block order


def hook_for(placement: Placement, execution_device: str, ledger: Ledger) -> PlacementHook:
    """The hook that runs ``placement`` (mode ``"offload"`` or ``"stream"``) on its execution device."""
    p = placement
    if p.mode == "offload":
        return OffloadHook(p.component, p.execution_device, execution_device, ledger, p.room)
    return StreamHook(p.component, p.execution_device, execution_device, ledger, p.room, stream_spec(p))


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


# ---- tensors, their masters and the packed layout ----------------------------------------------------------------


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


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a group sits in one packed buffer, each start aligned to ``streams.ALIGN``.

    The pinned host copy and the GPU buffers share it: one allocation per group of exactly ``nbytes`` (torch's
    allocators round each small allocation up, its pinned host allocator to a power of two: 1.3x to 1.6x the
    weights of a catalog denoiser pinned tensor by tensor), and a GPU buffer sized for the largest block of a
    streamed component can hold any of its blocks in turn.

    >>> Layout.of([torch.zeros(3), torch.zeros(2, dtype=torch.float16)])
    Layout(entries=((0, torch.float32, (3,)), (16, torch.float16, (2,))), nbytes=20)
    """

    entries: tuple[tuple[int, torch.dtype, tuple[int, ...]], ...]  # (offset, dtype, shape) per tensor
    nbytes: int

    @classmethod
    def of(cls, tensors: Iterable[torch.Tensor]) -> Layout:
        offset, entries, end = 0, [], 0
        for tensor in tensors:
            entries.append((offset, tensor.dtype, tuple(tensor.shape)))
            end = offset + _nbytes(tensor)
            offset = aligned(end)
        return cls(tuple(entries), end)

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's place in ``buffer`` (uint8, at least ``nbytes``), as a tensor of its dtype and shape."""
        typed: dict[torch.dtype, torch.Tensor] = {}  # one view of the buffer per dtype, then one op per tensor
        views = []
        for offset, dtype, shape in self.entries:
            if dtype not in typed:
                typed[dtype] = buffer[:buffer.numel() // dtype.itemsize * dtype.itemsize].view(dtype)
            views.append(typed[dtype].as_strided(shape, _contiguous(shape), offset // dtype.itemsize))
        return views

    def fits(self, tensors: Iterable[torch.Tensor]) -> bool:
        return [(d, s) for _, d, s in self.entries] == [(t.dtype, tuple(t.shape)) for t in tensors]


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _pin_host(buffer: torch.Tensor) -> None:
    # page-lock the exact bytes (cudaHostRegister), bypassing the pinned host allocator's rounding and its cache,
    # without touching the process-wide allocator settings; portable (flag 1): every GPU copies from it at full speed
    torch.cuda.check_error(int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 1)))


def _unpin_host(buffer: torch.Tensor) -> None:
    torch.cuda.check_error(int(torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())))


_PINNED: dict[int, int] = {}  # host address -> bytes, of every buffer pinned here


def pinned_bytes() -> int:
    """Host bytes pinned by offload and stream hooks now (exactly their groups' ``Layout.nbytes``)."""
    return sum(_PINNED.values())


class _Group:
    """Tensors moved together (a whole component, one block, or a streamed component's loose tensors).

    Onloaded into a buffer (``install``) its tensors are views of it, one layout for every buffer; pinned
    (``pin``) its CPU masters are views of one page-locked buffer of the same layout.
    """

    def __init__(self, slots: Iterable[_Slot], name: str = ""):
        self.slots, self.name = list(slots), name
        self.loaded = False
        self.host: torch.Tensor | None = None  # the pinned buffer the masters are views of
        self._layout: Layout | None = None

    @property
    def layout(self) -> Layout:
        """The layout of the tensors as they are now: a ``.to(dtype)`` made meanwhile gives a new one."""
        tensors = [s.get() for s in self.slots]
        if self._layout is None or not self._layout.fits(tensors):
            self._layout = Layout.of(tensors)
        return self._layout

    @property
    def nbytes(self) -> int:
        """Bytes of its tensors (what a copy moves); ``layout.nbytes`` adds the alignment gaps a buffer holds."""
        return sum(_nbytes(s.get()) for s in self.slots)

    def install(self, buffer: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Point every tensor at its place in ``buffer``; returns the ``(place, master)`` copies to queue."""
        copies = []
        for slot, view in zip(self.slots, self.layout.views(buffer)):
            slot.master = slot.get()  # what it holds while evicted: a `.to(dtype)` made meanwhile is kept
            slot.onloaded = slot.wrap(view)
            slot.set(slot.onloaded)
            copies.append((view, slot.master.detach()))
        self.loaded = True
        return copies

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
        self.loaded = False
        return copied

    def pin(self) -> None:
        """Masters as views of one exact-size page-locked buffer: host-to-GPU copies then run at full speed and
        without the host waiting. Copied tensor by tensor into pageable memory first, each original dropped as it
        goes, then locked: the host holds the group about once, not twice."""
        tensors = [s.get() for s in self.slots]
        if self.host is not None or not tensors or any(t.device.type != "cpu" for t in tensors):
            return
        host = torch.empty(self.layout.nbytes, dtype=torch.uint8)
        for slot, view in zip(self.slots, self.layout.views(host)):
            view.copy_(slot.get().detach())
            slot.set_data(view)
        _pin_host(host)
        _PINNED[host.data_ptr()] = host.numel()
        self.host = host

    def pinned(self) -> bool:
        """Are the masters still the views of its pinned buffer (a ``.to(dtype)`` replaces them)?"""
        if self.host is None:
            return False
        start, end = self.host.data_ptr(), self.host.data_ptr() + self.host.numel()
        return self.layout.nbytes == self.host.numel() and all(
            start <= s.get().data_ptr() < end or _nbytes(s.get()) == 0 for s in self.slots)

    def unpin(self) -> None:
        """Each master back in a pageable tensor of its own, and the pinned buffer given back to the system."""
        if self.host is None:
            return
        start, end = self.host.data_ptr(), self.host.data_ptr() + self.host.numel()
        for slot in self.slots:
            tensor = slot.get()
            if tensor.device.type == "cpu" and start <= tensor.data_ptr() < end:
                slot.set_data(tensor.detach().clone())
        _unpin_host(self.host)
        _PINNED.pop(self.host.data_ptr(), None)
        self.host = None

    def repin(self) -> None:
        """After a dtype change: the new masters pinned, the old buffer given back."""
        if self.host is not None and not self.pinned():
            self.unpin()
            self.pin()


# ---- budgets -----------------------------------------------------------------------------------------------------


class Ledger:
    """What one dispatch onloads: an LRU cache per execution device, the device memory each holds for onloaded
    weights (buffers, counted at their size) with the peak, and each device's queues (``streams``).

    Caches are keyed by device and room (``Placement.room``), so a plan remapped onto the CPU keeps one cache per
    original GPU (two GPUs of equal room then share one, which can only evict more).
    """

    def __init__(self):
        self.caches: dict[tuple[str, int], _Cache] = {}
        self.live: collections.Counter = collections.Counter()
        self.peak: collections.Counter = collections.Counter()
        self._queues: dict[str, Queues] = {}

    def cache(self, device: str, room: int) -> _Cache:
        return self.caches.setdefault((device, room), _Cache(room))

    def queues(self, device: torch.device) -> Queues:
        if str(device) not in self._queues:
            self._queues[str(device)] = queues_for(device)
        return self._queues[str(device)]

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
        size = hook.group.layout.nbytes  # at the dtype in use: a vae upcast to float32 takes its float32 bytes
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
    """What offload and stream hooks share: weights in CPU RAM, run on ``device``, counted in ``moved``.

    A failure inside the component's call (an out-of-memory error, most likely) skips accelerate's
    ``post_forward``; ``dispatch.hook_component`` then calls ``abort``, which evicts what the call onloaded, so the
    next call starts with the memory the first one had.
    """

    def __init__(self, component: str, device: str, execution_device: str, ledger: Ledger, room: int):
        super().__init__(component, device, execution_device)
        self.ledger, self.room = ledger, room
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.queues = ledger.queues(self.device)

    def _onload(self, group: _Group, buffer: torch.Tensor | None = None, after=None, side: bool = False):
        """Copy ``group`` into ``buffer`` (a new one of its own when None) once ``after`` passed; returns the
        buffer and the copy's event."""
        if self.cuda:
            group.repin()
        own = buffer is None
        if own:
            buffer = self._alloc(group.layout.nbytes)
        try:
            event = self.queues.copy(group.install(buffer), after=after, side=side, name=group.name)
        except BaseException:  # nothing half onloaded: the masters back, the buffer freed
            if group.loaded:
                group.evict()
            if own:
                self._free(buffer)
            raise
        self.moved.h2d_bytes += group.nbytes
        return buffer, event

    def _alloc(self, nbytes: int) -> torch.Tensor:
        self.ledger.add(str(self.device), nbytes)
        return self.queues.alloc(nbytes)

    def _free(self, buffer: torch.Tensor, copies=()) -> None:
        self.ledger.add(str(self.device), -buffer.numel())
        self.queues.free(buffer, copies)

    def _evict(self, group: _Group) -> None:
        self.moved.d2h_bytes += group.evict()

    def abort(self, module) -> None:
        """Undo what an unfinished call onloaded (its ``post_forward`` never ran)."""


class OffloadHook(_MovingHook):
    """The whole component onloaded at its call through its device's LRU cache, kept there while room allows.

    The buffer is allocated and filled on the compute queue, so once evicted it serves the next onload at once.
    """

    def init_hook(self, module):
        self.group = _Group(_slots(module.modules()).values(), self.component)
        self.cache = self.ledger.cache(str(self.device), self.room)
        self.buffer: torch.Tensor | None = None
        self.running = 0
        if self.cuda:
            self.group.pin()
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


@dataclass(frozen=True)
class StreamSpec:
    """How a streamed component moves: the seam between choosing blocks (the planner) and moving them (here).

    ``blocks``: module paths, each one block moved as a whole (None: ``inventory.stream_blocks``); tensors in no
    block (or shared by two) travel with the root for the whole call. ``resident``: of those paths, the ones kept
    on the GPU from the first call to ``reset``. ``depth``: blocks prefetched ahead of the running one; the hook
    holds ``depth + 1`` buffers the size of the largest streamed block (``streams.stream_charge``).
    """

    blocks: tuple[str, ...] | None = None
    resident: tuple[str, ...] = ()
    depth: int = 1
    room: int = 0  # the GPU bytes the plan gave it, resident pieces included: for a layout redone on the live module
    resident_room: int = 0

    def on(self, module: torch.nn.Module, name: str) -> StreamSpec:
        """This spec for the live ``module``: as planned when every piece names one of its modules; else laid out
        again on its own module tree in the same room. A checkpoint's tensor names need not be the model's
        (transformers renames on load: Qwen2.5-VL's ``visual.*`` lives at ``model.visual.*``), and a plan made from
        the files names the checkpoint's."""
        if self.blocks is None or all(_has_module(module, p) for p in self.blocks if p):
            return self
        found = layout(live_component(name, module).tree, self.room, self.resident_room)
        if found is None:
            return StreamSpec(depth=self.depth)
        return StreamSpec(tuple(p for p, _ in found.blocks), found.resident, max(1, found.prefetch))


def _has_module(module: torch.nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False


def stream_spec(placement: Placement) -> StreamSpec:
    """The ``StreamSpec`` a placement asks for: the pieces, resident pieces (``""``: the root's tensors) and prefetch
    depth its plan chose by room; a placement without pieces streams every ``stream_blocks`` block, depth 1."""
    if not placement.blocks:
        return StreamSpec()
    return StreamSpec(tuple(path for path, _ in placement.blocks), tuple(placement.resident_blocks),
                      max(1, placement.prefetch), placement.room + placement.resident_bytes,
                      placement.resident_bytes)


@dataclass(eq=False)
class _Buffer:
    """One GPU buffer of a streamed component: the block it holds, the copy into it, the end of its last use."""

    tensor: torch.Tensor
    home: int | None = None  # the only block it takes (every block its own buffer), or None: any block
    block: int | None = None
    copied: object = None  # the event of the copy into it not yet waited for
    free_after: object = None  # the event that ends its last use on the compute queue


class StreamHook(_MovingHook):
    """The root's tensors onloaded for the call; the blocks one by one through a fixed set of buffers, the next
    ``depth`` blocks prefetched on the copy queue while the current one computes.

    Bounded by construction: the buffers are allocated once per call on the compute queue; a copy into one waits
    for the event recorded when the block that last used it finished, and a block waits for its copy before it
    runs. However far the host runs ahead, the component holds ``charge`` bytes. The block order is learnt as the
    component runs (the block seen after each block), so the first call prefetches nothing it has not seen and a
    wrong guess costs only a copy.
    """

    def __init__(self, component, device, execution_device, ledger, room, spec: StreamSpec = StreamSpec()):
        super().__init__(component, device, execution_device, ledger, room)
        self.spec = spec

    def init_hook(self, module):
        self.spec = self.spec.on(module, self.component)
        paths = self.spec.blocks if self.spec.blocks is not None else [p for p, _ in stream_blocks(module)]
        blocks = [module.get_submodule(p) for p in paths]
        owner: dict[int, int] = {}
        for index, block in enumerate(blocks):
            for key in _slots(block.modules()):
                owner[key] = index if key not in owner else _START  # shared by two blocks: it stays for the call
        inside = {id(m) for block in blocks for m in block.modules()}
        groups: dict[int, list[_Slot]] = collections.defaultdict(list)
        for key, slot in _slots(module.modules()).items():
            if any(id(m) not in inside for m, _ in slot.owners):
                owner[key] = _START  # also held outside every block (T5's encoder.embed_tokens ties shared): kept
            groups[owner.get(key, _START)].append(slot)
        self.root = _Group(groups[_START], f"{self.component} (root)")
        self.blocks = [_Group(groups[i], f"{self.component}.{p}") for i, p in enumerate(paths)]
        kept = set(self.spec.resident)
        self.kept = [g for g, p in zip(self.blocks, paths) if p in kept and g.slots]
        self.root_kept = "" in kept and bool(self.root.slots)  # the root's tensors stay too: only blocks move
        if self.root_kept:
            self.kept.append(self.root)
        self.streamed = [i for i, p in enumerate(paths) if p not in kept and self.blocks[i].slots]
        self.handles = [h for i in self.streamed for h in self._attach(i, blocks[i])]
        self.next_of: dict[int, int] = {}
        self.previous, self.depth = _START, 0
        self.buffers: list[_Buffer] = []
        self.root_buffer: torch.Tensor | None = None
        self.kept_buffers: list[torch.Tensor] = []
        if self.cuda:
            for group in [self.root, *self.blocks]:
                group.pin()
        return module

    @property
    def charge(self) -> int:
        """GPU bytes this component holds while it runs (kept blocks from their first call on)."""
        return sum(g.layout.nbytes for g in self.kept) + stream_charge(
            0 if self.root_kept else self.root.layout.nbytes, [self.blocks[i].layout.nbytes for i in self.streamed],
            self.spec.depth)

    def _attach(self, index: int, block: torch.nn.Module) -> list:
        return [block.register_forward_pre_hook(functools.partial(self._enter, index)),
                block.register_forward_hook(functools.partial(self._leave, index), always_call=True)]

    def pre_forward(self, module, *args, **kwargs):
        self.depth += 1  # first: a _begin that fails (out of memory) is undone by abort
        if self.depth == 1:
            self._begin()
        return super().pre_forward(module, *args, **kwargs)  # counts the call

    def post_forward(self, module, output):
        self.depth -= 1
        if self.depth == 0:
            self._end()
        return super().post_forward(module, output)

    def abort(self, module) -> None:
        if self.depth:
            self.depth = 0
            self._end()

    # ---- one call: buffers in, blocks through them, buffers out

    def _begin(self) -> None:
        for group in self.kept:
            if not group.loaded:
                self.kept_buffers.append(self._onload(group)[0])
        if not self.root_kept:
            self.root_buffer, _ = self._onload(self.root)  # on the compute queue: ordered before every use
        for size, home in self._buffer_sizes():
            self.buffers.append(_Buffer(self._alloc(size), home))
            # its memory may have served the compute queue until now: copies into it wait for this point
            self.buffers[-1].free_after = self.queues.record(self.buffers[-1].tensor)
        self.previous = _START
        self._prefetch(_START)

    def _buffer_sizes(self) -> list[tuple[int, int | None]]:
        sizes = {i: self.blocks[i].layout.nbytes for i in self.streamed}
        count = min(self.spec.depth + 1, len(sizes))
        if count * max(sizes.values(), default=0) >= sum(sizes.values()):
            return [(size, i) for i, size in sizes.items()]  # every block at once is less: each its own buffer
        return [(max(sizes.values()), None)] * count

    def _end(self) -> None:
        for buffer in self.buffers:
            if buffer.block is not None:
                self._evict(self.blocks[buffer.block])
            self._free(buffer.tensor, [buffer.copied])
        if self.root.loaded and not self.root_kept:
            self._evict(self.root)
        if self.root_buffer is not None:
            self._free(self.root_buffer)
        self.buffers, self.root_buffer = [], None

    def _enter(self, index: int, block, args) -> None:
        buffer = self._holding(index) or self._fill(index, self._free_buffer(index, evict_guess=True))
        self.queues.wait(buffer.copied)
        self.queues.used(buffer.copied, self.blocks[index].name)
        buffer.copied = None
        self.next_of[self.previous] = index
        self.previous = index
        self._prefetch(index)

    def _leave(self, index: int, block, args, output) -> None:
        buffer = self._holding(index)
        if buffer is not None:  # None: an abort emptied the buffers meanwhile
            buffer.free_after = self.queues.record(buffer.tensor)
            buffer.block = None
            self._evict(self.blocks[index])

    def _prefetch(self, index: int) -> None:
        """The next ``depth`` blocks in the learnt order, each into a free buffer, on the copy queue."""
        for _ in range(self.spec.depth):
            index = self.next_of.get(index)
            if index is None or index == self.previous:
                return
            if self._holding(index) is None:
                buffer = self._free_buffer(index)
                if buffer is None:
                    return
                self._fill(index, buffer)

    def _holding(self, index: int) -> _Buffer | None:
        return next((b for b in self.buffers if b.block == index), None)

    def _free_buffer(self, index: int, evict_guess: bool = False) -> _Buffer | None:
        """A buffer for block ``index``: an empty one, else (``evict_guess``) one holding a wrong guess."""
        fitting = [b for b in self.buffers if b.home in (None, index) and b.block != self.previous]
        empty = next((b for b in fitting if b.block is None), None)
        if empty is not None or not evict_guess:
            return empty
        guess = fitting[0]  # the block prefetched first: the furthest from any use now
        self._evict(self.blocks[guess.block])
        guess.block = None
        return guess

    def _fill(self, index: int, buffer: _Buffer) -> _Buffer:
        _, buffer.copied = self._onload(self.blocks[index], buffer.tensor, after=buffer.free_after, side=True)
        buffer.block = index
        return buffer

    def detach_hook(self, module):
        for handle in self.handles:
            handle.remove()
        if self.depth:
            self.abort(module)
        for group, buffer in zip(self.kept, self.kept_buffers):
            self._evict(group)
            self._free(buffer)
        self.kept_buffers = []
        self.queues.synchronize()
        for group in [self.root, *self.blocks]:
            group.unpin()
        return module

    def __repr__(self) -> str:
        return f"StreamHook({self.component!r}, device={self.device}, blocks={len(self.blocks)})"
