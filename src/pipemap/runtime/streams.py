"""One small interface for what offloading asks of a device: allocate, copy on a side queue, record an event, wait
on it, free after use. Two implementations: CUDA streams and events, and a model of them for stand-in devices
(``meta:N`` in the dry run) and the CPU, so the dry run and the CPU tests run the very prefetch, wait and free code
a GPU runs, and see its memory bound.

The rules the hooks keep (``hooks/moving.py``, ``hooks/stream.py``), which make memory a property of the plan and
not of timing:

- every buffer is allocated on the compute queue and freed only after the compute queue has waited for every copy
  into it, so the caching allocator may hand it to the next allocation at once (stream-ordered reuse, no
  ``record_stream``): an evicted component's memory serves the next onload, however far the host runs ahead; on
  CUDA the compute queue is the caller's current stream, so a buffer read on another stream (``reading``) is freed
  only once the stream it was allocated on has waited for that one;
- a copy into a buffer first waits for the event recorded when the block that last used it finished;
- a block is used only after the compute queue waited for its copy.

The model checks the last two (``UnwaitedCopyError``, ``BufferReuseError``) and holds memory freed while another
queue may still use it (what the caching allocator does with ``record_stream``), so a regression shows as memory.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..errors import BufferReuseError, UnwaitedCopyError

# ---- the interface -----------------------------------------------------------------------------------------------


class Queues:
    """A device's compute queue and one copy queue. Events are opaque; ``None`` means "nothing to wait for"."""

    def __init__(self, device: torch.device):
        self.device = device

    def alloc(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer on the device, owned by the compute queue."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after=None, side: bool = True, name: str = ""):
        """Copy each ``(destination, source)`` on the copy queue (``side``) or the compute queue, once ``after`` has
        passed; returns the event of the copy's end."""
        raise NotImplementedError

    def wait(self, event) -> None:
        """The compute queue waits for ``event`` (the host does not)."""
        raise NotImplementedError

    def used(self, event, name: str) -> None:
        """The compute queue is about to read what ``event``'s copy wrote (the model checks it waited)."""

    def reading(self, buffer: torch.Tensor | None) -> None:
        """The compute queue reads ``buffer`` from here on (a buffer kept across calls, which may come on other
        streams)."""

    def record(self, buffer: torch.Tensor | None = None):
        """An event at the compute queue's current point: where the use of ``buffer`` so far ends (a copy into it
        then waits for this event)."""
        raise NotImplementedError

    def free(self, buffer: torch.Tensor, copies: Iterable = ()) -> None:
        """Release ``buffer``; the compute queue first waits for each of ``copies`` not yet waited for, so the memory
        is reusable in compute order at once."""
        for event in copies:
            if event is not None:
                self.wait(event)

    def synchronize(self) -> None:
        """The host waits for both queues."""

    def host_wait(self, event) -> None:
        """The host waits for ``event`` (before it writes again into host memory a copy reads from)."""

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        """A host buffer copies to the device read from (page-locked for a GPU): a staging buffer."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def free_host(self, buffer: torch.Tensor, last_copy=None) -> None:
        """Give back a buffer of ``alloc_host`` once ``last_copy`` (the last copy out of it) ran."""
        self.host_wait(last_copy)

    def on_disk(self, tensors: Iterable[torch.Tensor]) -> None:
        """``tensors`` are host copies left in their files (the disk tier), not in RAM; the dry run counts them so."""


def queues_for(device: str | torch.device) -> Queues:
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return CudaQueues(device)
    return ModelQueues(device)


# ---- CUDA --------------------------------------------------------------------------------------------------------


class CudaQueues(Queues):
    """CUDA: the current stream computes, a side stream copies from pinned memory without the host waiting."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.side = torch.cuda.Stream(device)
        self._streams: dict[int, list] = {}  # id(buffer) -> [the stream it was allocated on, others that read it]

    def _compute(self):
        return torch.cuda.current_stream(self.device)

    def alloc(self, nbytes: int) -> torch.Tensor:
        buffer = super().alloc(nbytes)
        self._streams[id(buffer)] = [self._compute()]
        return buffer

    def reading(self, buffer: torch.Tensor | None) -> None:
        streams = self._streams.get(id(buffer))
        if streams is not None and self._compute() not in streams:
            streams.append(self._compute())

    def copy(self, pairs, after=None, side: bool = True, name: str = ""):
        stream = self.side if side else self._compute()
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            for destination, source in pairs:
                destination.copy_(source, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def wait(self, event) -> None:
        self._compute().wait_event(event)

    def record(self, buffer=None):
        event = torch.cuda.Event()
        event.record(self._compute())
        return event

    def free(self, buffer, copies=()) -> None:
        super().free(buffer, copies)
        # dropping the last reference returns it to the pool of the stream it was allocated on: that stream first
        # waits for every other stream that used it (what record_stream would do, without holding the memory)
        owner, *users = self._streams.pop(id(buffer), [self._compute()])
        for stream in [*users, self._compute()]:
            if stream != owner:
                owner.wait_stream(stream)

    def synchronize(self) -> None:
        self.side.synchronize()
        self._compute().synchronize()

    def host_wait(self, event) -> None:
        if event is not None:
            event.synchronize()

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        # page-locked with cudaHostRegister, not torch's pinned host allocator: its exact bytes, and given back to
        # the system at ``free_host`` (the allocator would round it up to a power of two, and keep it locked in its
        # cache after the buffer is dropped, past ``pipemap.reset``)
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        torch.cuda.check_error(int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), max(nbytes, 1), 1)))
        return buffer

    def free_host(self, buffer: torch.Tensor, last_copy=None) -> None:
        self.host_wait(last_copy)  # the driver must not unlock memory a queued copy still reads
        torch.cuda.check_error(int(torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())))


