"""A fake CUDA for the CPU, with a happens-before checker: pipemap's CUDA code runs in CI as it runs on a GPU.

Modelled on PyTorch's documented semantics (``torch.cuda`` streams, events and the caching allocator; the copy rules
of ``aten/src/ATen/native/cuda/Copy.cu``):

- a tensor on ``cuda:N`` is a ``CudaTensor``: a wrapper whose device says ``cuda:N`` around CPU data, so every
  kernel runs for real on the CPU and mixing devices raises as on a GPU (a weight left on the host fails the call);
- streams and events: each stream has a vector clock; an op ticks it; ``Event.record`` snapshots it,
  ``wait_event``/``wait_stream`` merge into it; ``synchronize`` (stream, event, device) merges it into the host's,
  and everything enqueued afterwards is ordered after what the host waited for. Nothing else orders two streams;
- the current device and the current stream of each device are per thread (a new thread starts on the default
  streams, as in PyTorch); ``torch.cuda.stream(s)`` selects ``s`` and its device;
- a kernel runs on the current stream of its tensors' device; a host-to-device copy on the destination's current
  stream, a device-to-host copy on the source's; a copy between GPUs on the source's current stream, fenced both
  ways with the destination's current stream; a copy without ``non_blocking`` makes the host wait for its stream;
- the caching allocator (c10/cuda/CUDACachingAllocator.cpp): requests rounded to 512 B; up to 1 MiB from a small
  pool of 2 MiB segments, larger ones from a large pool (20 MiB segments under 10 MiB, else the request rounded to
  2 MiB); a cached free block is split (small: a rest of 512 B or more, large: a rest over 1 MiB), freed blocks
  merge only with their neighbours in one segment; each segment belongs to the stream current at its allocation and
  its freed blocks go to that stream's pool at once (stream-ordered reuse; ``record_stream`` is not used by pipemap
  and not modelled), so memory used on another stream and freed too early shows as a race. The cap
  (``set_per_process_memory_fraction``, else the device) is on RESERVED bytes: a new segment past it first releases
  every whole cached segment, then raises CUDA's out-of-memory text; a split segment is never released, so
  fragmentation fails an allocation that fits in allocated terms, as on a GPU;
- ``cudaHostRegister``/``cudaHostUnregister`` as the driver answers them (712 on an overlapping registration, 713 on
  an unknown one), and an unregistration while an asynchronous copy may still read the memory is a race.

The checker: every op on a fake GPU reads its tensor inputs and writes its outputs (views touch nothing). Two
accesses to one block from different streams, one a write, with no chain of events or host waits ordering the first
before the second: a race, i.e. a GPU may run them in either order (a copy overwriting weights in use, a kernel
reading weights that have not arrived). Races are collected, not raised (a hook's own ``except`` must not hide them):
the ``fake_cuda`` fixture fails a test that leaves any.

Threads started while the fake is installed run under its host mode (factories with ``device="cuda"``, ``.to()``,
``.data =``); ``torch.cuda`` functions pipemap, diffusers and transformers call are replaced for the duration.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import multiprocessing.util
import os
import shutil
import tempfile
import threading
import traceback
import types
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed._functional_collectives as _funcol
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from pipemap.hooks.worker import SETUP_ENV

aten = torch.ops.aten
# the op torch's functional collectives end with (a result that waits on first use); the fake hands it the CudaTensor
_WRAP_COLLECTIVE = torch.ops._c10d_functional._wrap_tensor_autograd.default
# gloo's all-gather into one tensor reads a GPU tensor's memory as the host's: a segfault on CUDA (the H200, torch
# 2.11), where its all-to-all stages GPU tensors through the host itself
_GATHER_INTO = torch.ops._c10d_functional.all_gather_into_tensor.default
ROUND = 512  # the caching allocator's block granularity (kMinBlockSize)
SMALL = 2**20  # requests up to this come from the small pool (kSmallSize)
SMALL_SEGMENT = 2 * 2**20  # a small pool's segment (kSmallBuffer)
LARGE_SEGMENT = 20 * 2**20  # a large pool's segment for a request under MIN_LARGE (kLargeBuffer)
MIN_LARGE = 10 * 2**20  # from here a request gets a segment of its own size (kMinLargeAlloc) ...
ROUND_LARGE = 2 * 2**20  # ... rounded to 2 MiB (kRoundLarge)


def segment_size(size: int) -> int:
    """The bytes the caching allocator asks cudaMalloc for when no cached block fits a (rounded) request."""
    if size <= SMALL:
        return SMALL_SEGMENT
    return LARGE_SEGMENT if size < MIN_LARGE else -(-size // ROUND_LARGE) * ROUND_LARGE


# ---- streams, events, clocks -------------------------------------------------------------------------------------


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def _merge(into: dict[int, int], other: dict[int, int]) -> None:
    for key, value in other.items():
        if into.get(key, 0) < value:
            into[key] = value


POOLED_STREAMS = 32  # CUDA hands out each device's streams of one priority from a pool of 32, round robin


class FakeStream:
    """``torch.cuda.Stream``: a queue of ops with a vector clock. As in PyTorch, ``torch.cuda.Stream()`` hands out
    one of ``POOLED_STREAMS`` pooled streams per device and priority, round robin: the 33rd is the 1st again."""

    def __new__(cls, device=None, priority: int = 0, *, name: str | None = None, fake: FakeCuda | None = None):
        fake = fake or FakeCuda.active
        if name is not None:  # the fake's own (a default stream): not pooled
            return super().__new__(cls)
        with fake.lock:
            pool = fake.stream_pools.setdefault((fake.index(device), priority), [])
            if len(pool) < POOLED_STREAMS:
                pool.append(super().__new__(cls))
                return pool[-1]
            turn = fake.stream_turns.get((fake.index(device), priority), 0)
            fake.stream_turns[(fake.index(device), priority)] = turn + 1
            return pool[turn % POOLED_STREAMS]

    def __init__(self, device=None, priority: int = 0, *, name: str | None = None, fake: FakeCuda | None = None):
        if "clock" in self.__dict__:
            return  # a pooled stream handed out again: it keeps its queue
        self.fake = fake or FakeCuda.active
        self.device_index = self.fake.index(device)
        self.device = torch.device("cuda", self.device_index)
        self.priority = priority
        self.id = next(self.fake.ids)
        self.name = name or f"stream {self.id} of cuda:{self.device_index}"
        self.clock: dict[int, int] = {}
        self.cuda_stream = self.id
        self.fake.streams.add(self)

    def tick(self) -> int:
        """One op enqueued now (by the host, after everything it has waited for): its count on this stream."""
        _merge(self.clock, self.fake.host)
        self.clock[self.id] = self.clock.get(self.id, 0) + 1
        return self.clock[self.id]

    def wait_event(self, event) -> None:
        with self.fake.lock:
            if event is not None and event.clock is not None:
                _merge(self.clock, event.clock)
            self.tick()

    def wait_stream(self, stream) -> None:
        with self.fake.lock:
            _merge(self.clock, stream.clock)
            self.tick()

    def record_event(self, event=None):
        event = event or FakeEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        with self.fake.lock:
            self.fake.check_sticky()
            self.fake.host_waits(self.clock)

    def query(self) -> bool:
        return True

    def __eq__(self, other) -> bool:
        return isinstance(other, FakeStream) and other.id == self.id

    def __hash__(self) -> int:
        return hash(("stream", self.id))

    def __repr__(self) -> str:
        return f"<FakeStream {self.name}>"


class FakeEvent:
    """``torch.cuda.Event``: a snapshot of a stream's clock."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.clock: dict[int, int] | None = None

    def record(self, stream=None) -> None:
        fake = FakeCuda.active
        stream = stream if stream is not None else fake.current_stream()
        with fake.lock:
            stream.tick()
            self.clock = dict(stream.clock)

    def wait(self, stream=None) -> None:
        (stream if stream is not None else FakeCuda.active.current_stream()).wait_event(self)

    def synchronize(self) -> None:
        fake = FakeCuda.active
        with fake.lock:
            fake.check_sticky()
            if self.clock:
                fake.host_waits(self.clock)

    def query(self) -> bool:
        return True

    def elapsed_time(self, end) -> float:
        return 0.0


