"""The disk tier at run time: host copies left in their safetensors files' memory maps, read from there at each
call through a small ring of pinned staging buffers, their pages handed back to the kernel once copied.

diffusers and transformers load weights stored at the dtype asked for as views of each file's map (safetensors maps
files privately): they cost page cache, not private memory, until something reads them, and every page read stays
counted in the process's memory while the map holds it. So the hooks read a piece from the map into a staging
buffer (pinned: the copy to the GPU then runs on the copy stream while the host fills the next one) and then
``madvise(MADV_DONTNEED)`` its pages: the next read faults them in again from the page cache or the disk.

Why our own: accelerate's disk offload and diffusers' group offloading to disk (``offload_to_disk_path``) write the
weights out a second time, into files of their own; the weights already lie in their safetensors files, mapped.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import mmap
from collections.abc import Iterable

import torch

from ..ram import address, file_maps
from ..streams import Queues
from ..tiers import STAGING_CHUNK, STAGING_SLOTS
from .packing import Group, Packing, nbytes_of

_MADV_DONTNEED = 4  # linux/mman.h
_libc = None


def _madvise(start: int, length: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    _libc.madvise(start, length, _MADV_DONTNEED)  # a failure only leaves pages counted: nothing to undo


class Pages:
    """The pages of some tensors that lie in a safetensors file's map, to hand back to the kernel after each read.

    Only pages wholly inside the tensors' bytes, and only inside a file's map: ``MADV_DONTNEED`` on private memory
    would zero it. The tensors are held, so their map (and these addresses) stay valid as long as this does.
    """

    def __init__(self, tensors: Iterable[torch.Tensor]):
        self.tensors = [t for t in tensors if t.device.type == "cpu" and nbytes_of(t)]
        maps = file_maps() if self.tensors else None
        spans = []
        for tensor in self.tensors:
            start = address(tensor)
            if start and maps is not None and maps.file_of(start, nbytes_of(tensor)):
                spans.append((start, start + nbytes_of(tensor)))
        self.ranges = _pages(spans)
        self.starts = [start for start, _ in self.ranges]

    @property
    def nbytes(self) -> int:
        return sum(length for _, length in self.ranges)

    def release(self) -> None:
        for start, length in self.ranges:
            _madvise(start, length)

    def release_within(self, low: int, high: int) -> None:
        """Hand back the pages of these tensors that lie in ``[low, high)`` (what one staging chunk read)."""
        at = max(0, bisect.bisect_right(self.starts, low) - 1)
        for start, length in self.ranges[at:]:
            if start >= high:
                break
            first, last = max(start, low - low % mmap.PAGESIZE), min(start + length, high - high % mmap.PAGESIZE)
            if last > first:
                _madvise(first, last - first)


def _pages(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent spans merged (a block's tensors lie together in its file), then cut to whole pages inside them."""
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1] + 64:  # safetensors aligns tensors to a few bytes at most
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    page = mmap.PAGESIZE
    ranges = []
    for start, end in merged:
        first, last = -(-start // page) * page, end // page * page
        if last > first:
            ranges.append((first, last - first))
    return ranges


def pin_from_map(group: Group) -> None:
    """``group.pin()``, then the pages of the map it was copied from handed back: the host holds it once."""
    pages = Pages(s.get() for s in group.slots)
    group.pin()
    if group.host is not None:
        pages.release()


class Staging:
    """A ring of ``STAGING_SLOTS`` host buffers (pinned on a GPU) through which groups are copied from their files'
    maps to a device: the host fills one slot while the device copies from the other, and waits for a slot's last
    copy before it fills it again. A group larger than a slot goes through in chunks of it.
    """

    def __init__(self, queues: Queues):
        self.queues = queues
        self.size = 0  # bytes a slot holds: the largest group registered, at most STAGING_CHUNK
        self.slots: list[torch.Tensor] = []
        self.copied: list[object] = []  # per slot, the event of the last copy out of it
        self.turn = 0

    def need(self, nbytes: int) -> None:
        """A group of ``nbytes`` will pass through: the slots grow to it (up to ``STAGING_CHUNK``) before first use."""
        if not self.slots:
            self.size = max(self.size, min(nbytes, STAGING_CHUNK))

    def copy(self, buffer: torch.Tensor, layout: Packing, masters: list[torch.Tensor], after=None, name: str = "",
             pages: Pages | None = None):
        """Copy ``masters`` into ``buffer`` at ``layout``'s offsets on the copy queue, through the slots; returns the
        event of the last chunk (the copy queue runs in order, so every chunk is done then). ``pages``: the masters'
        pages in their files' maps, handed back chunk by chunk as read, so reading a piece adds one slot to RSS,
        not the piece."""
        if not self.slots:
            self.size = self.size or min(max(layout.nbytes, 1), STAGING_CHUNK)
            self.slots = [self.queues.alloc_host(self.size) for _ in range(STAGING_SLOTS)]
            self.copied = [None] * STAGING_SLOTS
        sources = [(offset, _bytes_of(m)) for (offset, _, _), m in zip(layout.entries, masters)]
        event = None
        for start in range(0, layout.nbytes, self.size):
            end = min(start + self.size, layout.nbytes)
            slot = self.turn
            self.turn = (self.turn + 1) % len(self.slots)
            self.queues.host_wait(self.copied[slot])
            for low, high in _fill(self.slots[slot], start, end, sources):
                if pages is not None:
                    pages.release_within(low, high)
            event = self.queues.copy([(buffer[start:end], self.slots[slot][:end - start])], after=after, side=True,
                                     name=name)
            self.copied[slot] = event
        return event


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8)


def _fill(slot: torch.Tensor, start: int, end: int, sources: list[tuple[int, torch.Tensor]]
          ) -> list[tuple[int, int]]:
    """The bytes ``[start, end)`` of a packed group, from each source tensor that overlaps them; returns the address
    spans read (none for a fake tensor)."""
    read = []
    for offset, data in sources:
        low, high = max(start, offset), min(end, offset + data.numel())
        if low < high:
            slot[low - start:high - start].copy_(data[low - offset:high - offset])
            base = address(data)
            if base:
                read.append((base + low - offset, base + high - offset))
    return read
