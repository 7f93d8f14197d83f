"""Block streaming (mode ``"stream"``): the component lives in CPU RAM and is copied block by block (``StreamSpec``;
by default ``inventory.stream_blocks``) through a fixed set of GPU buffers reused in turn, the next blocks
prefetched on the copy queue while the current one computes. Every copy, wait and free goes through
``streams.Queues``: CUDA streams on a GPU, their model on stand-in devices and the CPU, so the dry run and the CPU
tests run this very code and see its memory bound.
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass
from typing import cast

import torch

from ..granularity import LOOSE, cut, stream_charge
from ..inventory.live import live_component, stream_blocks
from ..plan import Placement
from .mapped import Pages, pin_from_map
from .moving import Ledger, MovingHook
from .packing import Group, Slot, slots
from .resident import outside_graphs

_START = -1  # the block "before" the first one, in the recorded block order


# ---- hooks -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamSpec:
    """How a streamed component moves: the seam between choosing blocks (the planner) and moving them (here).

    ``blocks``: module paths, each one block moved as a whole (None: ``inventory.stream_blocks``); tensors in no
    block (or shared by two) travel with the root for the whole call. ``resident``: of those paths, the ones kept
    on the GPU from the first call to ``reset``. ``depth``: blocks prefetched ahead of the running one; the hook
    holds ``depth + 1`` buffers the size of the largest streamed block (``granularity.stream_charge``).
    """

    blocks: tuple[str, ...] | None = None
    resident: tuple[str, ...] = ()
    depth: int = 1
    room: int = 0  # the GPU bytes the plan gave it, resident pieces included: for a layout redone on the live module
    resident_room: int = 0
    disk: tuple[str, ...] = ()  # the pieces read from their files at each call (the disk tier; "": the root's tensors)
    mapped: bool = False  # its host copy is its files' maps: the resident pieces keep no copy in RAM

    def on(self, module: torch.nn.Module, name: str) -> StreamSpec:
        """This spec for the live ``module``: as planned when every piece names one of its modules; else laid out
        again on its own module tree in the same room. A checkpoint's tensor names need not be the model's
        (transformers renames on load: Qwen2.5-VL's ``visual.*`` lives at ``model.visual.*``), and a plan made from
        the files names the checkpoint's."""
        if self.blocks is None or all(_has_module(module, p) for p in self.blocks if p):
            return self
        tree = live_component(name, module).tree
        assert tree is not None  # a live component always has its module tree
        found = cut(tree, self.room, self.resident_room)
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
                      placement.resident_bytes, placement.disk_blocks, bool(placement.files))


@dataclass(eq=False)
class _Buffer:
    """One GPU buffer of a streamed component: the block it holds, the copy into it, the end of its last use."""

    tensor: torch.Tensor
    home: int | None = None  # the only block it takes (every block its own buffer), or None: any block
    block: int | None = None
    copied: object = None  # the event of the copy into it not yet waited for
    free_after: object = None  # the event that ends its last use on the compute queue