# ---- memory and accesses -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Access:
    stream: str
    sid: int
    count: int
    kind: str  # "read" | "write"
    op: str
    thread: str
    stack: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.kind} by {self.op} on {self.stream} ({self.thread})"


@dataclass(eq=False)
class Block:
    """A block of the caching allocator: a logical address range inside one segment of one device, owned by the
    pool of the stream the segment was allocated on. Its accesses outlive it: a split or merge hands them on."""

    device: int
    address: int
    nbytes: int  # what memory_allocated counts while in use (a large block's unsplit rest included), as on CUDA
    owner: int  # the stream whose pool it returns to
    label: str = ""
    small: bool = False  # from the small pool (requests up to 1 MiB)
    free: bool = False
    prev: Block | None = None  # the neighbours in its segment (None at the segment's ends)
    next: Block | None = None
    # (lo, hi, stream id, kind) -> the latest such access of those bytes: the last write, the reads since
    history: dict[tuple[int, int, int, str], Access] = field(default_factory=dict)

    def inherit(self, other: Block) -> None:
        """Take ``other``'s accesses as well (its range became part of this one)."""
        for key, access in other.history.items():
            if key not in self.history or self.history[key].count < access.count:
                self.history[key] = access

    def clipped(self, lo: int, hi: int) -> dict[tuple[int, int, int, str], Access]:
        """The accesses that touched bytes in [lo, hi), cut to that range (a split block's part keeps its own)."""
        return {(max(a, lo), min(b, hi), sid, kind): access for (a, b, sid, kind), access in self.history.items()
                if a < hi and lo < b}


@dataclass(frozen=True)
class Race:
    block: str
    earlier: Access
    later: Access

    def __str__(self) -> str:
        where = f"\n      earlier at: {' <- '.join(self.earlier.stack)}" if self.earlier.stack else ""
        where += f"\n      later at:   {' <- '.join(self.later.stack)}" if self.later.stack else ""
        return f"{self.block}: {self.earlier}  ||  {self.later}{where}"


