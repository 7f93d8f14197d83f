"""The disk tier at run time: host copies left in their safetensors files' memory maps, read from there at each
call through a small ring of pinned staging buffers, their pages handed back to the kernel once copied.

diffusers and transformers load weights stored at the dtype asked for as views of each file's map (safetensors maps
files privately): they cost page cache, not private memory, until something reads them, and every page read stays
counted in the process's memory while the map holds it. So the hooks read a piece from the map into a staging
buffer (pinned: the copy to the GPU then runs on the copy stream while the host fills the next one) and then
``madvise(MADV_DONTNEED)`` its pages: the next read faults them in again from the page cache or the disk.

Two things a file's map does that RAM does not, kept right here:
- a write into the weights (``fuse_lora``, ``load_state_dict``, follow's ``settle``) copies the pages it touches
  into private memory inside the map (the map is private); ``MADV_DONTNEED`` on such a page discards the write. So
  the pages to hand back are only those still backed by the file (``/proc/self/pagemap``), taken again whenever a
  tensor's version counter says it was written: a change stays, at the cost of the pages it wrote;
- the file itself may change under the map: rewritten in place, the next read brings the new bytes; truncated, a
  read past its new end kills the process (SIGBUS). So each read first compares the file's size and modification
  time with those it had when mapped (``Pages.check``) and raises ``WeightsFileChangedError`` on a change; a file
  replaced by a new one (a rename, as ``save_pretrained`` and downloads do) leaves the old one mapped: no change.

Why our own: accelerate's disk offload and diffusers' group offloading to disk (``offload_to_disk_path``) write the
weights out a second time, into files of their own; the weights already lie in their safetensors files, mapped.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import mmap
import os
from collections.abc import Iterable

import numpy as np
import torch

from ..errors import WeightsFileChangedError
from ..ram import address, file_maps
from ..runtime.streams import Queues
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

    def __init__(self, tensors: Iterable[torch.Tensor], keep_written: bool = True):
        self.tensors = [t for t in tensors if t.device.type == "cpu" and nbytes_of(t)]
        maps = file_maps() if self.tensors else None
        spans = []
        self.files: dict[str, tuple[int, int, int]] = {}  # path -> (inode, size, mtime) when first seen here
        for tensor in self.tensors:
            start = address(tensor)
            path = maps.file_of(start, nbytes_of(tensor)) if start and maps is not None else None
            if path:
                spans.append((start, start + nbytes_of(tensor)))
                if path not in self.files:
                    self.files[path] = _stamp(path)
        # pages a write made private hold the only copy of the change: handed back, it would be undone
        self.ranges = _file_backed(_pages(spans)) if keep_written else _pages(spans)
        self.starts = [start for start, _ in self.ranges]
        self.versions = _versions(self.tensors)

    def written(self, tensors: Iterable[torch.Tensor]) -> bool:
        """Whether ``tensors`` (these pages' tensors, as the group holds them now) were written since."""
        return _versions(tensors) != self.versions

    def check(self, component: str = "") -> None:
        """Raise ``WeightsFileChangedError`` if a file these pages lie in changed in place since it was mapped."""
        for path, (inode, size, mtime) in self.files.items():
            try:
                now = os.stat(path)
            except OSError:
                continue  # deleted: its map keeps the file's data
            if now.st_ino != inode:
                continue  # replaced by another file (a rename): the map still holds the old one
            if (now.st_size, now.st_mtime_ns) != (size, mtime):
                change = (f"{size} bytes became {now.st_size}" if now.st_size != size else
                          "rewritten in place (its modification time changed)")
                raise WeightsFileChangedError(path, component, change)

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


def _stamp(path: str) -> tuple[int, int, int]:
    try:
        st = os.stat(path)
    except OSError:
        return (-1, -1, -1)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _versions(tensors: Iterable[torch.Tensor]) -> tuple[int, ...]:
    return tuple(_version(t) for t in tensors if t.device.type == "cpu" and nbytes_of(t))


def _version(tensor: torch.Tensor) -> int:
    try:
        return tensor._version
    except RuntimeError:  # an inference-mode tensor keeps no version counter (and cannot be written outside one)
        return -1


_PRESENT, _FILE = 1 << 63, 1 << 61  # /proc/pid/pagemap: page present; file-backed (or shared anonymous)


def _file_backed(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` less the pages that are present but no longer backed by their file: written, hence private (a
    copy-on-write of the private map). Unchanged where ``/proc/self/pagemap`` cannot be read."""
    if not ranges:
        return ranges
    page = mmap.PAGESIZE
    kept: list[tuple[int, int]] = []
    try:
        with open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
            for start, length in ranges:
                pagemap.seek(start // page * 8)
                entries = np.frombuffer(pagemap.read(length // page * 8), dtype=np.uint64)
                private = (entries & np.uint64(_PRESENT | _FILE)) == np.uint64(_PRESENT)
                if not private.any():
                    kept.append((start, length))
                    continue
                edges = np.flatnonzero(np.diff(np.concatenate(([True], private, [True])).astype(np.int8)))
                for first, last in zip(edges[::2], edges[1::2]):  # runs of pages still backed by the file
                    kept.append((start + int(first) * page, int(last - first) * page))
    except OSError:
        return ranges
    return kept


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
    pages = Pages((s.get() for s in group.slots), keep_written=False)  # the pinned copy holds any change
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
        self.users: set[int] = set()  # the hooks that read through it (by identity): the last one gives it back

    def leave(self, user: object) -> None:
        """``user`` reads no more through the ring; the last one out gives the slots back (page-locked memory)."""
        self.users.discard(id(user))
        if not self.users:
            self.release()

    def release(self) -> None:
        """The slots given back, each once its last copy ran; the ring grows again at its next use."""
        for slot, copied in zip(self.slots, self.copied):
            self.queues.free_host(slot, copied)
        self.slots, self.copied, self.turn = [], [], 0

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