class StreamHook(MovingHook):
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

    @classmethod
    def for_placement(cls, p: Placement, execution_device: str, ledger: Ledger) -> StreamHook:
        """The hook of a streamed placement (``hooks.HOOKS``): its pieces, resident pieces and prefetch depth."""
        return cls(p.component, p.execution_device, execution_device, ledger, p.room, stream_spec(p))

    def moved_groups(self) -> list[Group]:
        return [self.root, *self.blocks] if hasattr(self, "root") else []

    def init_hook(self, module):
        self.spec = self.spec.on(module, self.component)
        paths = self.spec.blocks if self.spec.blocks is not None else [p for p, _ in stream_blocks(module)]
        blocks = [module.get_submodule(p) for p in paths]
        owner: dict[int, int] = {}
        first: dict[int, int] = {}  # the first block holding each tensor: a shared one's piece in the plan
        for index, block in enumerate(blocks):
            for key in slots(block.modules()):
                owner[key] = index if key not in owner else _START  # shared by two blocks: it stays for the call
                first.setdefault(key, index)
        inside = {id(m) for block in blocks for m in block.modules()}
        groups: dict[int, list[Slot]] = collections.defaultdict(list)
        for key, slot in slots(module.modules()).items():
            if any(id(m) not in inside for m, _ in slot.owners):
                owner[key] = _START  # also held outside every block (T5's encoder.embed_tokens ties shared): kept
            groups[owner.get(key, _START)].append(slot)
        self.root = Group(groups[_START], f"{self.component} (root)")
        self.blocks = [Group(groups[i], f"{self.component}.{p}") for i, p in enumerate(paths)]
        kept = set(self.spec.resident)
        self.kept = [g for g, p in zip(self.blocks, paths) if p in kept and g.slots]
        self.root_kept = "" in kept and bool(self.root.slots)  # the root's tensors stay too: only blocks move
        if self.root_kept:
            self.kept.append(self.root)
        self.streamed = [i for i, p in enumerate(paths) if p not in kept and self.blocks[i].slots]
        self.next_of: dict[int, int] = {}
        self.previous, self.depth = _START, 0
        self.buffers: list[_Buffer] = []
        self.root_buffer: torch.Tensor | None = None
        self.kept_buffers: list[tuple[torch.Tensor, object]] = []  # (buffer, the event of the copy into it)
        self._tiers(list(paths), {paths[first[k]] for k, o in owner.items() if o == _START and k in first})
        # a placed pipeline's buffers take their room in the GPU's shared cache, evicting other pipelines' (issue 39)
        self.cache = self.ledger.shared_on(self.device)
        self.handles = [h for i in self.streamed for h in self._attach(i, blocks[i])]
        self.watch_conversions(module)
        return module

    def _tiers(self, paths: list[str], root_pieces: set[str]) -> None:
        """Which host copies stay in their files (read through the staging ring at each call), which are pinned;
        the kept pieces are neither: copied once, then their pages in the files' maps are let go. The root's tensors
        go with the files when the plan leaves their piece there (``root_pieces``: the pieces of the tied tensors
        the root holds, T5's shared embedding)."""
        disk = set(self.spec.disk)
        on_disk = [g for g, p in zip(self.blocks, paths) if p in disk and g.slots and g not in self.kept]
        if (LOOSE in disk or root_pieces & disk) and self.root.slots and not self.root_kept:
            on_disk.append(self.root)
        self.read_from_files(on_disk)
        self.kept_pages = Pages(s.get() for g in self.kept for s in g.slots)
        if self.spec.mapped:  # a reset reads them back from the files
            self.queues.on_disk(s.get() for g in self.kept for s in g.slots)
        if not self.cuda:
            return
        pinned = [g for g in [self.root, *self.blocks] if id(g) not in self.from_files and g not in self.kept]
        try:
            for group in pinned:
                pin_from_map(group)
        except BaseException:  # a registration refused part-way: none left behind
            for group in pinned:
                group.unpin()
            raise

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

    @property
    def busy(self) -> bool:
        return bool(self.depth)

    def _hold(self, size: int) -> None:
        if self.cache is not None:
            self.cache.hold(self, size)

    def _begin(self) -> None:
        self._hold(self.charge)  # first: room made before its buffers are allocated
        waiting = self.kept[len(self.kept_buffers):]
        for group in waiting:
            self.kept_buffers.append(self._onload(group))
        if waiting:
            self.kept_pages.release()  # no second copy: a reset reads them back from the files
        for buffer, copied in self.kept_buffers:  # kept from an earlier call, maybe on another stream
            self.queues.wait(copied)
            self.queues.reading(buffer)
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
        self._hold(sum(buffer.numel() for buffer, _ in self.kept_buffers))  # its kept pieces stay till evicted

    def _enter(self, index: int, block, args) -> None:
        # evict_guess: _free_buffer always gives one
        buffer = self._holding(index) or self._fill(index, cast(_Buffer, self._free_buffer(index, evict_guess=True)))
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
            following = self.next_of.get(index)
            if following is None or following == self.previous:
                return
            index = following
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
        assert guess.block is not None  # no empty buffer fits, so each holds a block
        self._evict(self.blocks[guess.block])
        guess.block = None
        return guess

    def _fill(self, index: int, buffer: _Buffer) -> _Buffer:
        _, buffer.copied = self._onload(self.blocks[index], buffer.tensor, after=buffer.free_after, side=True)
        buffer.block = index
        return buffer

    def unload(self) -> None:
        if not self.depth:
            for group, (buffer, copied) in zip(self.kept, self.kept_buffers):
                self._evict(group)
                self._free(buffer, [copied])
            self.kept_buffers = []
            self._hold(0)

    def held_buffers(self) -> list[torch.Tensor]:
        return [] if self.depth else [buffer for buffer, _ in self.kept_buffers]

    def evict(self) -> None:
        """Evicted from the GPU's shared cache by another pipeline (between its calls): its kept pieces go."""
        self.unload()

    def detach_hook(self, module):
        self.unwatch_conversions(module)
        for handle in self.handles:
            handle.remove()
        if self.depth:
            self.abort(module)
        self.unload()
        self.queues.synchronize()
        for group in [self.root, *self.blocks]:
            group.unpin()
        self.leave_files()
        return module

    def __repr__(self) -> str:
        return f"StreamHook({self.component!r}, device={self.device}, blocks={len(self.blocks)})"


outside_graphs(StreamHook)