class FakeCuda:
    """The state of one installed fake: streams, the host's clock, the allocator's blocks, the races found."""

    active: FakeCuda

    def __init__(self, gpus: int = 2, memory: int = 80 * 2**30):
        self.gpus, self.memory = gpus, memory
        self.limit: dict[int, int] = {}  # device -> bytes the allocator may hand out (out of memory past it)
        self.lock = threading.RLock()
        self.local = threading.local()
        self.ids = itertools.count()
        self.host: dict[int, int] = {}
        self.defaults: dict[int, FakeStream] = {}
        self.blocks: dict[int, Block] = {}  # CPU storage address -> the block it stands for
        self.pools: dict[int, list[Block]] = {}  # stream id -> its free blocks (cached, of both sizes)
        self.busy = False  # the allocator's lists are being changed (a storage freed meanwhile waits in `deferred`)
        self.deferred: list[tuple[int, Block]] = []
        self.next_address = ROUND
        self.allocated: dict[int, int] = {}
        self.peak: dict[int, int] = {}
        self.reserved: dict[int, int] = {}
        self.peak_reserved: dict[int, int] = {}
        self.races: list[Race] = []
        self.registered: dict[int, int] = {}  # cudaHostRegister'ed host address -> bytes
        self.register_log: list[tuple[str, int, int]] = []
        # (start, end, stream, count, lo, hi): async copies from pinned memory (the buffer, the bytes read)
        self.host_reads: list[tuple[int, int, int, int, int, int]] = []
        self.trace = False  # keep a short stack per access (slower), for a race's report
        self.streams: weakref.WeakSet[FakeStream] = weakref.WeakSet()
        self.stream_pools: dict[tuple[int, int], list[FakeStream]] = {}  # (device, priority) -> pooled streams
        self.stream_turns: dict[tuple[int, int], int] = {}
        self.host_pinned: dict[int, int] = {}  # the pinned host allocator's live blocks: address -> bytes
        self.host_cached: dict[int, int] = {}  # its freed blocks, still page-locked until ``_host_emptyCache``
        self.sticky: str | None = None  # a sticky error (illegal address, device assert): every later call fails
        self.corrupt_pairs: set[tuple[int, int]] = set()  # (source, destination) GPUs whose direct copies corrupt
        self.workers_folder: str | None = None  # where its worker processes' fakes write their races (``install``)

    # ---- devices and streams, per thread

    def index(self, device=None) -> int:
        if device is None or device == -1:
            return self.current_device()
        if isinstance(device, int):
            index = device
        else:
            device = torch.device(device)
            if device.type != "cuda":
                raise ValueError(f"expected a CUDA device, got {device}")
            index = device.index if device.index is not None else self.current_device()
        if not 0 <= index < self.gpus:
            raise RuntimeError(f"CUDA error: invalid device ordinal (cuda:{index}; this machine has {self.gpus})")
        return index

    def current_device(self) -> int:
        return getattr(self.local, "device", 0)

    def default_stream(self, device=None) -> FakeStream:
        index = self.index(device)
        with self.lock:
            if index not in self.defaults:
                self.defaults[index] = FakeStream(index, name=f"default stream of cuda:{index}", fake=self)
            return self.defaults[index]

    def current_stream(self, device=None) -> FakeStream:
        index = self.index(device)
        streams = getattr(self.local, "streams", {})
        return streams.get(index) or self.default_stream(index)

    def set_stream(self, stream: FakeStream) -> None:
        if not hasattr(self.local, "streams"):
            self.local.streams = {}
        self.local.streams[stream.device_index] = stream
        self.local.device = stream.device_index  # as torch.cuda.set_stream: the stream's device becomes current

    def host_waits(self, clock: dict[int, int]) -> None:
        _merge(self.host, clock)
        self.host_reads = [r for r in self.host_reads if self.host.get(r[2], 0) < r[3]]

    def synchronize(self, device=None) -> None:
        index = self.index(device)
        with self.lock:
            self.check_sticky()
            for stream in self._streams(index):
                self.host_waits(stream.clock)

    def _streams(self, index: int) -> list[FakeStream]:
        # every stream of the device: the checker's clocks are what matters, so walk what accessed or was made
        return [s for s in list(self.streams) if s.device_index == index]

    # ---- the allocator

    def block_of(self, inner: torch.Tensor) -> Block | None:
        storage = inner.untyped_storage()
        if storage.nbytes() == 0:
            return None
        return self.blocks.get(storage.data_ptr())

    def allocate(self, inner: torch.Tensor, index: int, label: str) -> Block | None:
        """The block a new storage on ``cuda:index`` gets: the smallest cached free block of the current stream's
        pool that fits (split), else a new segment; CUDA's out-of-memory error past the cap on reserved bytes."""
        self.check_sticky()
        storage = inner.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:
            return None
        stream = self.current_stream(index)
        size = -(-nbytes // ROUND) * ROUND
        small = size <= SMALL
        with self.lock, self.changing():
            if storage.data_ptr() in self.blocks:  # a function that handed back its input: nothing new
                return self.blocks[storage.data_ptr()]
            pool = self.pools.setdefault(stream.id, [])
            fits = [b for b in pool if b.device == index and b.small == small and b.nbytes >= size]
            if fits:
                block = min(fits, key=lambda b: (b.nbytes, b.address))
                pool.remove(block)
            else:
                block = self.new_segment(index, stream.id, small, size)
            self.split(block, size)
            block.free, block.label = False, label
            self.blocks[storage.data_ptr()] = block
            self.allocated[index] = self.allocated.get(index, 0) + block.nbytes
            self.peak[index] = max(self.peak.get(index, 0), self.allocated[index])
        weakref.finalize(storage, self._free, storage.data_ptr(), block)
        return block

    @contextlib.contextmanager
    def changing(self):
        """The pools change inside: a storage the garbage collector frees meanwhile (this thread, the lock is
        re-entrant) is handed back after, not while a pool is half walked."""
        outer, self.busy = self.busy, True
        try:
            yield
        finally:
            self.busy = outer
            while not outer and self.deferred:
                self._free(*self.deferred.pop())

    def new_segment(self, index: int, owner: int, small: bool, size: int) -> Block:
        """cudaMalloc of a segment for a ``size`` request; past the cap, every whole cached segment of the device
        is released first (``release_cached_blocks``), then out of memory."""
        nbytes = segment_size(size)
        cap = min(self.limit.get(index, self.memory), self.memory)
        if self.reserved.get(index, 0) + nbytes > cap:
            self.release_cached(index)
            if self.reserved.get(index, 0) + nbytes > cap:
                raise torch.OutOfMemoryError(self.oom_message(index, nbytes))
        block = Block(index, self.next_address, nbytes, owner, small=small)
        self.next_address += nbytes
        self.reserved[index] = self.reserved.get(index, 0) + nbytes
        self.peak_reserved[index] = max(self.peak_reserved.get(index, 0), self.reserved[index])
        return block

    def split(self, block: Block, size: int) -> None:
        """Cut ``block`` to ``size`` when the rest is worth keeping (small pool: 512 B, large: over 1 MiB); the rest
        goes back to the owner's pool, with the accesses of the range it was part of."""
        rest = block.nbytes - size
        if rest < ROUND if block.small else rest <= SMALL:
            return
        cut = block.address + size
        tail = Block(block.device, cut, rest, block.owner, small=block.small, free=True, prev=block, next=block.next,
                     history=block.clipped(cut, cut + rest))
        block.history = block.clipped(block.address, cut)
        if block.next is not None:
            block.next.prev = tail
        block.next, block.nbytes = tail, size
        self.pools.setdefault(block.owner, []).append(tail)

    def oom_message(self, index: int, size: int) -> str:
        """CUDA's out-of-memory text (c10/cuda/CUDACachingAllocator.cpp: the bytes tried are the segment's), which
        admission reads the GPU and the bytes tried from."""
        cap, used = min(self.limit.get(index, self.memory), self.memory), self.allocated.get(index, 0)
        reserved = self.reserved.get(index, 0)
        return (f"CUDA out of memory. Tried to allocate {_mib(size)}. GPU {index} has a total capacity of "
                f"{_mib(self.memory)} of which {_mib(max(0, cap - reserved))} is free. Of the allocated memory "
                f"{_mib(used)} is allocated by PyTorch, and {_mib(max(0, reserved - used))} is reserved by PyTorch "
                "but unallocated. If reserved but unallocated memory is large try setting "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation. (fake CUDA)")

    def _free(self, address: int, block: Block) -> None:
        with self.lock:
            if self.busy:
                self.deferred.append((address, block))
                return
            if self.blocks.get(address) is block:
                del self.blocks[address]
            self.allocated[block.device] -= block.nbytes
            pool = self.pools.setdefault(block.owner, [])
            for neighbour in (block.prev, block.next):
                if neighbour is not None and neighbour.free:  # merge: free blocks of one segment become one
                    pool.remove(neighbour)
                    block.inherit(neighbour)
                    block.nbytes += neighbour.nbytes
                    if neighbour is block.prev:
                        block.address, block.prev = neighbour.address, neighbour.prev
                        if block.prev is not None:
                            block.prev.next = block
                    else:
                        block.next = neighbour.next
                        if block.next is not None:
                            block.next.prev = block
            block.free, block.label = True, ""
            pool.append(block)

    def release_cached(self, index: int | None = None) -> None:
        """cudaFree of every cached segment that is whole (no block of it in use) on ``cuda:index`` (all: None)."""
        with self.lock, self.changing():
            for sid, pool in self.pools.items():
                whole = [b for b in pool if b.prev is None and b.next is None and index in (None, b.device)]
                for block in whole:
                    self.reserved[block.device] -= block.nbytes
                self.pools[sid] = [b for b in pool if b not in whole]

    def empty_cache(self) -> None:
        self.release_cached()

    # ---- accesses

    def access(self, stream: FakeStream, reads: list[Block], writes: list[Block], op: str) -> None:
        """One op on ``stream`` reading and writing these blocks: checked against earlier accesses, then recorded."""
        with self.lock:
            self.check_sticky()
            count = stream.tick()
            stack = tuple(_stack()) if self.trace else ()
            thread = threading.current_thread().name
            made = {kind: Access(stream.name, stream.id, count, kind, op, thread, stack) for kind in ("read", "write")}
            for block in dict.fromkeys(writes):  # every access so far was to bytes of this block (split clips)
                for earlier in list(block.history.values()):
                    self._check(block, earlier, made["write"], stream)
                block.history = {(block.address, block.address + block.nbytes, stream.id, "write"): made["write"]}
            for block in dict.fromkeys(b for b in reads if b not in writes):
                for key, earlier in list(block.history.items()):
                    if key[3] == "write":
                        self._check(block, earlier, made["read"], stream)
                block.history[(block.address, block.address + block.nbytes, stream.id, "read")] = made["read"]

    def _check(self, block: Block, earlier: Access | None, later: Access, stream: FakeStream) -> None:
        if earlier is not None and earlier.sid != stream.id and stream.clock.get(earlier.sid, 0) < earlier.count:
            self.races.append(Race(f"cuda:{block.device} block {block.address:#x} ({block.label})", earlier, later))

    # ---- ops, and copies between the host and the devices and between devices

    def run(self, func, args, kwargs):
        if func is _WRAP_COLLECTIVE:  # torch's functional collectives: the result waits on first use, as on CUDA
            return _funcol.AsyncCollectiveTensor(args[0])
        if func is _GATHER_INTO and torch._C._distributed_c10d._resolve_process_group(args[2]).name() == "gloo":
            raise RuntimeError("gloo's all-gather into a tensor was given a GPU tensor: it reads it as host memory "
                               "(a segfault on CUDA) (fake CUDA)")
        if func is aten._to_copy.default:
            return self.to_copy(args[0], kwargs)
        # inference_mode hands ``to`` over whole (no autograd key decomposed it into ``_to_copy``)
        if getattr(func, "overloadpacket", None) is aten.to:
            return self.to_op(func, args, kwargs)
        if func is aten.copy_.default:
            return self.copy_(args[0], args[1], bool(args[2]) if len(args) > 2 else kwargs.get("non_blocking", False))
        flat = tree_flatten((args, kwargs))[0]
        index = self.kernel_device(func, flat)
        target = kwargs.get("device")
        if target is not None and torch.device(target).type == "cuda":
            index = self.index(target)
            kwargs = {**kwargs, "device": "cpu"}
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if target is not None and torch.device(target).type == "cpu":
            return out  # e.g. new_zeros(..., device="cpu"): a host tensor
        schema = _schema(func)
        inputs = {id(t.inner.untyped_storage()): t for t in flat if isinstance(t, CudaTensor)}
        known = {t.inner.untyped_storage().data_ptr() for t in inputs.values()}
        op = str(func).removeprefix("aten.")
        fresh: list[Block] = []

        def wrap(o):
            if not isinstance(o, torch.Tensor):
                return o
            if o.untyped_storage().data_ptr() not in known and o.untyped_storage().nbytes():
                block = self.allocate(o, index, f"{op} {tuple(o.shape)}")
                if block is not None and func not in _NO_ACCESS:
                    fresh.append(block)
            return CudaTensor(o, index)

        wrapped = tree_map(wrap, out)
        if schema.view or func in _NO_ACCESS:
            return wrapped
        written = [args[w] if isinstance(w, int) and w < len(args) else kwargs.get(w) for w in schema.writes]
        writes = [self.block_of(t.inner) for t in written if isinstance(t, CudaTensor)]
        reads = [self.block_of(t.inner) for t in inputs.values()]
        self.access(self.current_stream(index), [b for b in reads if b], [b for b in [*writes, *fresh] if b], op)
        if not isinstance(out, (torch.Tensor, list, tuple)) or out is None:
            self.current_stream(index).synchronize()  # a value the host reads (item, equal, is_nonzero): it waits
        return wrapped

    def kernel_device(self, func, flat) -> int:
        """The device a kernel runs on; tensors of two devices, or a host tensor beside a GPU one, fail as on a GPU."""
        devices = {t.device.index for t in flat if isinstance(t, CudaTensor)}
        host = [t for t in flat if isinstance(t, torch.Tensor) and not isinstance(t, CudaTensor) and t.dim() > 0]
        if len(devices) > 1 or (host and func not in _MIXED_OK):
            found = sorted({f"cuda:{i}" for i in devices} | ({"cpu"} if host else set()))
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"{found[0]} and {found[1]}! (in {func}, fake CUDA)")
        return devices.pop()

    def to_copy(self, source, kwargs: dict):
        target = kwargs.get("device")
        target = torch.device(target) if target is not None else source.device
        options = {k: v for k, v in kwargs.items() if k not in ("device", "non_blocking", "pin_memory")}
        inner = aten._to_copy.default(_unwrap(source), **options)  # a new CPU tensor of the asked dtype and layout
        non_blocking = bool(kwargs.get("non_blocking", False))
        if target.type == "cpu":
            return self.device_to_host(source, inner, non_blocking)
        index = self.index(target)
        if not isinstance(source, CudaTensor):
            return self.host_to_device(source, inner, index, non_blocking)
        out = CudaTensor(inner, index)
        block = self.allocate(inner, index, f"copy of {tuple(inner.shape)}")
        self.transfer(source, block, index, non_blocking, "to_copy", inner)
        return out

    def to_op(self, func, args, kwargs: dict):
        """``aten.to`` (any overload) as torch runs it: the input itself where nothing changes and no copy is asked,
        else ``_to_copy``'s copy to the device and dtype it names (``to.other``: those of the other tensor)."""
        bound = dict(zip((a.name for a in func._schema.arguments), args, strict=False)) | kwargs
        source, other = bound["self"], bound.get("other")
        device = torch.device(bound["device"]) if bound.get("device") is not None else (
            other.device if other is not None else source.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", self.index(device))
        dtype = bound.get("dtype") or (other.dtype if other is not None else source.dtype)
        if not bound.get("copy") and device == source.device and dtype == source.dtype:
            return source
        options = {"dtype": dtype, "device": device, "non_blocking": bool(bound.get("non_blocking"))}
        if bound.get("memory_format") is not None:
            options["memory_format"] = bound["memory_format"]
        return self.to_copy(source, options)

    def copy_(self, destination, source, non_blocking: bool):
        _unwrap(destination).copy_(_unwrap(source))
        if not isinstance(destination, CudaTensor):  # device to host, into an existing host tensor
            stream = self.current_stream(source.device)
            self.access(stream, [self.block_of(source.inner)] if self.block_of(source.inner) else [], [], "copy_ d2h")
            if not non_blocking:
                stream.synchronize()
            return destination
        block = self.block_of(destination.inner)
        index = destination.device.index
        if not isinstance(source, CudaTensor):
            stream = self.current_stream(index)
            self.access(stream, [], [block] if block else [], "copy_ h2d")
            self.after_host_copy(source, stream, non_blocking)
            return destination
        self.transfer(source, block, index, non_blocking, "copy_", destination.inner)
        return destination

    def host_to_device(self, source: torch.Tensor, inner: torch.Tensor, index: int, non_blocking: bool):
        out = CudaTensor(inner, index)
        block = self.allocate(inner, index, f"h2d {tuple(inner.shape)}")
        stream = self.current_stream(index)
        self.access(stream, [], [block] if block else [], "h2d copy")
        self.after_host_copy(source, stream, non_blocking)
        return out

    def after_host_copy(self, source: torch.Tensor, stream: FakeStream, non_blocking: bool) -> None:
        """A blocking copy from the host waits for its stream; an asynchronous one from pinned memory reads it
        until it runs (from pageable memory the driver stages it first: nothing to wait for)."""
        if non_blocking:
            self.host_read(source, stream)
        else:
            stream.synchronize()

    def device_to_host(self, source, inner: torch.Tensor, non_blocking: bool):
        stream = self.current_stream(source.device)
        block = self.block_of(source.inner)
        self.access(stream, [block] if block else [], [], "d2h copy")
        if not non_blocking:
            stream.synchronize()
        return inner

    def transfer(self, source: CudaTensor, block: Block | None, index: int, non_blocking: bool, op: str,
                 inner: torch.Tensor | None = None):
        """A copy from ``source`` into ``block`` on ``cuda:index``; between two GPUs, Copy.cu's two-way fence: the copy
        runs on the source's current stream after the destination's current stream, which then waits for it."""
        source_block = self.block_of(source.inner)
        if source.device.index == index:
            reads, writes = [source_block] if source_block else [], [block] if block else []
            self.access(self.current_stream(index), reads, writes, op)
            return
        if (source.device.index, index) in self.corrupt_pairs and inner is not None:
            inner.zero_()  # a broken peer link: the copy "succeeds" with wrong bytes
        copier, receiver = self.current_stream(source.device), self.current_stream(index)
        copier.wait_event(receiver.record_event())
        self.access(copier, [source_block] if source_block else [], [block] if block else [], f"{op} p2p")
        receiver.wait_event(copier.record_event())

    # ---- host registrations

    def host_read(self, source: torch.Tensor, stream: FakeStream) -> None:
        """An asynchronous copy from host memory: if pinned, the host must not unregister it before it runs."""
        lo = source.data_ptr()
        hi = lo + source.numel() * source.element_size()
        for start, nbytes in [*self.registered.items(), *self.host_pinned.items()]:
            if start <= lo < start + nbytes:
                self.host_reads.append((start, start + nbytes, stream.id, stream.clock.get(stream.id, 0), lo, hi))
                return

    def pin_host_block(self, tensor: torch.Tensor) -> None:
        """A block of the pinned host allocator (``pin_memory=True``): page-locked while in use, and cached, still
        page-locked, once freed (``torch._C._host_emptyCache`` gives the cached ones back)."""
        storage = tensor.untyped_storage()
        address, nbytes = storage.data_ptr(), storage.nbytes()
        if not nbytes:
            return
        with self.lock:
            self.host_cached.pop(address, None)
            self.host_pinned[address] = nbytes
        weakref.finalize(storage, self._host_freed, address, nbytes)

    def _host_freed(self, address: int, nbytes: int) -> None:
        with self.lock:
            if self.host_pinned.get(address) == nbytes:
                del self.host_pinned[address]
                self.host_cached[address] = nbytes

    def host_empty_cache(self) -> None:
        with self.lock:
            self.host_cached.clear()

    def host_write(self, target, func) -> None:
        """The host writes into ``target``: a race with an asynchronous copy that still reads those bytes of pinned
        memory (the copy may run after the write and move the new bytes)."""
        if not isinstance(target, torch.Tensor) or isinstance(target, CudaTensor) or target.device.type != "cpu":
            return
        lo = target.data_ptr()
        hi = lo + max(target.numel(), 1) * target.element_size()
        with self.lock:
            for start, _, sid, count, read_lo, read_hi in self.host_reads:
                if read_lo < hi and lo < read_hi and self.host.get(sid, 0) < count:
                    stream = next((st for st in self.streams if st.id == sid), None)
                    earlier = Access(stream.name if stream else str(sid), sid, count, "read",
                                     "async copy from pinned memory", "?")
                    later = Access("host", -1, 0, "write", getattr(func, "__name__", str(func)),
                                   threading.current_thread().name, tuple(_stack()) if self.trace else ())
                    self.races.append(Race(f"host buffer {start:#x}", earlier, later))
                    return

    # ---- sticky errors

    def fail_sticky(self, message: str = "CUDA error: an illegal memory access was encountered") -> None:
        """What an illegal address or a device-side assert does to a CUDA context: every later call fails."""
        self.sticky = message

    def check_sticky(self) -> None:
        if self.sticky is not None:
            raise torch.AcceleratorError(f"{self.sticky} (sticky: the CUDA context is unusable; fake CUDA)") \
                if hasattr(torch, "AcceleratorError") else RuntimeError(f"{self.sticky} (sticky; fake CUDA)")

    # ---- the report

    def report(self) -> str:
        races = list(dict.fromkeys(str(r) for r in self.races))
        return f"{len(races)} race(s)" + "".join(f"\n  race: {r}" for r in races[:8])

    def assert_no_races(self) -> None:
        assert not self.races, self.report()
        assert not self.worker_races(), "\n".join(self.worker_races())

    def worker_races(self) -> list[str]:
        """What each worker process under this fake that has stopped found (``in_worker``): its report, per pid."""
        folder = self.workers_folder
        if folder is None or not os.path.isdir(folder):
            return []
        found = []
        for name in sorted(os.listdir(folder)):
            with open(os.path.join(folder, name)) as report:
                found.append(f"worker {name.removesuffix('.txt')}: {report.read()}")
        return found

    def take(self) -> list[Race]:
        """The races found so far, forgotten (a test that breaks an ordering on purpose reads them)."""
        with self.lock:
            races, self.races = self.races, []
        return races


def _stack() -> list[str]:
    frames = [f for f in traceback.extract_stack(limit=40) if "/pipemap/" in f.filename or "/tests/" in f.filename]
    return [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in frames if "fakecuda" not in f.filename][-5:]


# ---- the tensor ---------------------------------------------------------------------------------------------------


class CudaTensor(torch.Tensor):
    """A tensor on a fake ``cuda:N``: its data is a CPU tensor (``inner``), every op runs on it through the fake."""

    inner: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, inner: torch.Tensor, index: int):
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, inner.size(), strides=inner.stride(), storage_offset=inner.storage_offset(), dtype=inner.dtype,
            layout=inner.layout, device=torch.device("cuda", index), requires_grad=False)
        wrapper.inner = inner
        return wrapper

    def __repr__(self) -> str:
        return f"CudaTensor({self.inner!r}, device='{self.device}')"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return FakeCuda.active.run(func, args, kwargs or {})

    def __reduce_ex__(self, protocol):
        raise TypeError("a fake CUDA tensor cannot be pickled; move it to the CPU first")


