"""The process groups a split's ranks exchange through (``workers.py``, ``worker.py``): each a group of its own over
rank 0's store (no default group: the user's ``torch.distributed`` stays untouched), NCCL between GPUs and gloo on
the CPU or through host memory, listening on loopback for ranks of one machine, made at once and checked
(``joined``), with the tensors of a call sent and received point to point (``send``/``receive_tensors``).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import math
import os
import socket
from typing import Any, cast

import torch
import torch.distributed as dist

from ..errors import RanksSelfTestError
from ..runtime import transfer
from .payload import Meta

# ---- the process group -------------------------------------------------------------------------------------------


_C10D: Any = torch._C._distributed_c10d  # the registry of groups by name, which torch's functional collectives read
GROUP_NAMES = itertools.count()


def _group(store: dist.Store, rank: int, size: int, device: torch.device, seconds: float, name: str,
           gloo: bool = False, host: str = "127.0.0.1") -> Any:
    """A process group of its own (no default group: the user's torch.distributed stays untouched): NCCL on CUDA,
    gloo elsewhere or where ``gloo`` (ranks sharing a GPU, ``shared_gpu``: gloo then serves CUDA tensors through
    host memory, and the CPU tensors point-to-point traffic stages there), registered under ``name`` so that torch's
    functional collectives (a sequence split's Ulysses attention) find it; ``forget`` unregisters it. gloo's pairs
    listen on ``host`` (loopback for workers of this machine, WP6), not on whatever the host name resolves to."""
    timeout = datetime.timedelta(seconds=seconds)
    prefix = dist.PrefixStore("pipemap", store)
    types = [torch.device(device.type)]
    if device.type == "cuda" and not gloo:
        # a watchdog timeout aborts the communicator (CleanUpOnly) instead of tearing the caller's process down,
        # which is NCCL's default (3): WP1. Read when the group is made; the user's own setting is kept
        os.environ.setdefault(NCCL_ERRORS_ENV, "2")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        backend: Any = dist.ProcessGroupNCCL(prefix, rank, size, options)
        kind = dist.ProcessGroup.BackendType.NCCL
    else:
        gloo_options = cast(Any, dist.ProcessGroupGloo)._Options()
        gloo_options._timeout = timeout
        gloo_options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        backend = dist.ProcessGroupGloo(prefix, rank, size, gloo_options)
        kind = dist.ProcessGroup.BackendType.GLOO
        types = list(dict.fromkeys([*types, torch.device("cpu")]))
    group = dist.ProcessGroup(prefix, rank, size)
    group._set_default_backend(kind)
    for kind_of_device in types:
        group._register_backend(kind_of_device, kind, backend)
    group._set_group_name(cast(Any, name))  # torch types it GroupName: a str
    _C10D._register_process_group(name, group)
    return group


NCCL_ERRORS_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def shared_gpu(devices: tuple[torch.device, ...]) -> bool:
    """Whether two of the ranks on ``devices`` sit on one GPU (a plan for two GPUs remapped onto one, as the GPU
    check's one-GPU control does): NCCL takes one rank per GPU ("Duplicate GPU detected"), so such a group runs on
    gloo, through host memory."""
    gpus = [(d.index or 0) for d in devices if d.type == "cuda"]
    return len(set(gpus)) < len(gpus)


def wire(device: torch.device, gloo: bool) -> torch.device:
    """Where a rank's tensors sit while they travel point to point: the host where gloo carries a GPU's."""
    return torch.device("cpu") if gloo else device


P2P_ENV = "NCCL_P2P_DISABLE"


def staged_ranks(devices: tuple[torch.device, ...]) -> bool:
    """Whether the ranks on ``devices`` (rank 0's first) must exchange through host memory: the copy check
    (``runtime.transfer``) staged a pair of them, either way. NCCL then runs with peer-to-peer off for the group
    (``NCCL_P2P_DISABLE``, set in every rank while its communicator starts); gloo's tensors go through the host
    anyway, so on the CPU the verdict only shows in what the workers report (``Workers.staged``)."""
    names = [transfer.endpoint(d) for d in devices]
    pairs = transfer.staged_pairs()
    return any((a, b) in pairs for i, a in enumerate(names) for j, b in enumerate(names) if i != j)


_NCCL_MADE: list[bool] = []  # rank 0: a communicator of pipemap's was made in this process (NCCL's P2P then fixed)


def nccl_transport(staged: bool, cuda: bool) -> str:
    """How a group of GPU ranks exchanges, decided for this process (WP5): NCCL reads ``NCCL_P2P_DISABLE`` once
    per process, at its first communicator, so setting it around one group's creation holds only where that group
    is the process's first. ``"direct"``: NCCL with peer-to-peer as the process has it; ``"p2p_off"``: NCCL with
    peer-to-peer off, set now for the whole process (its later groups run through host memory too: slower, never
    wrong); ``"gloo"``: a staged pair in a process whose NCCL already runs with peer-to-peer on, so the group goes
    over gloo through host memory instead. Workers get the setting in their own environment before their first
    communicator (``serve``). Where this torch has no NCCL (a CPU build, under the tests' fake CUDA): ``"gloo"``."""
    if cuda and not dist.is_nccl_available():
        return "gloo"
    if not (staged and cuda):
        return "direct"
    if os.environ.get(P2P_ENV) == "1":
        return "p2p_off"
    user_nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    if _NCCL_MADE or user_nccl:
        return "gloo"
    os.environ[P2P_ENV] = "1"
    return "p2p_off"


def joined(store: dist.Store, rank: int, size: int, device: torch.device, seconds: float, name: str,
            gloo: bool = False, host: str = "127.0.0.1") -> Any:
    """``_group``, made at once and checked: every rank all-reduces a known tensor (each rank's ``rank + 1``), the
    sum compared with what it must be, within the bound ``seconds``. So a communicator is never made lazily inside
    a call with no bound (WP10), and a group whose transport corrupts (a broken peer link) or whose rank cannot
    join fails here, at bring-up, where ``ranks="auto"`` falls back to threads."""
    group = _group(store, rank, size, device, seconds, name, gloo, host)
    if device.type == "cuda" and not gloo:
        _NCCL_MADE.append(True)
    probe = torch.full((4,), float(rank + 1), device=wire(device, gloo))
    group.allreduce([probe]).wait(datetime.timedelta(seconds=seconds))
    expected = size * (size + 1) / 2
    if not bool((probe == expected).all()):
        forget(group)
        raise RanksSelfTestError(name, [str(device)], f"an all-reduce of known values gave {probe.tolist()}, not "
                                 f"{expected}")
    return group


def subgroup(store: dist.Store, members: tuple[int, ...], rank: int, device: torch.device, seconds: float,
             name: str, gloo: bool, host: str = "127.0.0.1") -> Any:
    """The group of the ranks ``members`` (``rank``: one of them, in the whole group's numbering) over the whole
    group's store: only those ranks take part in making it. Its own collectives (a branch's sequence split) never
    wait for the other ranks'."""
    store = dist.PrefixStore(name, store)
    return joined(store, members.index(rank), len(members), device, seconds, name, gloo, host)


def forget(group: Any) -> None:
    with contextlib.suppress(Exception):
        _C10D._unregister_process_group(group.group_name)


BATCH_BYTES = 4 << 20  # consecutive tensors of one dtype go as one message up to this many bytes together


def messages(metas: list[tuple[tuple[int, ...], torch.dtype]]) -> list[list[int]]:
    """Which of a call's tensors (by shape and dtype, in order) travel together: consecutive tensors of one dtype,
    up to ``BATCH_BYTES`` in all, share one message; a larger one goes alone, an empty one not at all. Each message
    is a point-to-point send, which costs the host as much for 8 bytes as for 8 KiB (gloo: a round of its socket
    threads, ~0.1-0.2 ms on 2 cores; NCCL: a launch): a step's latents and timestep go as one. Sender and receiver
    both compute it, from the tensors and from their ``Meta``s."""
    found: list[list[int]] = []
    size = 0
    for i, (shape, dtype) in enumerate(metas):
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            continue
        last = found[-1] if found else None
        if last is not None and metas[last[-1]][1] == dtype and size + nbytes <= BATCH_BYTES:
            last.append(i)
            size += nbytes
        else:
            found.append([i])
            size = nbytes
    return found


def send_tensors(group: Any, tensors: list[torch.Tensor], peer: int, device: torch.device) -> list:
    """Start sending ``tensors`` to ``peer`` (moved to this rank's ``device`` first), batched by ``messages``; the
    works to wait on, each with what it sends (kept until sent)."""
    works = []
    for tag, batch in enumerate(messages([(tuple(t.shape), t.dtype) for t in tensors])):
        parts = [tensors[i].to(device) for i in batch]
        sent = parts[0].contiguous() if len(parts) == 1 else torch.cat([p.reshape(-1) for p in parts])
        works.append((group.send([sent], peer, tag), sent))
    return works


def receive_tensors(group: Any, wanted: list[Meta], peer: int, device: torch.device,
                    through: torch.device | None = None) -> list[torch.Tensor]:
    """The tensors ``wanted`` from ``peer``, received on ``through`` (``wire``: the host where gloo carries a GPU's)
    and on ``device`` when returned; batched as ``send_tensors`` sends them."""
    where = through or device
    tensors = [torch.empty(m.shape, dtype=m.dtype, device=where) for m in wanted]
    received = []
    for tag, batch in enumerate(messages([(tuple(m.shape), m.dtype) for m in wanted])):
        buffer = tensors[batch[0]] if len(batch) == 1 else torch.empty(
            sum(tensors[i].numel() for i in batch), dtype=wanted[batch[0]].dtype, device=where)
        received.append((group.recv([buffer], peer, tag), batch, buffer))
    for work, batch, buffer in received:
        work.wait()
        if len(batch) > 1:
            for i, part in zip(batch, buffer.split([tensors[i].numel() for i in batch])):
                tensors[i] = part.view(tensors[i].shape)
    return [t.to(device) for t in tensors]


def listener(host: str) -> socket.socket:
    """A socket listening on ``host`` (loopback for workers of this machine), for rank 0's store: bound here and
    handed to the store as it is (WP6, WP13: ``TCPStore`` given a host name still listens on every interface, and a
    port probed then closed may be taken before the store binds it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen(128)
    return listener


