"""A process group whose ranks are threads of this process, one per GPU: what a sequence-split call
(``sequence.py``) exchanges keys and values through.

diffusers' context parallelism runs its attention (Ulysses: an all-to-all of queries, keys and values before the
attention, of the outputs after it) through torch's functional collectives on a ``torch.distributed`` process
group. torch offers such groups only across processes (gloo, NCCL: one rank per process, with a launcher), while
pipemap drives every GPU from the one process that holds the pipeline and its hooks, and the dry run runs the same
call on stand-in devices. So the ranks here are threads, and the two collectives Ulysses needs are copies between
their tensors: each rank copies its parts to the other ranks' devices itself (through ``transfer.move_tensor``, so
a pair the copy check found corrupting is staged through host memory), puts them in a shared slot, all meet, each
takes what was pushed to it, all meet again before the slots are reused.

The group is a ``torch.distributed.ProcessGroup`` registered by name, so torch's functional collectives (and their
fake-tensor rules, which the dry run relies on: under ``FakeTensorMode`` a collective only shapes its output, so
stand-in ranks may run one after the other) find it without a default process group.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from ..runtime.transfer import move_tensor

_NAMES = itertools.count()
_C10D: Any = torch._C._distributed_c10d  # the registry of groups by name, which torch's functional collectives read


class Exchange:
    """Where the ranks of one group meet: a slot per rank and a barrier. ``abort`` releases every rank waiting (they
    raise ``threading.BrokenBarrierError``) when one of them failed; ``renew`` readies it for the next call."""

    def __init__(self, ranks: int):
        self.ranks = ranks
        self.slots: list[object] = [None] * ranks
        self.barrier = threading.Barrier(ranks)
        self.devices: dict[str, list[torch.device]] = {}  # each rank's device, by device type: where to push parts
        self.streams: dict[tuple[str, str], Any] = {}  # the copies' streams, by (their GPU, the GPU sending)
        self.held: dict[int, list] = {}  # each rank's parts of its last push, alive until its next push has fenced

    def swap(self, rank: int, value, between: Callable[[], None] | None = None) -> list:
        """Every rank's ``value``, in rank order, once all ranks have given theirs (``between`` runs while all are
        still met)."""
        self.slots[rank] = value
        self.barrier.wait()
        values = list(self.slots)
        if between is not None:
            between()
        self.barrier.wait()  # nobody overwrites a slot before every rank has read it
        return values

    def abort(self) -> None:
        self.barrier.abort()

    def renew(self) -> None:
        self.slots = [None] * self.ranks
        self.barrier = threading.Barrier(self.ranks)
        self.devices = {}  # ``held`` kept: the parts of a call's last exchange stay fenced by the next call's first

    def push(self, rank: int, device: torch.device, parts: list) -> list:
        """Every rank's part for ``rank``, in rank order: each rank copies its parts to the others' devices itself
        (``parts[r]`` for rank ``r``) before they meet, through ``move_tensor`` (a pair the copy check found
        corrupting is staged through host memory).

        On CUDA a copy between GPUs runs on the source's current stream and fences the destination's current stream
        behind it; on the compute streams that would queue one rank's kernels behind the other's (the GPUs take
        turns). So, as NCCL does, the copies run on streams of the exchange's own (one out of each GPU, one inbox
        per pair), ordered with the compute streams by events only where the data needs it."""
        devices = self.devices.get(device.type)
        if devices is None:  # every rank misses together: the map is set only after a meeting all of them attend
            devices = self.devices[device.type] = self.swap(rank, device)
        if device.type != "cuda":
            moved = [[move_tensor(t, devices[r]) for t in part] for r, part in enumerate(parts)]
            return [mine[rank] for mine in self.swap(rank, moved)]
        compute, out = torch.cuda.current_stream(device), self._stream(device, device)
        inboxes = [self._stream(device, d) for d in devices if d != device]
        for inbox in inboxes:  # what was pushed here before is read; its memory may be reused by the next push
            inbox.wait_stream(compute)
        out.wait_stream(compute)  # the parts are computed
        moved = [part if devices[r] == device else self._moved(part, out, self._stream(devices[r], device))
                 for r, part in enumerate(parts)]

        def received():
            for inbox in inboxes:  # every push into this GPU is queued by now, and no later one yet
                compute.wait_stream(inbox)
            compute.wait_stream(out)  # the parts are not overwritten before they left

        arrived = [mine[rank] for mine in self.swap(rank, moved, received)]
        # the parts that arrived are read on this rank's compute stream after this returns; freed then, their memory
        # (the inbox stream's) could go to a peer's next copy into this GPU before this rank's next push has fenced
        # its inboxes behind that read (the peer may copy first): a write after the read, unordered. Held until the
        # next push, after its fence, they cannot be reused sooner (found by the fake CUDA's race check)
        self.held[rank] = arrived
        return arrived

    def _stream(self, device: torch.device, source: torch.device):
        return self.streams.setdefault((str(device), str(source)), torch.cuda.Stream(device))

    @staticmethod
    def _moved(part: list, out, inbox) -> list:
        with torch.cuda.stream(out), torch.cuda.stream(inbox):
            return [move_tensor(t, inbox.device) for t in part]


class ThreadGroup(dist.ProcessGroup):
    """Rank ``rank`` of a group of threads meeting at ``exchange``: the collectives diffusers' Ulysses attention and
    pipemap's gather use (all-to-all, all-gather), done by copies."""

    def __init__(self, rank: int, exchange: Exchange, name: str):
        super().__init__(rank, exchange.ranks)  # type: ignore[call-arg]  # torch's stub names only the store form
        self.exchange = exchange
        self._rank, self._name = rank, name

    def size(self) -> int:
        return self.exchange.ranks

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "pipemap-threads"

    @property
    def group_name(self) -> Any:  # torch's GroupName: a str
        return self._name

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):  # noqa: A002
        sizes = list(input_split_sizes) or [input.shape[0] // self.size()] * self.size()  # none given: even parts
        parts = input.split(sizes)
        arrived = self.exchange.push(self._rank, output.device, [[p] for p in parts])
        output.copy_(torch.cat([part for part, in arrived]))
        return _done([output])

    # torch 2.11 and older look a Python group's all-to-all up under its old name only (torch's PyProcessGroup
    # trampoline), then fall back to a backend this group has none of ("No backend type associated with device type
    # cuda", found on the H200): both names, as torch 2.13 looks up the new one first
    alltoall_base = all_to_all_single

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        arrived = self.exchange.push(self._rank, outputs[0].device, [list(inputs)] * self.size())
        for i, output in enumerate(outputs):
            output.copy_(torch.cat([part[i] for part in arrived]))
        return _done(outputs)

    def allgather(self, output_lists, inputs, opts=None):  # torch.distributed.all_gather (an attention mask)
        arrived = self.exchange.push(self._rank, inputs[0].device, [list(inputs)] * self.size())
        for i, outputs in enumerate(output_lists):
            for output, part in zip(outputs, arrived):
                output.copy_(part[i])
        return _done([t for outputs in output_lists for t in outputs])

    def __repr__(self) -> str:
        return f"ThreadGroup({self._name!r}, rank {self._rank} of {self.exchange.ranks})"


def _done(result) -> dist.Work:
    future: Future = Future()
    future.set_result(result)
    return _C10D._create_work_from_future(future)


def thread_groups(ranks: int, label: str) -> list[ThreadGroup]:
    """One group of ``ranks`` threads, as one ``ThreadGroup`` per rank, each registered under a name of its own
    (``release`` unregisters them)."""
    exchange = Exchange(ranks)
    stem = f"pipemap-{label}-{next(_NAMES)}"
    groups = [ThreadGroup(rank, exchange, f"{stem}-{rank}") for rank in range(ranks)]
    for group in groups:
        _C10D._register_process_group(group.group_name, group)
    return groups


def release(groups: list[ThreadGroup]) -> None:
    for group in groups:
        _C10D._unregister_process_group(group.group_name)