def _unwrap(x):
    return x.inner if isinstance(x, CudaTensor) else x


@dataclass(frozen=True)
class _Schema:
    view: bool
    writes: tuple[int | str, ...]  # positions or names of arguments the op writes


_SCHEMAS: dict = {}


def _schema(func) -> _Schema:
    if not hasattr(func, "_schema"):  # a Python function run as one kernel (_KERNELS)
        return _Schema(False, ())
    if func not in _SCHEMAS:
        schema = func._schema
        writes = []
        for position, argument in enumerate(schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                writes.append(argument.name if argument.kwarg_only else position)
        view = bool(schema.returns) and all(r.alias_info is not None and not r.alias_info.is_write
                                            for r in schema.returns)
        _SCHEMAS[func] = _Schema(view, tuple(writes))
    return _SCHEMAS[func]


_NO_ACCESS = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
              aten.new_empty_strided.default, aten.record_stream.default, aten.is_pinned.default,
              aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default}






_MIXED_OK = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default}



# ---- copies between the host and the devices, and between devices -----------------------------------------------














# ---- the host side: factories, .to(), .data = ------------------------------------------------------------------


_SET_DATA = torch.Tensor.data.__set__
_SET_GRAD_ATTR = torch.Tensor.requires_grad.__set__
_ALLOCATING = {torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty}


