"""Host buffers: a component's tensors packed into one exact-size buffer per group, pinned for fast copies.

A ``Slot`` is one tensor of a component (a parameter or a buffer) with every module holding it and its CPU master; a
``Group`` is the tensors moved together (a whole offloaded component, one streamed block, a streamed component's
loose tensors); a ``Packing`` says where each of a group's tensors sits in a packed buffer, so the pinned host copy
and every GPU buffer share one layout and a copy moves a group in one go.

A pinned buffer lives exactly as long as its group: ``reset`` unpins it, and a group dropped without ``reset`` (``del
pipe``, a notebook cell re-run, a model reloaded) unpins it when collected (``weakref.finalize``), after the last
copy out of it has run, so the driver never keeps freed memory registered (page-locked RAM leaked, and error 712 for
the next registration that gets the same addresses).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..quantized import is_packed, rebuild_from, restored, storage, stored_bytes
from ..runtime.transfer import move_tensor
from ..units import aligned


class Slot:
    """One tensor of a component, a parameter or a buffer, with every module holding it, and its CPU master.

    Onloading puts a new Parameter (or buffer) on the device in the modules' dicts and evicting puts the master back:
    ``param.data = ...`` would keep the Parameter object, but PyTorch refuses it between a CPU and a meta fake tensor
    (the dry run), and evicting restores the very objects the pipeline had, so ``reset`` leaves it as it was.
    """

    __slots__ = ("store", "owners", "master", "onloaded")

    def __init__(self, store: str):
        self.store = store  # "_parameters" or "_buffers"
        self.owners: list[tuple[torch.nn.Module, str]] = []  # (module, key) pairs
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
            assert self.master is not None  # set before each wrap (install)
            return torch.nn.Parameter(tensor, requires_grad=self.master.requires_grad)
        return tensor


def slots(modules: Iterable[torch.nn.Module]) -> dict[int, Slot]:
    """Every tensor of ``modules`` once, keyed by the identity of its Parameter or buffer (non-persistent too)."""
    found: dict[int, Slot] = {}
    for module in modules:
        for store in ("_parameters", "_buffers"):
            for key, tensor in getattr(module, store).items():
                if tensor is not None:
                    slot = found.setdefault(id(tensor), Slot(store))
                    if (module, key) not in slot.owners:
                        slot.owners.append((module, key))
    return found


def nbytes_of(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass(frozen=True)
class Packing:
    """Where each tensor of a group sits in one packed buffer, each start aligned to ``units.ALIGN``.

    The pinned host copy and the GPU buffers share it: one allocation per group of exactly ``nbytes`` (torch's
    allocators round each small allocation up, its pinned host allocator to a power of two: 1.3x to 1.6x the
    weights of a catalog denoiser pinned tensor by tensor), and a GPU buffer sized for the largest block of a
    streamed component can hold any of its blocks in turn.

    >>> Packing.of([torch.zeros(3), torch.zeros(2, dtype=torch.float16)])
    Packing(entries=((0, torch.float32, (3,)), (16, torch.float16, (2,))), nbytes=20)
    """

    entries: tuple[tuple[int, torch.dtype, tuple[int, ...]], ...]  # (offset, dtype, shape) per tensor
    nbytes: int

    @classmethod
    def of(cls, tensors: Iterable[torch.Tensor]) -> Packing:
        offset, entries, end = 0, [], 0
        for tensor in tensors:
            entries.append((offset, tensor.dtype, tuple(tensor.shape)))
            end = offset + nbytes_of(tensor)
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


def _unpin_host(buffer: torch.Tensor) -> None:
    torch.cuda.check_error(int(torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())))


def _pin_host(buffer: torch.Tensor) -> None:
    # page-lock the exact bytes (cudaHostRegister), bypassing the pinned host allocator's rounding and its cache,
    # without touching the process-wide allocator settings; portable (flag 1): every GPU copies from it at full speed
    torch.cuda.check_error(int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 1)))


_PINNED: dict[int, int] = {}  # host address -> bytes, of every buffer pinned here


def pinned_bytes() -> int:
    """Host bytes pinned by offload and stream hooks now (exactly their groups' ``Packing.nbytes``)."""
    return sum(_PINNED.values())


class _Registration:
    """One registered host buffer, and the event of the last copy out of it, which unregistering waits for (the
    driver would otherwise unlock memory a queued copy still reads). It holds the buffer until then."""

    def __init__(self, host: torch.Tensor):
        self.host: torch.Tensor | None = host
        self.last_copy = None

    def release(self) -> None:
        if self.last_copy is not None:
            self.last_copy.synchronize()
            self.last_copy = None
        if self.host is not None:
            _PINNED.pop(self.host.data_ptr(), None)
            host, self.host = self.host, None
            _unpin_host(host)


class Group:
    """Tensors moved together (a whole component, one block, or a streamed component's loose tensors).

    Onloaded into a buffer (``install``) its tensors are views of it, one layout for every buffer; pinned
    (``pin``) its CPU masters are views of one page-locked buffer of the same layout. A quantized weight (a tensor
    subclass, ``quantized``) is laid out as its storage (int data, scales) and made again around its views, so it
    moves as stored, never dequantized.
    """

    def __init__(self, slots: Iterable[Slot], name: str = ""):
        self.slots, self.name = list(slots), name
        self.loaded = False
        self.host: torch.Tensor | None = None  # the pinned buffer the masters are views of
        self._layout: Packing | None = None
        self._registration: _Registration | None = None
        self._unpin: weakref.finalize | None = None  # unregisters ``host``: at unpin, or when the group is collected

    @property
    def layout(self) -> Packing:
        """The layout of the tensors as they are now: a ``.to(dtype)`` made meanwhile gives a new one."""
        tensors = [leaf for s in self.slots for leaf in storage(s.get())]
        if self._layout is None or not self._layout.fits(tensors):
            self._layout = Packing.of(tensors)
        return self._layout

    @property
    def nbytes(self) -> int:
        """Bytes of its tensors (what a copy moves); ``layout.nbytes`` adds the alignment gaps a buffer holds."""
        return sum(stored_bytes(s.get()) for s in self.slots)

    def install(self, buffer: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Point every tensor at its place in ``buffer``; returns the ``(place, master)`` copies to queue: one for
        the whole group when its masters are views of its pinned buffer (same layout), else one per tensor."""
        packed = self.pinned()
        copies = []
        views = iter(self.layout.views(buffer))
        for slot in self.slots:
            slot.master = slot.get()  # what it holds while evicted: a `.to(dtype)` made meanwhile is kept
            leaves = storage(slot.master)
            places = [next(views) for _ in leaves]
            slot.onloaded = slot.wrap(rebuild_from(slot.master)(places))
            slot.set(slot.onloaded)
            copies += [(place, leaf.detach()) for place, leaf in zip(places, leaves)]
        self.loaded = True
        if packed and self.host is not None:
            return [(buffer[:self.host.numel()], self.host)]
        return copies

    def copied(self, event) -> None:
        """``event`` ends the latest copy out of the pinned buffer: unpinning waits for it."""
        if self._registration is not None:
            self._registration.last_copy = event

    def evict(self) -> int:
        """Put every master back; returns the bytes copied back (only tensors whose dtype changed meanwhile)."""
        copied = 0
        for slot in self.slots:
            assert slot.master is not None  # evicted only once installed
            current = slot.get()
            slot.set(slot.master)
            if current.dtype != slot.master.dtype:  # converted while onloaded (vae.to(float32)): keep that
                slot.set_data(move_tensor(current.detach(), torch.device("cpu")))
                copied += nbytes_of(current)
            slot.onloaded = None
        self.loaded = False
        return copied

    def pin(self) -> None:
        """Masters as views of one exact-size page-locked buffer: host-to-GPU copies then run at full speed and
        without the host waiting. Copied tensor by tensor into pageable memory first, each original dropped as it
        goes, then locked: the host holds the group about once, not twice. Registered once per buffer, and
        unregistered at ``unpin`` or when the group is collected, whichever comes first."""
        tensors = [leaf for s in self.slots for leaf in storage(s.get())]
        if self.host is not None or not tensors or any(t.device.type != "cpu" for t in tensors):
            return
        if self.layout.nbytes == 0:  # nothing to lock (a block of empty tensors): the driver refuses size 0
            return
        host = torch.empty(self.layout.nbytes, dtype=torch.uint8)
        views = iter(self.layout.views(host))
        for slot in self.slots:
            tensor = slot.get()
            places = [next(views).copy_(leaf.detach()) for leaf in storage(tensor)]
            if is_packed(tensor):
                slot.set(restored(tensor, places))
            else:
                slot.set_data(places[0])
        _pin_host(host)
        _PINNED[host.data_ptr()] = host.numel()
        self.host = host
        # the finalizer holds the buffer (through the registration), not the group: the memory is unregistered
        # before it can be freed, whether unpin or the group's collection comes first
        self._registration = _Registration(host)
        self._unpin = weakref.finalize(self, _Registration.release, self._registration)
        self._unpin.atexit = False  # at exit the process's memory goes back whole; the driver may be gone already

    def pinned(self) -> bool:
        """Are the masters still the views of its pinned buffer (a ``.to(dtype)`` replaces them)?"""
        if self.host is None:
            return False
        start, end = self.host.data_ptr(), self.host.data_ptr() + self.host.numel()
        return self.layout.nbytes == self.host.numel() and all(
            start <= t.data_ptr() < end or nbytes_of(t) == 0 for s in self.slots for t in storage(s.get()))

    def unpin(self) -> None:
        """Each master back in a pageable tensor of its own, and the pinned buffer given back to the system."""
        if self.host is None:
            return
        start, end = self.host.data_ptr(), self.host.data_ptr() + self.host.numel()
        for slot in self.slots:
            tensor = slot.get()
            if is_packed(tensor):
                if any(start <= t.data_ptr() < end for t in storage(tensor)):
                    slot.set(restored(tensor, [t.detach().clone() for t in storage(tensor)]))
            elif tensor.device.type == "cpu" and start <= tensor.data_ptr() < end:
                slot.set_data(tensor.detach().clone())
        if self._unpin is not None:
            self._unpin()  # once: waits for the last copy out of it, then unregisters
        self._unpin, self._registration, self.host = None, None, None

    def repin(self) -> None:
        """After a dtype change: the new masters pinned, the old buffer given back."""
        if self.host is not None and not self.pinned():
            self.unpin()
            self.pin()
