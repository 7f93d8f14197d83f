"""A process group whose ranks are threads of this process, one per GPU: what a sequence-split call
(``sequence.py``) exchanges keys and values through.

diffusers' context parallelism runs its attention (Ulysses: an all-to-all of queries, keys and values before the
attention, of the outputs after it) through torch's functional collectives on a ``torch.distributed`` process
group. torch offers such groups only across processes (gloo, NCCL: one rank per process, with a launcher), while
pipemap drives every GPU from the one process that holds the pipeline and its hooks, and the dry run runs the same
call on stand-in devices. So the ranks here are threads, and the two collectives Ulysses needs are copies between
their tensors: each rank puts its input in a shared slot, all meet, each takes its part (a ``copy_`` across devices,
which orders itself after both devices' current streams), all meet again before the slots are reused.

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

_NAMES = itertools.count()
_C10D: Any = torch._C._distributed_c10d  # the registry of groups by name, which torch's functional collectives read


class Exchange:
    """Where the ranks of one group meet: a slot per rank and a barrier. ``abort`` releases every rank waiting (they
    raise ``threading.BrokenBarrierError``) when one of them failed; ``renew`` readies it for the next call."""

    def __init__(self, ranks: int):
        self.ranks = ranks
        self.slots: list[object] = [None] * ranks
        self.barrier = threading.Barrier(ranks)

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
        parts = self.exchange.swap(self._rank, input.split(list(input_split_sizes)))
        output.copy_(torch.cat([p[self._rank].to(output.device) for p in parts]))
        return _done([output])

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        parts = self.exchange.swap(self._rank, inputs)
        for i, output in enumerate(outputs):
            output.copy_(torch.cat([p[i].to(output.device) for p in parts]))
        return _done(outputs)

    def allgather(self, output_lists, inputs, opts=None):  # torch.distributed.all_gather (an attention mask)
        parts = self.exchange.swap(self._rank, inputs)
        for i, outputs in enumerate(output_lists):
            for output, part in zip(outputs, parts):
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