class HostMode(TorchFunctionMode):
    """What the host asks of CUDA outside a fake tensor's own ops: factories with ``device="cuda"``, ``.to()`` and
    ``.cuda()`` of host tensors, ``.data =`` (which PyTorch would let mix a host and a fake tensor), no autograd on
    fake tensors (its graph would ask the real CUDA runtime), and the few Python bindings that take a CUDA device
    guard before dispatching (``copy_``, ``item``, ``nonzero``, ...), routed to their ops."""

    def __init__(self, fake: FakeCuda):
        super().__init__()
        self.fake = fake

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        pinned = bool(kwargs.pop("pin_memory", False))  # the pinned host allocator's: modelled in ``host_pinned``
        fake = self.fake
        if fake.host_reads and args and _writes_in_place(func):
            fake.host_write(args[0], func)
        out = self._call(func, args, kwargs)
        if pinned and isinstance(out, torch.Tensor) and not isinstance(out, CudaTensor):
            fake.pin_host_block(out)
        return out

    def _call(self, func, args, kwargs):
        first = args[0] if args else None
        if func in _COLLECTIVES and any(isinstance(t, CudaTensor) for t in tree_flatten(args[:2])[0]):
            return _COLLECTIVES[func](self, *args, **kwargs)
        if isinstance(first, CudaTensor) and func in _GUARDED:
            return _GUARDED[func](self.fake, *args, **kwargs)
        if func in _KERNELS and any(isinstance(t, CudaTensor) for t in tree_flatten((args, kwargs))[0]):
            return self.fake.run(func, args, kwargs)
        if func in _HOST:
            return _HOST[func](self.fake, func, *args, **kwargs)
        device = kwargs.get("device")
        if func is torch._C._nn._parse_to:  # Module.to's parsing, no factory: `device=` kept (issue 39)
            return func(*args, **kwargs)
        if device is not None and torch.device(device).type == "cuda":
            index = self.fake.index(device)
            out = func(*args, **{**kwargs, "device": "cpu"})
            return tree_map(lambda o: _fresh(self.fake, o, index, func) if isinstance(o, torch.Tensor) else o, out)
        try:
            return func(*args, **kwargs)
        except RuntimeError as err:
            if "not linked with support for cuda" in str(err):
                raise RuntimeError(f"the fake CUDA cannot run {func} yet: its Python binding asks the real CUDA "
                                   "runtime; route it in tests/fakecuda.py (_GUARDED)") from err
            raise


