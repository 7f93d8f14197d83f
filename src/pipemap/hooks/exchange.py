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

    def swap(self, rank: int, value) -> list:
        """Every rank's ``value``, in rank order, once all ranks have given theirs."""
        self.slots[rank] = value
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before every rank has read it
        return values

    def abort(self) -> None:
        self.barrier.abort()

    def renew(self) -> None:
        self.slots = [None] * self.ranks
        self.barrier = threading.Barrier(self.ranks)
        self.devices = {}

    def push(self, rank: int, device: torch.device, parts: list) -> list:
        """Every rank's part for ``rank``, in rank order: each rank copies its parts to the others' devices itself
        (``parts[r]`` for rank ``r``) before they meet. A copy between GPUs runs on the source GPU's current stream,
        so the source pushing keeps each GPU's copies on its own stream at its own point (a rank pulling would queue
        them on the other rank's stream, behind whatever that rank enqueued since: the GPUs take turns); and
        ``move_tensor`` stages a pair the copy check found corrupting through host memory."""
        devices = self.devices.get(device.type)
        if devices is None:  # every rank misses together: the map is set only after a meeting all of them attend
            devices = self.devices[device.type] = self.swap(rank, device)
        moved = [[move_tensor(t, devices[r]) for t in part] for r, part in enumerate(parts)]
        return [mine[rank] for mine in self.swap(rank, moved)]


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
        parts = input.split(list(input_split_sizes))
        arrived = self.exchange.push(self._rank, output.device, [[p] for p in parts])
        output.copy_(torch.cat([part for part, in arrived]))
        return _done([output])

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