# ---- the model ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    queue: str
    seq: int


class _Queue:
    def __init__(self, name: str):
        self.name = name
        self.ops: list[tuple[Event, ...]] = []  # per op, the events it waits for
        self.done = 0  # ops completed
        self.waited: dict[str, int] = collections.defaultdict(lambda: -1)  # latest event waited for, per queue

    def pending(self) -> int:
        return len(self.ops) - self.done


class ModelQueues(Queues):
    """CUDA streams and the caching allocator, modelled for stand-in devices and the CPU.

    Copies run at once (the data is right whatever the order); what is modelled is when the GPU would have done
    them. Each queue completes its ops in order, an op only after the events it waits for; ``lag`` is how many ops a
    queue may leave incomplete (how far the host runs ahead): ``None``, nothing completes until the host
    synchronises. A buffer freed while a copy into it is not ordered before the compute queue's current point stays
    held (referenced, so the dry run's storage tracker counts it) until that copy completes: ``held`` and ``peak``
    count allocated plus held bytes.
    """

    lag: int | None = None  # the default for new models; tests set it to try other run-aheads

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.lag = type(self).lag
        self.queues = {"compute": _Queue("compute"), "copy": _Queue("copy")}
        self.held = self.peak = 0
        self.pending_frees: list[tuple[torch.Tensor, list[Event]]] = []
        self.writes: dict[int, list[Event]] = {}  # id(buffer) -> copies into it not yet ordered before compute
        self.last_use: dict[int, Event] = {}  # id(buffer) -> its last use on compute

    def alloc(self, nbytes: int) -> torch.Tensor:
        buffer = super().alloc(nbytes)
        self._hold(nbytes)
        return buffer

    def _hold(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def _enqueue(self, queue: str, waits: tuple[Event | None, ...] = ()) -> Event:
        q = self.queues[queue]
        q.ops.append(tuple(e for e in waits if e is not None))
        event = Event(queue, len(q.ops) - 1)
        self._settle()
        return event

    def copy(self, pairs, after=None, side: bool = True, name: str = ""):
        queue = "copy" if side else "compute"
        buffers = {id(d.untyped_storage()) for d, _ in pairs}
        for key in buffers:
            last = self.last_use.get(key)
            if side and last is not None and not self._ordered(last, "copy", after):
                raise BufferReuseError(name, str(self.device))
        for destination, source in pairs:
            destination.copy_(source)
        if after is not None:
            self.queues[queue].waited[after.queue] = max(self.queues[queue].waited[after.queue], after.seq)
        event = self._enqueue(queue, (after,))
        if side:
            for key in buffers:
                self.writes.setdefault(key, []).append(event)
        return event

    def _ordered(self, event: Event, queue: str, after: Event | None) -> bool:
        """Is ``event`` ordered before what ``queue`` does next (same queue, waited for, or ``after`` covers it)?"""
        if event.queue == queue:
            return True
        waited = self.queues[queue].waited[event.queue]
        if after is not None and after.queue == event.queue:
            waited = max(waited, after.seq)
        return waited >= event.seq

    def wait(self, event) -> None:
        if event is None:
            return
        compute = self.queues["compute"]
        compute.waited[event.queue] = max(compute.waited[event.queue], event.seq)
        self._enqueue("compute", (event,))

    def used(self, event, name: str) -> None:
        if event is not None and not self._ordered(event, "compute", None):
            raise UnwaitedCopyError(name, str(self.device))

    def record(self, buffer=None):
        event = self._enqueue("compute")
        if buffer is not None:
            self.last_use[id(buffer.untyped_storage())] = event
        return event

    def free(self, buffer, copies=()) -> None:
        super().free(buffer, copies)
        key = id(buffer.untyped_storage())
        self.last_use.pop(key, None)
        unordered = [e for e in self.writes.pop(key, []) if not self._ordered(e, "compute", None)]
        nbytes = buffer.untyped_storage().nbytes()
        if any(not self._complete(e) for e in unordered):
            self.pending_frees.append((buffer, unordered))  # as record_stream: held until the copy is done
        else:
            self.held -= nbytes

    def _complete(self, event: Event) -> bool:
        return self.queues[event.queue].done > event.seq

    def _complete_through(self, queue: str, seq: int) -> None:
        q = self.queues[queue]
        while q.done <= seq:
            for event in q.ops[q.done]:
                self._complete_through(event.queue, event.seq)
            q.done += 1

    def _settle(self) -> None:
        if self.lag is not None:
            for name, q in self.queues.items():
                if q.pending() > self.lag:
                    self._complete_through(name, q.done + q.pending() - self.lag - 1)
        self._release()

    def _release(self) -> None:
        still = []
        for buffer, events in self.pending_frees:
            if all(self._complete(e) for e in events):
                self.held -= buffer.untyped_storage().nbytes()
            else:
                still.append((buffer, events))
        self.pending_frees = still

    def synchronize(self) -> None:
        for name, q in self.queues.items():
            if q.ops:
                self._complete_through(name, len(q.ops) - 1)
        self._release()

    def host_wait(self, event) -> None:
        if event is not None:
            self._complete_through(event.queue, event.seq)
            self._release()