def _to(fake: FakeCuda, func, tensor, *args, **kwargs):
    if isinstance(tensor, CudaTensor) and func is torch.Tensor.to:
        return func(tensor, *args, **kwargs)
    target, dtype, non_blocking = _target(func, (tensor, *args), kwargs)
    if target is None or target.type != "cuda":
        return func(tensor, *args, **kwargs)
    if isinstance(tensor, CudaTensor):  # .cuda() of a fake tensor
        return aten._to_copy.default(tensor, device=torch.device("cuda", fake.index(target)),
                                     non_blocking=non_blocking) if fake.index(target) != tensor.device.index else tensor
    inner = tensor.to(dtype=dtype or tensor.dtype, copy=True)
    return fake.host_to_device(tensor, inner, fake.index(target), non_blocking)


def _set_data_host(fake: FakeCuda, func, tensor, value):
    return _set_data(tensor, value)


def _no_grad(fake: FakeCuda, func, tensor, *args, **kwargs):
    return tensor if isinstance(tensor, CudaTensor) else func(tensor, *args, **kwargs)


def _python_group(group) -> bool:
    """A group whose collectives are Python code (pipemap's thread ranks), not a C++ backend's (gloo, NCCL)."""
    return type(group).__module__.split(".")[0] != "torch"


def _all_to_all(mode: HostMode, output, input, *args, group=None, **kwargs):  # noqa: A002 (torch's name)
    """torch.distributed's all-to-all on fake GPU tensors. A group of Python ranks runs its own code on them under
    the fake (its copies and streams checked); a C++ backend between worker processes (gloo: the fake has no NCCL)
    is handed the host's view, as gloo stages a GPU tensor through host memory, and the result copied back."""
    if _python_group(group):
        with mode:
            return group.all_to_all_single(output, input, [], []).wait()
    arrived = torch.empty_like(output.inner)
    torch.distributed.all_to_all_single(arrived, _to_host(mode.fake, input), *args, group=group, **kwargs)
    with mode:
        output.copy_(arrived)


def _all_gather(mode: HostMode, outputs, input, group=None, **kwargs):  # noqa: A002 (torch's name)
    """torch.distributed's all-gather into a list, on fake GPU tensors: as ``_all_to_all``."""
    if _python_group(group):
        with mode:
            return group.allgather([outputs], [input]).wait()
    arrived = [torch.empty_like(o.inner) for o in outputs]
    torch.distributed.all_gather(arrived, _to_host(mode.fake, input), group=group, **kwargs)
    with mode:
        for output, part in zip(outputs, arrived):
            output.copy_(part)


def _to_host(fake: FakeCuda, tensor: CudaTensor) -> torch.Tensor:
    """What the host reads of a fake tensor: a blocking copy (it waits for the tensor's stream)."""
    return fake.device_to_host(tensor, tensor.inner, non_blocking=False)


def _where(fake: FakeCuda, func, *args, **kwargs):
    # a Python scalar becomes a CUDA tensor inside where's binding; a 0-dim host tensor is what CUDA accepts
    return func(*[torch.tensor(a) if isinstance(a, (int, float, bool)) else a for a in args], **kwargs)


def _index(fake: FakeCuda, index):
    """An index with its fake tensors made host values where Python wants numbers (slice bounds, 0-dim integers)
    and data where it wants tensors."""
    if isinstance(index, tuple):
        return tuple(_index(fake, i) for i in index)
    if isinstance(index, list):
        return [_index(fake, i) for i in index]
    if isinstance(index, slice):
        return slice(*(_number(fake, v) for v in (index.start, index.stop, index.step)))
    if isinstance(index, CudaTensor):
        return index.inner
    return index


def _number(fake: FakeCuda, value):
    return _to_host(fake, value).item() if isinstance(value, CudaTensor) else value


def _getitem(fake: FakeCuda, tensor: CudaTensor, index):
    # the binding takes a CUDA device guard: index the data instead, a view where Python indexing gives one
    out = tensor.inner[_index(fake, index)]
    device = tensor.device.index
    if out.untyped_storage().data_ptr() == tensor.inner.untyped_storage().data_ptr():
        return CudaTensor(out, device)
    block = fake.allocate(out, device, f"getitem {tuple(out.shape)}")
    reads = [fake.block_of(t.inner) for t in [tensor, *tree_flatten(index)[0]] if isinstance(t, CudaTensor)]
    fake.access(fake.current_stream(device), [b for b in reads if b], [block] if block else [], "getitem")
    return CudaTensor(out, device)


def _setitem(fake: FakeCuda, tensor: CudaTensor, index, value) -> None:
    tensor.inner[_index(fake, index)] = _unwrap(value)
    reads = [fake.block_of(t.inner) for t in [value, *tree_flatten(index)[0]] if isinstance(t, CudaTensor)]
    written = fake.block_of(tensor.inner)
    fake.access(fake.current_stream(tensor.device), [b for b in reads if b], [written] if written else [], "setitem")


def _tensor(fake: FakeCuda, func, data, *args, **kwargs):
    """``torch.tensor(data)`` with fake tensors in ``data``: their values read by the host (as the real binding
    does, element by element), then made where ``device`` says."""
    data = tree_map(lambda x: _to_host(fake, x) if isinstance(x, CudaTensor) else x, data)
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "cuda":
        return _fresh(fake, func(data, *args, **{**kwargs, "device": "cpu"}), fake.index(device), func)
    return func(data, *args, **kwargs)


def _new_tensor(fake: FakeCuda, tensor: CudaTensor, data, dtype=None, device=None, **kwargs):
    inner = torch.tensor(data, dtype=dtype or tensor.dtype)
    device = torch.device(device) if device is not None else tensor.device
    return inner if device.type == "cpu" else _fresh(fake, inner, fake.index(device), torch.tensor)


# functions whose CUDA path allocates outside the dispatcher: run whole on the data, as one kernel
_KERNELS = {torch.nn.functional.scaled_dot_product_attention, torch.quantile, torch.Tensor.quantile}
_HOST = {torch.tensor: _tensor, torch.Tensor.to: _to, torch.Tensor.cuda: _to, _SET_DATA: _set_data_host,
         torch.Tensor.requires_grad_: _no_grad, _SET_GRAD_ATTR: _no_grad, torch.where: _where,
         torch.Tensor.pin_memory: lambda fake, func, t: t}
_COLLECTIVES = {torch.distributed.all_to_all_single: _all_to_all, torch.distributed.all_gather: _all_gather}
_GUARDED = {
    torch.Tensor.copy_: lambda fake, t, src, non_blocking=False: aten.copy_.default(t, src, non_blocking),
    torch.Tensor.item: lambda fake, t: _to_host(fake, t).item(),
    torch.Tensor.tolist: lambda fake, t: _to_host(fake, t).tolist(),
    torch.Tensor.__bool__: lambda fake, t: bool(_to_host(fake, t)),
    torch.Tensor.__float__: lambda fake, t: float(_to_host(fake, t)),
    torch.Tensor.__int__: lambda fake, t: int(_to_host(fake, t)),
    torch.Tensor.__index__: lambda fake, t: _to_host(fake, t).__index__(),
    torch.Tensor.nonzero: lambda fake, t, **kw: aten.nonzero.default(t),
    torch.nonzero: lambda fake, t, **kw: aten.nonzero.default(t),
    torch.Tensor.new_tensor: _new_tensor,
    torch.Tensor.contiguous: lambda fake, t, memory_format=torch.contiguous_format: t if t.is_contiguous(
        memory_format=memory_format) else aten.clone.default(t, memory_format=memory_format),
    torch.Tensor.__getitem__: _getitem,
    torch.Tensor.__setitem__: _setitem,
    torch.Tensor.record_stream: lambda fake, t, stream: (_ for _ in ()).throw(NotImplementedError(
        "record_stream is not modelled by the fake CUDA: pipemap orders reuse with events instead")),
    torch.Tensor.numpy: lambda fake, t, **kw: (_ for _ in ()).throw(TypeError(
        "can't convert cuda:N device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host memory "
        "first (fake CUDA)")),
}


def _fresh(fake: FakeCuda, inner: torch.Tensor, index: int, func) -> CudaTensor:
    block = fake.allocate(inner, index, f"{getattr(func, '__name__', func)} {tuple(inner.shape)}")
    if block is not None and func not in _ALLOCATING:
        fake.access(fake.current_stream(index), [], [block], getattr(func, "__name__", str(func)))
    return CudaTensor(inner, index)


def _target(func, args, kwargs) -> tuple[torch.device | None, torch.dtype | None, bool]:
    if func is torch.Tensor.cuda:
        device = args[1] if len(args) > 1 else kwargs.get("device")
        return torch.device("cuda", FakeCuda.active.index(device)), None, bool(kwargs.get("non_blocking", False))
    kw = {k: v for k, v in kwargs.items() if k not in ("copy", "memory_format")}
    device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kw)
    return device, dtype, non_blocking


def _set_data(tensor: torch.Tensor, value: torch.Tensor) -> None:
    if isinstance(tensor, CudaTensor) != isinstance(value, CudaTensor):
        raise RuntimeError(f"data set to a tensor of another type ({value.device} into {tensor.device}): "
                           "incompatible tensor type (fake CUDA)")
    torch._C.TensorBase.data.__set__(tensor, value)
    if isinstance(tensor, CudaTensor):
        tensor.inner = value.inner


# ---- torch.cuda -------------------------------------------------------------------------------------------------


class _DeviceContext:
    """``torch.cuda.device(d)``: ``d`` current in this thread for the block."""

    def __init__(self, device):
        self.index = None if device is None or device == -1 else FakeCuda.active.index(device)

    def __enter__(self):
        fake = FakeCuda.active
        self.previous = fake.current_device()
        if self.index is not None:
            fake.local.device = self.index
        return self

    def __exit__(self, *exc):
        FakeCuda.active.local.device = self.previous


@contextlib.contextmanager
def _stream_context(stream):
    """``torch.cuda.stream(s)``: ``s`` current on its device, and its device current, for the block."""
    if stream is None:
        yield None
        return
    fake = FakeCuda.active
    previous_device = fake.current_device()
    previous = fake.current_stream(stream.device_index)
    fake.set_stream(stream)
    try:
        yield stream
    finally:
        fake.set_stream(previous)
        fake.local.device = previous_device


class FakeCudart:
    """``torch.cuda.cudart()``: host registration as the driver answers it."""

    def __init__(self, fake: FakeCuda):
        self.fake = fake

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        fake = self.fake
        with fake.lock:
            if size <= 0 or ptr == 0:
                return 1  # cudaErrorInvalidValue
            for start, n in fake.registered.items():
                if start < ptr + size and ptr < start + n:
                    return 712  # cudaErrorHostMemoryAlreadyRegistered
            fake.registered[ptr] = size
            fake.register_log.append(("register", ptr, size))
            return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        fake = self.fake
        with fake.lock:
            if ptr not in fake.registered:
                return 713  # cudaErrorHostMemoryNotRegistered
            for lo, _, sid, count, _, _ in fake.host_reads:
                if lo == ptr and fake.host.get(sid, 0) < count:
                    stream = next((s for s in fake.streams if s.id == sid), None)
                    later = Access("host", -1, 0, "unregister", "cudaHostUnregister",
                                   threading.current_thread().name, tuple(_stack()) if fake.trace else ())
                    earlier = Access(stream.name if stream else str(sid), sid, count, "read", "async copy from pinned "
                                     "memory", "?")
                    fake.races.append(Race(f"host buffer {ptr:#x}", earlier, later))
                    break
            fake.register_log.append(("unregister", ptr, fake.registered.pop(ptr)))
            return 0

    def cudaGetErrorString(self, code: int) -> str:
        return {712: "cudaErrorHostMemoryAlreadyRegistered", 713: "cudaErrorHostMemoryNotRegistered",
                1: "cudaErrorInvalidValue"}.get(int(code), f"error {code}")


def _writes_in_place(func) -> bool:
    name = getattr(func, "__name__", "")
    return func is torch.Tensor.__setitem__ or (name.endswith("_") and not name.startswith("_"))


def _check_error(res) -> None:
    if int(res) != 0:
        raise RuntimeError(f"CUDA error: {FakeCuda.active.cudart.cudaGetErrorString(int(res))} ({int(res)}) "
                           "(fake CUDA)")


def _properties(fake: FakeCuda, device=None):
    return types.SimpleNamespace(name="Fake GPU", total_memory=fake.memory, major=9, minor=0,
                                 multi_processor_count=132, uuid=f"GPU-fake-{fake.index(device)}", pci_domain_id=0,
                                 pci_bus_id=fake.index(device) + 1, pci_device_id=0)


class Patches:
    """``monkeypatch``'s ``setattr`` for scripts: ``undo()`` puts every attribute back."""

    def __init__(self):
        self.saved: list[tuple[object, str, object]] = []

    def setattr(self, target, name: str, value, raising: bool = True) -> None:
        self.saved.append((target, name, getattr(target, name) if raising else getattr(target, name, _ABSENT)))
        setattr(target, name, value)

    def setenv(self, name: str, value: str) -> None:
        self.saved.append((os.environ, name, os.environ.get(name, _ABSENT)))
        os.environ[name] = value

    def undo(self) -> None:
        for target, name, value in reversed(self.saved):
            if target is os.environ:
                os.environ.pop(name, None) if value is _ABSENT else os.environ.__setitem__(name, value)
            elif value is _ABSENT:
                delattr(target, name)
            else:
                setattr(target, name, value)
        self.saved.clear()


_ABSENT = object()


# a worker process pipemap starts from a process with the fake installs it too, with as many GPUs (``in_worker``),
# and writes the races its own fake found to a file of the folder RACES_ENV names when it exits
SETUP = f"{__name__}:in_worker"
GPUS_ENV = "PIPEMAP_FAKE_CUDA_GPUS"
RACES_ENV = "PIPEMAP_FAKE_CUDA_RACES"


def install(monkeypatch=None, gpus: int = 2, worker: bool = False) -> FakeCuda:
    """Install a fake CUDA with ``gpus`` devices: for one test (``monkeypatch`` undoes every patch), or for a script
    (``fake.exit()`` undoes them). Worker processes pipemap starts meanwhile install one of their own
    (``PIPEMAP_WORKER_SETUP``, read by ``pipemap.hooks.worker.set_up``), with ``gpus`` devices; the races they found
    by the time they stopped count as this fake's (``worker_races``)."""
    patches = Patches() if monkeypatch is None else None
    monkeypatch = monkeypatch or patches
    folder = None
    if not worker:
        folder = tempfile.mkdtemp(prefix="fakecuda-workers-")
        atexit.register(shutil.rmtree, folder, True)
        monkeypatch.setenv(SETUP_ENV, SETUP)
        monkeypatch.setenv(GPUS_ENV, str(gpus))
        monkeypatch.setenv(RACES_ENV, folder)
    fake = FakeCuda(gpus)
    fake.workers_folder = folder
    fake.cudart = FakeCudart(fake)
    FakeCuda.active = fake
    cuda = torch.cuda
    replacements = {
        "is_available": lambda: True, "is_initialized": lambda: True, "init": lambda: None,
        "device_count": lambda: fake.gpus, "current_device": fake.current_device,
        "set_device": lambda device: setattr(fake.local, "device", fake.index(device)), "device": _DeviceContext,
        "Stream": FakeStream, "Event": FakeEvent, "current_stream": fake.current_stream,
        "default_stream": fake.default_stream, "set_stream": fake.set_stream, "stream": _stream_context,
        "synchronize": fake.synchronize, "cudart": lambda: fake.cudart, "check_error": _check_error,
        "get_device_properties": lambda device=None: _properties(fake, device),
        "get_device_name": lambda device=None: _properties(fake, device).name,
        "get_device_capability": lambda device=None: (9, 0),
        "can_device_access_peer": lambda device, peer_device: True,
        "mem_get_info": lambda device=None: (min(fake.limit.get(fake.index(device), fake.memory), fake.memory)
                                             - fake.reserved.get(fake.index(device), 0), fake.memory),
        "set_per_process_memory_fraction": lambda fraction, device=None: fake.limit.__setitem__(
            fake.index(device), int(fraction * fake.memory)),
        "max_memory_reserved": lambda device=None: fake.peak_reserved.get(fake.index(device), 0),
        "memory_allocated": lambda device=None: fake.allocated.get(fake.index(device), 0),
        "max_memory_allocated": lambda device=None: fake.peak.get(fake.index(device), 0),
        "memory_reserved": lambda device=None: fake.reserved.get(fake.index(device), 0),
        "reset_peak_memory_stats": lambda device=None: (fake.peak.__setitem__(
            fake.index(device), fake.allocated.get(fake.index(device), 0)), fake.peak_reserved.__setitem__(
            fake.index(device), fake.reserved.get(fake.index(device), 0))),
        "empty_cache": fake.empty_cache,
    }
    for name, value in replacements.items():
        monkeypatch.setattr(cuda, name, value)
    compatible = torch._has_compatible_shallow_copy_type  # Module._apply asks it before `param.data = moved`

    def shallow_copy_compatible(input: torch.Tensor, from_: torch.Tensor) -> bool:  # the signature dynamo checks
        return isinstance(input, CudaTensor) == isinstance(from_, CudaTensor) and compatible(input, from_)

    monkeypatch.setattr(torch, "_has_compatible_shallow_copy_type", shallow_copy_compatible)
    monkeypatch.setattr(torch._C, "_host_emptyCache", fake.host_empty_cache, raising=False)
    mode = HostMode(fake)
    original_run = threading.Thread.run

    def run(thread):  # every thread the test starts sees the fake as the main thread does
        with HostMode(fake):
            original_run(thread)

    monkeypatch.setattr(threading.Thread, "run", run)
    mode.__enter__()

    def leave() -> None:
        mode.__exit__(None, None, None)
        if patches is not None:
            patches.undo()

    fake.exit = leave
    return fake


def in_worker() -> None:
    """The fake in a worker process of a process that has it (``PIPEMAP_WORKER_SETUP``), for the worker's life: its
    device, streams and allocator are the fake's, so its CUDA branches run. Its races are its own (not the test's
    fixture's to check)."""
    fake = install(None, gpus=int(os.environ.get(GPUS_ENV, "2")), worker=True)
    folder = os.environ.get(RACES_ENV)
    if folder:  # run as the worker ends (multiprocessing's exit functions), after rank 0 told it to stop
        multiprocessing.util.Finalize(fake, _write_races, (fake, folder), exitpriority=10)


def _write_races(fake: FakeCuda, folder: str) -> None:
    if fake.races:
        with open(os.path.join(folder, f"{os.getpid()}.txt"), "w") as out:
            out.write(fake.report())


# ---- helpers for tests -------------------------------------------------------------------------------------------


def on_device(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, CudaTensor)


def host(tensor: torch.Tensor) -> torch.Tensor:
    """A fake GPU tensor's data as a CPU tensor, without the fake's copy bookkeeping (for comparing values)."""
    return tensor.inner if isinstance(tensor, CudaTensor) else tensor
