"""A process per device for a split denoiser: the caller's process is rank 0 and keeps the pipeline (its ``__call__``
unchanged, no launcher); each other device a split denoiser uses gets a worker process of its own (started with
``spawn``), rank 1, 2, ... of a ``torch.distributed`` process group with rank 0 (NCCL between GPUs, gloo on the
CPU), which holds its own copy of the component and runs the calls rank 0 sends it.

Why processes: the ranks as threads of the caller's process (``replica.py``, ``copies.py``) share its GIL and each
other's CUDA streams (issue 34). Here each rank launches its own kernels on its own streams, and the only traffic is
the call's inputs going out and its outputs coming back.

What travels, and how:

- a small header through a pipe per worker (``multiprocessing.Pipe``): what to do and the call's structure,
  pickled with every tensor left out (``_Pickler``: a tensor is pickled as its place in the list of tensors sent);
- the tensors through the process group, point to point (``send``/``recv``), each rank on its own device;
- the worker's copy of the component: first loaded by the worker from the pipeline folder's safetensors files
  (``from_pretrained`` of the component's class, where the component came from a folder), then brought in line with
  rank 0's model (``Workers.sync``): the module's structure pickled without its tensors, each tensor named by where
  it sits, and a tensor sent only where the worker's own differs (an exact digest of its bytes, ``digest``). So a
  pipeline built in code gets every tensor sent once, one loaded from a folder none, and a LoRA loaded after
  placing only the tensors it changed, plus its layers' structure. No weight is ever pickled.

Waits are bounded: rank 0 polls each pipe with the worker's liveness checked (``_receive``) and a deadline
(``PIPEMAP_WORKER_TIMEOUT``, seconds, default 120); the group's own timeout is the same. A worker that dies raises
``WorkerDiedError`` (the workers of that component are stopped; the next call starts new ones); an exception in a
worker's call raises ``WorkerCallError`` with its traceback. Workers stop when the component is reset
(``stop_workers``, called by ``dispatch.reset``), when the component is garbage-collected, at the interpreter's exit
(``atexit``), and by themselves when rank 0's process dies (the pipe closes; a watchdog compares the parent's pid).

Opt-in for now: with ``PIPEMAP_WORKERS=process``, ``hooks.HOOKS`` gives the replicated mode, guidance branches,
the sequence split and both at once their worker variants (``replica_workers.py``, ``guidance_workers.py``,
``sequence_workers.py``, ``guidance_sequence_workers.py``: each half of its ranks a subgroup, ``Workers.split``);
the default stays the threads until the workers have run over NCCL on two GPUs. ``PIPEMAP_WORKERS=ray`` is the same
with each worker a Ray actor (``ray_workers.py``): only the start differs (``launcher``: a ``_Spawn``, or a
``ray_workers.RayLauncher``; each gives a handle to watch and stop the worker, and its connection).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import hashlib
import importlib.util
import io
import itertools
import multiprocessing
import multiprocessing.connection
import multiprocessing.spawn
import os
import pickle
import socket
import sys
import threading
import time
import traceback
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist

from ..errors import (
    CannotTravelError,
    RanksFallbackWarning,
    RanksSelfTestError,
    WorkerCallError,
    WorkerDiedError,
    WorkersOptionError,
)
from ..modes import RANKS, resolve_ranks
from ..runtime import transfer
from .replica import replica

ENV = "PIPEMAP_WORKERS"
TIMEOUT_ENV = "PIPEMAP_WORKER_TIMEOUT"
MODES = RANKS  # "ray": the worker processes as Ray actors (``ray_workers.py``)
_POLL_S = 0.05  # how often a wait on a pipe looks at the worker's liveness


def workers_mode() -> str:
    """What runs a split denoiser's other ranks where a plan does not say (``ranks="auto"``): ``PIPEMAP_WORKERS``
    where set (``"thread"``, ``"process"``, ``"ray"``), else ``"process"`` (a process per rank, which pipemap
    starts)."""
    mode = resolve_ranks(None)[0]
    if mode == "ray" and importlib.util.find_spec("ray") is None:
        raise WorkersOptionError(ENV, mode, ("thread", "process"), "needs Ray, which is not installed (pip install "
                                 "-e '.[ray]' in pipemap's checkout)")
    return mode


def timeout_s() -> float:
    """The longest any wait on a worker lasts (``PIPEMAP_WORKER_TIMEOUT``, seconds)."""
    text = os.environ.get(TIMEOUT_ENV, "120")
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise WorkersOptionError(TIMEOUT_ENV, text, ("a number of seconds above 0, e.g. 120",))
    return value


def on_standins(placement) -> bool:
    """Whether a placement is on the dry run's stand-in devices, where the ranks stay threads (its checking modes are
    thread-local, and a stand-in holds no real weights to load)."""
    return any(torch.device(d).type == "meta" for d in (placement.device, *placement.replicas))


_HOOK_STORES = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_forward_pre_hooks_with_kwargs",
                "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def plain_copy(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` without pipemap's, accelerate's or a user's hooks, sharing its tensors: what a worker's copy is
    made from (the hooks of this process stay here)."""
    home = next(itertools.chain(module.parameters(), module.buffers())).device
    plain = replica(module, home)
    for sub in plain.modules():
        for store in _HOOK_STORES:
            if store in sub.__dict__:
                sub.__dict__[store] = type(sub.__dict__[store])()
        sub.__dict__.pop("_pipemap_seen", None)
    return plain


def travel_problem(plain: torch.nn.Module) -> str | None:
    """Why ``plain`` (``plain_copy``: a component without hooks) cannot go to a worker process, or None: its
    structure is pickled here with its tensors left out, as ``Workers.sync`` sends it, before any worker starts
    (WP4). What cannot travel: an object pickle cannot take (a diffusers hook's closure, from
    ``enable_layerwise_casting`` or ``enable_cache``: diffusers' hooks wrap the forward in a local function), or a
    class defined in the caller's ``__main__`` (a script's or notebook's attention processor), which a worker, spawned
    without the caller's script, cannot import."""
    pickler = _Pickler(io.BytesIO())
    failed = None
    try:
        pickler.dump(plain)
    except Exception as err:  # pickle's own words name the object
        failed = f"{type(err).__name__}: {err}"
    found = sorted(pickler.from_main)  # met before pickle failed on one (a class the caller's __main__ lacks now)
    if failed and not found:
        return failed
    if found:
        return (f"{', '.join(found)} {'is' if len(found) == 1 else 'are'} defined in the script's __main__, which "
                "a worker process does not run: move it into a module the worker can import")
    return None


# ---- what a worker loads first ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """Where a worker loads its first copy from: the component's class and the folder of its safetensors files
    (None: the component came from no folder; every tensor is then sent)."""

    module: str
    name: str
    folder: str | None
    dtype: torch.dtype
    bytes: int = 0  # the copy's parameters and buffers: what its load reads (``load_bound``)

    @classmethod
    def of(cls, module: torch.nn.Module) -> Source:
        kind = type(module)
        folder = _folder(module)
        dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
        size = sum(t.numel() * t.element_size() for t in _named_tensors(module).values())
        return cls(kind.__module__, kind.__qualname__, folder, dtype, size)

    def load(self, device: torch.device) -> torch.nn.Module | None:
        if self.folder is None:
            return None
        kind = _import(self.module, self.name)
        options: dict[str, Any] = {"torch_dtype": self.dtype}
        if device.type == "cuda":
            options["device_map"] = str(device)
        module = kind.from_pretrained(self.folder, **options)
        return module.to(device).eval().requires_grad_(False)


def _folder(module: torch.nn.Module) -> str | None:
    """The folder ``from_pretrained`` read ``module`` from (its config's ``_name_or_path``), if it is still one."""
    config = getattr(module, "config", None)
    path = config.get("_name_or_path") if isinstance(config, dict) else None
    if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(os.path.join(path, "config.json")):
        return None
    path = os.fspath(path)
    if not hasattr(type(module), "from_pretrained"):
        return None
    return path


def _import(module: str, name: str) -> Any:
    value: Any = __import__(module, fromlist=[name.split(".")[0]])
    for part in name.split("."):
        value = getattr(value, part)
    return value


# ---- the digest of a tensor's bytes -------------------------------------------------------------------------------

_CHUNK = 1 << 24


def digest(tensor: torch.Tensor) -> str:
    """A hash of the tensor's bytes (BLAKE2b, 128 bits), alike on every device, so a worker and rank 0 compare their
    copies without moving them between processes. A real hash (WP12): two sums, as it was, kept a swap of two
    elements 65521 apart. A GPU tensor is hashed in 16 MiB pieces read back to the host."""
    flat = tensor.detach().contiguous().reshape(-1)
    hashed = hashlib.blake2b(digest_size=16)
    data = flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
    for start in range(0, data.numel(), _CHUNK):
        hashed.update(data[start:start + _CHUNK].cpu().numpy().data)
    return hashed.hexdigest()


def _named_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` by its dotted name (a shared tensor under its first name)."""
    found: dict[str, torch.Tensor] = {}
    for name, tensor in itertools.chain(module.named_parameters(remove_duplicate=False),
                                        module.named_buffers(remove_duplicate=False)):
        found.setdefault(name, tensor)
    return found


@dataclass(frozen=True)
class Meta:
    """A tensor on the wire: what the receiver allocates before the tensor arrives."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    parameter: bool = False


# ---- pickling with the tensors left out --------------------------------------------------------------------------


class _Pickler(pickle.Pickler):
    """Pickles a structure with each tensor replaced by a reference: ``("keep", name)`` where the receiver already
    holds that tensor (``keep``: id -> name), else ``("sent", i)``, the tensor appended to ``sent``."""

    def __init__(self, file, keep: dict[int, str] | None = None):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.keep = keep or {}
        self.sent: list[torch.Tensor] = []
        self.tensors: list[tuple[torch.Tensor, str | int]] = []  # each tensor met, as it was, and its name or index
        self.from_main: set[str] = set()  # the classes of ``__main__`` met (``travel_problem``)

    def persistent_id(self, obj):
        if not isinstance(obj, torch.Tensor):
            kind = obj if isinstance(obj, type) else type(obj)
            if getattr(kind, "__module__", None) == "__main__":
                self.from_main.add(kind.__qualname__)
            return None
        if id(obj) in self.keep:
            self.tensors.append((obj, self.keep[id(obj)]))
            return ("keep", self.keep[id(obj)], isinstance(obj, torch.nn.Parameter))
        self.sent.append(obj.detach())
        self.tensors.append((obj, len(self.sent) - 1))
        return ("sent", len(self.sent) - 1, isinstance(obj, torch.nn.Parameter))


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, received: list[torch.Tensor], kept: dict[str, torch.Tensor] | None = None):
        super().__init__(file)
        self.received, self.kept = received, kept or {}
        self.used: dict[str, torch.Tensor] = {}  # the kept tensors the structure named

    def persistent_load(self, pid):
        kind, key, parameter = pid
        tensor = self.kept[key] if kind == "keep" else self.received[key]
        if kind == "keep":
            self.used[key] = tensor
        if parameter and not isinstance(tensor, torch.nn.Parameter):
            return torch.nn.Parameter(tensor, requires_grad=False)
        return tensor


def packed(value, keep: dict[int, str] | None = None) -> tuple[bytes, list[torch.Tensor]]:
    """``value`` pickled without its tensors, and the tensors to send after it."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer, keep)
    pickler.dump(value)
    return buffer.getvalue(), pickler.sent


def unpacked(data: bytes, received: list[torch.Tensor], kept: dict[str, torch.Tensor] | None = None):
    return _Unpickler(io.BytesIO(data), received, kept).load()


class Inputs:
    """The tensors of the last call sent to one worker, held here (so no other tensor can take an ``id`` while
    they are compared) and there by name: a tensor of the next call that is the same object at the same version
    (``Tensor._version``, moved by every in-place write) is named, not sent. A pipeline that calls its denoiser per
    guidance branch passes the same prompt embeddings at every step: they cross once per call of the pipeline,
    not once per step (issue 34)."""

    def __init__(self) -> None:
        self.held: dict[int, tuple[torch.Tensor, int | None, str]] = {}
        self.serial = 0

    def keep(self) -> dict[int, str]:
        return {key: name for key, (t, version, name) in self.held.items() if version == _version(t) is not None}

    def packed(self, value) -> tuple[bytes, list[torch.Tensor], list[str]]:
        """``value`` pickled as ``packed`` does, the tensors to send, and the names the worker keeps them by."""
        buffer = io.BytesIO()
        pickler = _Pickler(buffer, self.keep())
        pickler.dump(value)
        self.serial += 1
        names = [f"{self.serial}/{i}" for i in range(len(pickler.sent))]
        self.held = {id(t): (t, _version(t), key if isinstance(key, str) else names[key]) for t, key in pickler.tensors}
        return buffer.getvalue(), pickler.sent, names

    def forget(self) -> None:
        self.held = {}


def _version(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter; None for an inference-mode tensor, which keeps none (so is always sent)."""
    return None if tensor.is_inference() else tensor._version


def received_inputs(data: bytes, received: list[torch.Tensor], names: list[str], kept: dict[str, torch.Tensor]
                    ) -> tuple[Any, dict[str, torch.Tensor]]:
    """A call's structure with its tensors put back (those named from ``kept``, the worker's last call's), and
    what the worker holds for the next call: this call's tensors by name."""
    unpickler = _Unpickler(io.BytesIO(data), received, kept)
    value = unpickler.load()
    return value, {**unpickler.used, **dict(zip(names, received))}


def metas(tensors: list[torch.Tensor]) -> list[Meta]:
    return [Meta(tuple(t.shape), t.dtype) for t in tensors]


# ---- the process group -------------------------------------------------------------------------------------------


_C10D: Any = torch._C._distributed_c10d  # the registry of groups by name, which torch's functional collectives read
_NAMES = itertools.count()


def _group(store: dist.Store, rank: int, size: int, device: torch.device, seconds: float, name: str,
           gloo: bool = False, host: str = "127.0.0.1") -> Any:
    """A process group of its own (no default group: the user's torch.distributed stays untouched): NCCL on CUDA,
    gloo elsewhere or where ``gloo`` (ranks sharing a GPU, ``shared_gpu``: gloo then serves CUDA tensors through
    host memory, and the CPU tensors point-to-point traffic stages there), registered under ``name`` so that torch's
    functional collectives (a sequence split's Ulysses attention) find it; ``_forget`` unregisters it. gloo's pairs
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
    communicator (``serve``)."""
    if not (staged and cuda):
        return "direct"
    if os.environ.get(P2P_ENV) == "1":
        return "p2p_off"
    user_nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    if _NCCL_MADE or user_nccl:
        return "gloo"
    os.environ[P2P_ENV] = "1"
    return "p2p_off"


def _joined(store: dist.Store, rank: int, size: int, device: torch.device, seconds: float, name: str,
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
        _forget(group)
        raise RanksSelfTestError(name, [str(device)], f"an all-reduce of known values gave {probe.tolist()}, not "
                                 f"{expected}")
    return group


def subgroup(store: dist.Store, members: tuple[int, ...], rank: int, device: torch.device, seconds: float,
             name: str, gloo: bool, host: str = "127.0.0.1") -> Any:
    """The group of the ranks ``members`` (``rank``: one of them, in the whole group's numbering) over the whole
    group's store: only those ranks take part in making it. Its own collectives (a branch's sequence split) never
    wait for the other ranks'."""
    store = dist.PrefixStore(name, store)
    return _joined(store, members.index(rank), len(members), device, seconds, name, gloo, host)


def _forget(group: Any) -> None:
    with contextlib.suppress(Exception):
        _C10D._unregister_process_group(group.group_name)


def _send(group: Any, tensors: list[torch.Tensor], peer: int, device: torch.device) -> list:
    """Start sending ``tensors`` to ``peer`` (each moved to this rank's ``device`` first); the works to wait on."""
    works = []
    for tag, tensor in enumerate(tensors):
        if tensor.numel() == 0:
            continue
        sent = tensor.to(device).contiguous()  # kept with its work until sent
        works.append((group.send([sent], peer, tag), sent))
    return works


def _receive_tensors(group: Any, wanted: list[Meta], peer: int, device: torch.device,
                     through: torch.device | None = None) -> list[torch.Tensor]:
    """The tensors ``wanted`` from ``peer``, received on ``through`` (``wire``: the host where gloo carries a GPU's)
    and on ``device`` when returned."""
    tensors = [torch.empty(m.shape, dtype=m.dtype, device=through or device) for m in wanted]
    works = [group.recv([t], peer, tag) for tag, t in enumerate(tensors) if t.numel()]
    for work in works:
        work.wait()
    return [t.to(device) for t in tensors]


def _alive(r: _Rank) -> bool:
    return r.process.alive()


@dataclass(frozen=True)
class Start:
    """What a worker is started with: its rank of ``size``, the rendezvous (``host``, ``port``: rank 0's store), its
    device, where it loads its first copy from, the waits' bound, the group's name, and how the group exchanges
    (``staged``: through host memory, the copy check's verdict; ``gloo``: ranks sharing a GPU)."""

    rank: int
    size: int
    host: str
    port: int
    device: str
    source: Source
    seconds: float
    name: str
    staged: bool = False
    gloo: bool = False


@dataclass(frozen=True)
class _Spawned:
    """A worker started with ``spawn``, as rank 0 watches and stops it (``ray_workers.Actor`` is the other kind)."""

    process: Any  # a multiprocessing Process

    @property
    def pid(self) -> int:
        return self.process.pid or 0

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def alive(self) -> bool:
        """Its sentinel (a pipe end the child holds) is closed once it exits, even where someone else reaped it
        (``Process.is_alive`` would then say it lives)."""
        return not multiprocessing.connection.wait([self.process.sentinel], timeout=0)

    def join(self, timeout: float) -> None:
        self.process.join(timeout=timeout)

    def greet(self, hello: dict) -> None:
        pass  # its pid is known from the start

    def kill(self) -> None:
        self.process.kill()

    def stop(self) -> None:
        """Wait for it to end (it was asked to), then kill it."""
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)


class _Spawn:
    """Starts each worker as a child process (``spawn``): ``PIPEMAP_WORKERS=process``."""

    host = "127.0.0.1"

    def launch(self, component: str, start: Start, index: int) -> tuple[_Spawned, Any]:
        """Worker ``index`` (0 for rank 1) started; its handle and rank 0's end of its pipe."""
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        process = context.Process(target=serve, name=f"pipemap-{component}-rank{start.rank}", daemon=True,
                                  args=(start, theirs, os.getpid()))
        with _without_main():
            process.start()
        theirs.close()
        return _Spawned(process), ours

    def close(self) -> None:
        pass


def launcher(component: str, devices: tuple[torch.device, ...], runtime: str = "process") -> Any:
    """What starts the workers on ``devices``: child processes, or Ray actors (``runtime="ray"``)."""
    if runtime == "ray":
        if importlib.util.find_spec("ray") is None:
            raise WorkersOptionError("ranks", runtime, ("thread", "process"), "needs Ray, which is not installed "
                                     "(pip install -e '.[ray]' in pipemap's checkout)")
        from .ray_workers import RayLauncher  # here: Ray is imported only where asked for

        return RayLauncher(component, devices, timeout_s(), serve)
    return _Spawn()


_SPAWNING = threading.Lock()


@contextlib.contextmanager
def _without_main():
    """``spawn`` without the caller's main script: by default a spawned child first runs the parent's ``__main__``
    file again (the reason scripts need ``if __name__ == "__main__":``), so ``pipe(prompt)`` at the top of a script
    would run again in each worker. A worker needs none of it: its target is a function of this module."""
    prepare = multiprocessing.spawn.get_preparation_data

    def without(name):
        data = prepare(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    with _SPAWNING:
        multiprocessing.spawn.get_preparation_data = without
        try:
            yield
        finally:
            multiprocessing.spawn.get_preparation_data = prepare


def _listener(host: str) -> socket.socket:
    """A socket listening on ``host`` (loopback for workers of this machine), for rank 0's store: bound here and
    handed to the store as it is (WP6, WP13: ``TCPStore`` given a host name still listens on every interface, and a
    port probed then closed may be taken before the store binds it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen(128)
    return listener


def load_bound(source: Source, workers: int) -> float:
    """How long the workers may take to load their first copies (WP7): the call bound plus the copy's bytes read
    at a slow disk's rate (50 MB/s: network storage, a busy disk) by each worker, which read the same files at once.
    Apart from the call bound, so a large model's load is no timeout; a dead worker is still seen at once."""
    return timeout_s() + workers * source.bytes / 50e6


# ---- rank 0's end ------------------------------------------------------------------------------------------------


@dataclass(eq=False)  # one worker is itself only (``Workers.send`` looks a call's ranks up)
class _Rank:
    """One worker as rank 0 sees it."""

    rank: int
    device: torch.device
    process: Any  # its handle: ``_Spawned``, or ``ray_workers.Actor``
    pipe: Any  # a ``multiprocessing`` connection: send, recv, poll, close
    pid: int = 0
    inputs: Inputs = field(default_factory=Inputs)  # its last call's tensors, which the next call may name
    early: list = field(default_factory=list)  # a message read by a split's watcher (``Workers.watching``)


@dataclass(frozen=True)
class Raised:
    """An exception a worker's call raised that its caller expects (``Workers.send(expected=...)``)."""

    kind: str
    message: str


@dataclass(eq=False)  # one call is itself only (``Workers.outstanding``)
class Call:
    """A call sent to the workers, its outputs not yet received (``outputs``: received already, kept for whoever
    asks, because a later call's receive needed what came before it: WP15)."""

    ranks: list[_Rank]
    works: list = field(default_factory=list)
    outputs: list | None = None


class Workers:
    """The worker processes of one component: one per device of ``devices``, ranks 1.. of a group with this
    process. ``start`` launches them, ``sync`` brings their copies in line with the component, ``send``/``receive``
    run a call, ``close`` stops them all; a failure anywhere stops them all too (``WorkerDiedError``), and the next
    ``sync`` starts new ones."""

    def __init__(self, component: str, home: torch.device, devices: tuple[torch.device, ...],
                 runtime: str = "process"):
        self.component, self.home, self.devices, self.runtime = component, home, devices, runtime
        self.ranks: list[_Rank] = []
        self.group: Any = None  # a ProcessGroup with a gloo or NCCL backend (``_group``)
        self.name = ""  # the group's name: its subgroups' names start with it
        self.subgroups: list[Any] = []  # rank 0's subgroups (``split``): forgotten at close
        self.store: dist.TCPStore | None = None
        self.host = "127.0.0.1"  # where the store and gloo's pairs listen (the launcher's: a Ray node's address)
        self.outstanding: list[Call] = []  # calls sent whose outputs were not received yet, oldest first
        self.served: list[int] = []  # the pid of the process that computed each output received (tests read it)
        self.sent: list[int] = []  # per worker synced last: how many tensors it was sent (the others it kept)
        self.staged = False  # the copy check staged a pair of these ranks: they exchange through host memory
        self.transport = "direct"  # how the group exchanges: ``nccl_transport``'s word, or "shared" (one GPU)
        self.gloo = False  # gloo carries the tensors, through the host (ranks sharing a GPU, or WP5's fallback)
        self.wire = home  # where rank 0's tensors travel from (``wire``)
        self.hellos: list[dict] = []  # per worker started last: what it reported at start (tests read it)
        self.launcher: Any = None  # what started them (``launcher``): it frees what it holds at close
        self.lock = threading.RLock()  # sends and receives take turns (a call's lock serializes them already)

    @property
    def running(self) -> bool:
        return bool(self.ranks) and all(_alive(r) for r in self.ranks)

    def pids(self) -> list[int]:
        return [r.pid for r in self.ranks]

    def describe(self) -> str:
        """One line for an explanation: the ranks' devices and how they exchange (the copy check's verdict)."""
        devices = ", ".join(str(d) for d in (self.home, *self.devices))
        if self.transport == "shared":
            return (f"{self.component!r}: ranks on {devices}, two on one GPU: exchanging through host memory over "
                    "gloo (NCCL takes one rank per GPU)")
        if not self.staged:
            return f"{self.component!r}: ranks on {devices}, exchanging directly"
        how = {"p2p_off": "NCCL with peer-to-peer off for this whole process, as NCCL reads it once per process",
               "gloo": "gloo: this process's NCCL already runs with peer-to-peer on, which NCCL reads once"}.get(
            self.transport, "gloo, through the host anyway")
        return (f"{self.component!r}: ranks on {devices}, exchanging through host memory ({how}): the copy check "
                "found a pair of these devices corrupting direct copies")

    # -- lifetime --

    def start(self, source: Source) -> None:
        self.close()
        seconds = timeout_s()
        size = 1 + len(self.devices)
        name = self.name = f"pipemap-{self.component}-{os.getpid()}-{next(_NAMES)}"
        self.staged = staged = staged_ranks((self.home, *self.devices))
        shared = shared_gpu((self.home, *self.devices))
        self.transport = "shared" if shared else nccl_transport(staged, self.home.type == "cuda")
        self.gloo = gloo = self.transport in ("shared", "gloo")
        self.wire = wire(self.home, gloo)
        try:
            self.launcher = launcher(self.component, self.devices, self.runtime)
            host = self.host = self.launcher.host
            listener = _listener(host)
            port = listener.getsockname()[1]
            self.store = dist.TCPStore(host, port, size, is_master=True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=seconds), master_listen_fd=listener.detach())
            for index, device in enumerate(self.devices):
                start = Start(index + 1, size, host, port, str(device), source, seconds, name, staged, gloo)
                handle, pipe = self.launcher.launch(self.component, start, index)
                self.ranks.append(_Rank(index + 1, device, handle, pipe, handle.pid))
            self.hellos = []
            for r in self.ranks:  # alive, before its load
                hello = self._receive(r, "start")
                r.pid = hello["pid"]
                r.process.greet(hello)
                self.hellos.append(hello)
            bound = time.monotonic() + load_bound(source, len(self.ranks))
            for r in self.ranks:  # each has loaded its copy from the folder: only now join the group
                self._receive(r, "load", until=bound)
            self.group = self._joined(_joined, self.store, 0, size, self.home, seconds, name, gloo, host)
        except BaseException:
            self.close()
            raise

    def _joined(self, make, *args) -> Any:
        """A group made and checked (``_joined``): a wrong result is ``RanksSelfTestError`` naming the component."""
        try:
            return self._guarded(functools.partial(make, *args), None, "start")
        except RanksSelfTestError as err:
            self.close()
            raise RanksSelfTestError(self.component, [str(d) for d in (self.home, *self.devices)], err.why) from None

    def close(self) -> None:
        """Stop every worker (asked first, then killed) and free the group, its port and what the launcher holds."""
        ranks, self.ranks = self.ranks, []
        for r in ranks:
            with contextlib.suppress(OSError, ValueError):
                r.pipe.send(("stop",))
        for r in ranks:
            r.process.stop()
            with contextlib.suppress(OSError):
                r.pipe.close()
        if self.launcher is not None:
            self.launcher.close()
        for group in [self.group, *self.subgroups]:
            if group is not None:
                _forget(group)
        self.group = self.store = self.launcher = None
        self.subgroups = []
        self.outstanding = []

    def interrupt(self) -> None:
        """After a rank failed inside a collective: NCCL's communicators aborted (their kernels would wait forever
        for the lost rank, and the watchdog would end this process, WP1), every worker killed (gloo's waits on
        them then end at once), so rank 0's own collective returns with an error instead of waiting out the
        group's timeout."""
        if self.home.type == "cuda" and not self.gloo:
            for group in [self.group, *self.subgroups]:
                if group is not None:
                    with contextlib.suppress(Exception):
                        group.abort()
        for r in self.ranks:
            with contextlib.suppress(Exception):
                r.process.kill()

    # -- the workers' copies --

    def sync(self, plain: torch.nn.Module, source: Source) -> None:
        """Each worker's copy made equal to ``plain`` (the component with no hooks; workers started from ``source``
        where none runs): its structure pickled, each tensor the worker already holds alike kept there, the others
        sent."""
        if not self.running:
            self.start(source)
        names = _named_tensors(plain)
        self.sent = []
        for r in self.ranks:
            theirs = self._ask(r, ("digests",), "sync")
            keep = {id(t): n for n, t in names.items()
                    if theirs.get(n) == (tuple(t.shape), t.dtype, digest(t))}
            data, sent = packed(plain, keep)
            self.sent.append(len(sent))
            r.pipe.send(("module", data, metas(sent)))
            self._finish(_send(self._live_group(), sent, r.rank, self.wire), r, "sync")
            self._receive(r, "sync")

    def held(self) -> list[int]:
        """Per worker: the bytes its copy's parameters and buffers hold (on its device; the plan's figure for it)."""
        return [self._ask(r, ("held",), "sync") for r in self.ranks]

    def peaks(self) -> dict[str, int]:
        """Per worker's device: the most bytes its CUDA allocator held since the last ask (0 on the CPU), what
        rank 0's allocator cannot see (WP9)."""
        return {str(r.device): self._ask(r, ("peak",), "call") for r in self.ranks}

    # -- calls --

    def split(self, halves: tuple[tuple[int, ...], ...] = ()) -> Any:
        """Make each worker's copy its rank of a sequence split (``sequence.enable_split``) over the whole group, or
        over its own of ``halves`` (disjoint lists of ranks, each a group of its own: ``subgroup``); rank 0's group
        (None where rank 0 is in none of them)."""
        if not halves:
            for r in self.ranks:
                self._ask(r, ("split", r.rank, None, ""), "sync")
            return self.group
        for group in self.subgroups:  # a split made anew (a followed change): the halves' last groups go
            _forget(group)
        self.subgroups = []
        names = [f"{self.name}-part{next(_NAMES)}" for _ in halves]
        for r in self.ranks:  # every member asked before any joins: making a group waits for all its members
            members, name = next((m, n) for m, n in zip(halves, names) if r.rank in m)
            self._post(r, ("split", r.rank, members, name), "sync")
        mine, store = None, self.store
        assert store is not None  # set by start, before any sync
        for members, name in zip(halves, names):
            if 0 in members:
                mine = self._joined(subgroup, store, members, 0, self.home, timeout_s(), name, self.gloo, self.host)
                self.subgroups.append(mine)
        for r in self.ranks:
            self._receive(r, "sync")
        return mine

    def send(self, parts: list[tuple[tuple, dict]], state: tuple, reply: bool | tuple[bool, ...] = True,
             expected: tuple[type, ...] = (), to: tuple[int, ...] = ()) -> Call:
        """Start one call per worker: ``parts[i]`` (args, kwargs) to rank i + 1 (to rank ``to[i]`` where given),
        under the caller's ``state``. A call still out on these ranks (a guidance branch started ahead by another
        request, ``run_many``) is not taken: each worker answers its calls in order, and ``receive`` keeps the
        earlier call's outputs for whoever asks (WP15). ``reply=False`` (per part where a tuple): the outputs stay
        in the workers (a sequence split's ranks each hold the gathered whole); an exception of a class in
        ``expected`` comes back as a ``Raised`` output, the workers kept."""
        with self.lock:
            ranks = [self.ranks[i - 1] for i in to] if to else self.ranks[:len(parts)]
            call = Call(ranks)
            self.outstanding.append(call)
            replies = reply if isinstance(reply, tuple) else (reply,) * len(parts)
            for r, part, answer in zip(call.ranks, parts, replies):
                data, tensors, names = r.inputs.packed(part)
                self._post(r, ("call", data, metas(tensors), names, state, answer, expected), "call")
                call.works += self._guarded(functools.partial(_send, self._live_group(), tensors, r.rank,
                                                              self.wire), r, "call")
            return call

    def receive(self, call: Call) -> list:
        """Each worker's output of ``call``, in rank order, on the home device; the calls sent before it to any of
        its ranks are received first (each worker answers in order), their outputs kept on them."""
        with self.lock:
            if call.outputs is not None:
                outputs, call.outputs = call.outputs, None
                return outputs
            if call not in self.outstanding:
                raise RuntimeError("this call's outputs were received already, or its workers stopped since")
            try:
                for earlier in self.outstanding[:self.outstanding.index(call)]:
                    if any(r in call.ranks for r in earlier.ranks):
                        earlier.outputs = self._received(earlier)
                return self._received(call)
            except BaseException:
                self.close()
                raise

    def _received(self, call: Call) -> list:
        self.outstanding.remove(call)
        self._finish(call.works, None, "call")
        return [self._output(r, call.ranks) for r in call.ranks]

    def _output(self, r: _Rank, peers: list[_Rank]):
        data, wanted, pid = self._receive(r, "call", peers)
        self.served.append(pid)
        tensors = self._guarded(functools.partial(_receive_tensors, self._live_group(), wanted, r.rank, self.home,
                                                  self.wire), r, "call")
        return unpacked(data, tensors)

    @contextlib.contextmanager
    def watching(self, call: Call):
        """While rank 0 computes its share of ``call`` (a sequence split, whose collectives wait on every rank), a
        thread watches the call's ranks: a worker's error or death interrupts the group (``interrupt``), so rank 0's
        collective ends at once instead of at the group's timeout (WP1, WP2). Yields a list that then holds the
        worker's own error (its traceback; an out-of-memory error as ``torch.OutOfMemoryError``), to raise instead
        of rank 0's (``failure``)."""
        seen: list[BaseException] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(_POLL_S):
                found = self._failed(call)
                if found is not None:
                    seen.append(found)
                    self.interrupt()
                    return

        watcher = threading.Thread(target=watch, name=f"pipemap-{self.component}-watch", daemon=True)
        watcher.start()
        try:
            yield seen
        finally:
            stop.set()
            watcher.join()

    def failure(self, call: Call, seen: list[BaseException], grace: float = 2.0) -> BaseException | None:
        """After rank 0's share of a split call failed: the worker's error that caused it (what the watcher saw,
        or an error or a death that shows within ``grace`` seconds: gloo may fail rank 0 before the watcher looks),
        else None (rank 0's own error). Every worker is stopped either way: they are inside the call's collectives."""
        found = seen[0] if seen else None
        deadline = time.monotonic() + grace
        while found is None and time.monotonic() < deadline:
            found = self._failed(call)
            if found is None:
                time.sleep(_POLL_S)
        self.interrupt()
        self.close()
        return found

    def _failed(self, call: Call) -> BaseException | None:
        """A rank of ``call`` that sent an error or died, as its error; its message kept for ``_receive``."""
        for r in call.ranks:
            if not r.early and r.pipe.poll(0):
                with contextlib.suppress(EOFError, OSError):
                    r.early.append(r.pipe.recv())
            if r.early and r.early[0][0] == "error":
                return self._remote_error(r, "call", r.early[0][1:])
            if not _alive(r):
                return WorkerDiedError(self.component, str(r.device), r.pid, "call", r.process.exitcode, None)
        return None

    # -- waiting, bounded --

    def _live_group(self) -> Any:
        assert self.group is not None  # set by start, before any call or sync
        return self.group

    def _ask(self, r: _Rank, message: tuple, phase: str):
        self._post(r, message, phase)
        return self._receive(r, phase)

    def _post(self, r: _Rank, message: tuple, phase: str) -> None:
        try:
            r.pipe.send(message)
        except (OSError, ValueError) as err:
            raise self._died(r, phase) from err

    def _receive(self, r: _Rank, phase: str, peers: list[_Rank] | None = None, until: float | None = None):
        """The worker's next answer: waited for while it and its ``peers`` in this call live (a rank waiting in a
        collective for a dead peer would wait out the group's timeout), until ``until`` (``time.monotonic``; the
        timeout from now by default)."""
        deadline = until if until is not None else time.monotonic() + timeout_s()
        while not r.early and not r.pipe.poll(_POLL_S):
            gone = next((p for p in (r, *(peers or ())) if not _alive(p)), None)
            if gone is not None:
                raise self._died(gone, phase)
            if time.monotonic() > deadline:
                raise self._died(r, phase, timed_out=True)
        try:
            kind, *rest = r.early.pop(0) if r.early else r.pipe.recv()
        except (EOFError, OSError) as err:
            raise self._died(r, phase) from err
        if kind == "error":
            error = self._remote_error(r, phase, rest)
            self.close()
            raise error
        return rest[0]

    def _remote_error(self, r: _Rank, phase: str, rest: list) -> BaseException:
        """A worker's exception as rank 0 raises it: an out-of-memory error as ``torch.OutOfMemoryError`` naming the
        worker's GPU (so relief and the memory ledger handle it, WP9), any other as ``WorkerCallError``."""
        trace, oom = rest[0], len(rest) > 1 and rest[1]
        if oom:
            last = trace.strip().splitlines()[-1] if trace.strip() else ""
            return torch.OutOfMemoryError(f"in the worker process (pid {r.pid}) running {self.component!r} on "
                                          f"{r.device}: {last.partition(': ')[2] or last}")
        return WorkerCallError(self.component, str(r.device), r.pid, phase, trace)

    def _finish(self, works: list, r: _Rank | None, phase: str) -> None:
        for work, _tensor in works:
            self._guarded(work.wait, r, phase)

    def _guarded(self, run, r: _Rank | None, phase: str):
        try:
            return run()
        except (WorkerDiedError, RanksSelfTestError):
            raise
        except RuntimeError as err:  # the group's own error: a peer gone, a timeout
            raise self._died(r or self.ranks[0], phase) from err

    def _died(self, r: _Rank, phase: str, timed_out: bool = False) -> WorkerDiedError:
        """The error for worker ``r`` gone (or silent past the timeout); every worker of the component stopped."""
        r.process.join(timeout=1.0)  # a worker whose pipe broke is exiting: its exit code, where it has one now
        error = WorkerDiedError(self.component, str(r.device), r.pid, phase, r.process.exitcode,
                                timeout_s() if timed_out else None)
        self.close()
        return error


# ---- the workers of each component, and their end ----------------------------------------------------------------

_ALL: weakref.WeakKeyDictionary[torch.nn.Module, Workers] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def workers_for(module: torch.nn.Module, component: str, home: torch.device,
                devices: tuple[torch.device, ...], runtime: str = "process") -> Workers:
    """The workers of ``module`` (made now, none started, if it has none or they serve other devices): they
    outlive a new hook over the module (a followed change keeps them, ``sync`` sends what changed) and stop with
    ``stop_workers`` or when the module is collected."""
    with _LOCK:
        found = _ALL.get(module)
        if found is not None and (found.home, found.devices, found.runtime) == (home, devices, runtime):
            return found
        if found is not None:
            found.close()
        made = _ALL[module] = Workers(component, home, devices, runtime)
        weakref.finalize(module, made.close)
        return made


@atexit.register
def _stop_all() -> None:
    for workers in list(_ALL.values()):
        workers.close()


def stop_workers(module: torch.nn.Module) -> None:
    """Stop the worker processes of ``module``, if any (``dispatch.reset``)."""
    with _LOCK:
        found = _ALL.pop(module, None)
    if found is not None:
        found.close()


class OnWorkers:
    """What the hooks whose copies are worker processes share (first in their bases, before the thread hook they
    derive from, ``thread_hook``): the thread hook on the dry run's stand-ins, the check that the component can
    travel, the fall-back to the thread hook, the workers stopped at reset, their process ids."""

    thread_hook: type
    workers: Workers | None
    _module: Any = None  # a weak reference to the component: new workers are given it after a death
    component: str  # the hook's own (``PlacementHook``, ``CopiesHook``)
    device: torch.device
    replica_devices: tuple[torch.device, ...]
    runtime = "process"  # what starts the workers (``launcher``): "process" or "ray"
    asked = False  # the runtime was named by the user: a component that cannot travel is an error, no fall-back
    fallback: str | None = None  # why this hook runs its ranks as threads after all (set on the thread hook)

    @classmethod
    def for_placement(cls, p, execution_device: str, ledger, runtime: str = "process", asked: bool = False):
        """The hook of this mode's placement on workers; the threads' hook on the dry run's stand-ins."""
        if on_standins(p):
            return cls.thread_hook(p.component, p.device, execution_device, p.replicas)
        hook = cast(Any, cls)(p.component, p.device, execution_device, p.replicas)
        hook.runtime, hook.asked = runtime, asked
        return hook

    def init_hook(self, module):
        """The workers brought up for ``module`` (``init_on_workers``, each hook's own), or, where the runtime was
        chosen by ``ranks="auto"`` and the component cannot travel or the group fails its bring-up check, the
        thread hook's, with a warning (``RanksFallbackWarning``) that says why."""
        try:
            problem = travel_problem(plain_copy(module))
            if problem is None:
                return self.init_on_workers(module)
            if self.asked:
                raise CannotTravelError(self.component, problem)
        except RanksSelfTestError as err:
            if self.asked:
                raise
            problem = str(err)
        warnings.warn(RanksFallbackWarning(self.component, self.runtime, problem), stacklevel=2)
        thread_hook: Any = self.thread_hook
        self.__class__ = thread_hook  # its own state is the thread hook's (a subclass adds only the workers')
        self.fallback = problem
        return thread_hook.init_hook(self, module)

    def init_on_workers(self, module):
        raise NotImplementedError

    def release(self, module) -> None:
        """Stop this component's worker processes (``dispatch.reset``)."""
        stop_workers(module)

    def pids(self) -> list[int]:
        """The process ids of the workers running now."""
        return self.workers.pids() if self.workers is not None and self.workers.running else []

    def attach_workers(self, module: torch.nn.Module) -> Workers:
        """The component's workers (``workers_for``: kept across hooks over it), brought up for this hook."""
        self._module = weakref.ref(module)
        workers = self.workers = workers_for(module, self.component, self.device, self.replica_devices,
                                             self.runtime)
        try:
            self.bring_up(module)
        except BaseException:  # no worker outlives a dispatch that failed (WP3): reset finds no hook to stop them
            stop_workers(module)
            self.workers = self._module = None
            raise
        return workers

    def bring_up(self, module: torch.nn.Module) -> None:
        """Give the workers (started anew where none runs) the module: each hook's own (a sync; a split's ranks)."""
        raise NotImplementedError

    def running_workers(self) -> Workers:
        """The workers, started anew and brought up where one died since the last call."""
        module = self._module() if self._module is not None else None
        if self.workers is None or module is None:
            raise RuntimeError(f"{self!r} is not attached to its component")
        if not self.workers.running:
            self.bring_up(module)
        return self.workers


# ---- a worker's end ----------------------------------------------------------------------------------------------


def serve(start: Start, pipe, parent: int | None) -> None:
    """A worker process: say it lives, load the copy, join the group, then answer rank 0's messages until told to
    stop or until rank 0 is gone (its end of ``pipe`` closed; where ``parent`` is rank 0's pid, also when this
    process's parent changes: a child process outlives nothing of its parent's)."""
    if parent is not None:
        _watch(parent)
    if start.staged:  # before this process's first communicator: NCCL reads it once per process (WP5)
        os.environ[P2P_ENV] = "1"
    os.environ.setdefault(NCCL_ERRORS_ENV, "2")  # a watchdog timeout aborts the communicator, not this process
    device = torch.device(start.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    hello = {"pid": os.getpid(), "host": socket.gethostname(), "staged": start.staged, "gloo": start.gloo,
             P2P_ENV: os.environ.get(P2P_ENV)}
    pipe.send(("ready", hello))  # alive: the load that follows has a bound of its own (WP7)
    try:
        module = start.source.load(device)
    except Exception:  # files it cannot read alone (a variant's names, say): every tensor is then sent
        module = None
    pipe.send(("loaded", module is not None))
    store = dist.TCPStore(start.host, start.port, start.size, is_master=False,
                          timeout=datetime.timedelta(seconds=start.seconds))
    group = _joined(store, start.rank, start.size, device, start.seconds, start.name, start.gloo, start.host)
    worker = _Worker(group, device, module, wire(device, start.gloo), start, store)
    while True:
        try:
            message = pipe.recv()
        except (EOFError, OSError):
            return  # rank 0 is gone
        if message[0] == "stop":
            return
        try:
            worker.handle(message, pipe)
        except Exception as err:
            pipe.send(("error", traceback.format_exc(), isinstance(err, torch.OutOfMemoryError)))


def _watch(parent: int) -> None:
    """Exit this process when rank 0's process is gone, whatever this one is waiting on."""

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch, name="pipemap-watchdog", daemon=True).start()


@dataclass
class _Worker:
    """A worker's state: its group, its device, its copy of the component."""

    group: Any
    device: torch.device
    module: torch.nn.Module | None
    through: torch.device  # where its tensors travel (``wire``)
    start: Start | None = None  # what it was started with (a subgroup's bounds and exchange)
    store: Any = None  # rank 0's store (a subgroup is made over it)
    part: Any = None  # its subgroup, where a split made one: forgotten when a new split makes another
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # the last call's tensors, by the caller's names

    def handle(self, message: tuple, pipe) -> None:
        """Answer one message of rank 0 through ``pipe`` (an output's tensors through the group, after it)."""
        kind, *rest = message
        if kind == "digests":
            held = _named_tensors(self.module) if self.module is not None else {}
            pipe.send(("digests", {n: (tuple(t.shape), t.dtype, digest(t)) for n, t in held.items()}))
        elif kind == "held":  # the bytes of the copy's parameters and buffers (what the plan counts on this device)
            held = _named_tensors(self.module) if self.module is not None else {}
            pipe.send(("held", sum(t.numel() * t.element_size() for t in held.values())))
        elif kind == "peak":  # the most its allocator held since the last ask: rank 0's cannot see it (WP9)
            cuda = self.device.type == "cuda"
            pipe.send(("peak", torch.cuda.max_memory_allocated(self.device) if cuda else 0))
            if cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
        elif kind == "module":
            self._module(*rest)
            pipe.send(("synced", os.getpid()))
        elif kind == "split":
            from .sequence import enable_split  # here: only a sequence split's worker loads the context-parallel code

            if self.module is None:
                raise RuntimeError("no copy of the component was sent to this worker")
            rank, members, name = rest
            group = self.group if members is None else self._subgroup(rank, members, name)
            enable_split(self.module, rank if members is None else members.index(rank), group)
            pipe.send(("split", os.getpid()))
        elif kind == "call":
            data, wanted, names, state, reply, expected = rest
            try:
                output = self._call(data, wanted, names, state)
            except expected as err:  # the same on every rank (a sequence split's tokens that do not divide)
                output = Raised(type(err).__name__, str(err))
            if not reply and not isinstance(output, Raised):
                output = None
            data, tensors = packed(output)
            # the header first: rank 0 allocates from it, then receives the tensors
            pipe.send(("output", (data, metas(tensors), os.getpid())))
            for work, _tensor in _send(self.group, tensors, 0, self.through):
                work.wait()
        else:
            raise ValueError(f"unknown message {kind!r}")

    def _subgroup(self, rank: int, members: tuple[int, ...], name: str) -> Any:
        start = self.start
        if start is None or self.store is None:
            raise RuntimeError("this worker was started without a store to make a subgroup over")
        if self.part is not None:
            _forget(self.part)
        self.part = subgroup(self.store, members, rank, self.device, start.seconds, name, start.gloo, start.host)
        return self.part

    def _module(self, data: bytes, wanted: list[Meta]) -> None:
        received = _receive_tensors(self.group, wanted, 0, self.device, self.through)
        kept = _named_tensors(self.module) if self.module is not None else {}
        self.module = unpacked(data, received, kept).to(self.device).eval()

    def _call(self, data: bytes, wanted: list[Meta], names: list[str], state: tuple):
        received = _receive_tensors(self.group, wanted, 0, self.device, self.through)
        (args, kwargs), self.inputs = received_inputs(data, received, names, self.inputs)
        if self.module is None:
            raise RuntimeError("no copy of the component was sent to this worker")
        with entered(state, self.device):
            return self.module(*args, **kwargs)


def caller_state() -> tuple:
    """What of the caller's state a worker's call runs under: grad and inference mode, autocast (per thread), and
    the process-wide numerics settings (``numerics``), which a thread rank shares with rank 0 and a process does
    not (WP8)."""
    autocast = tuple((kind, torch.get_autocast_dtype(kind)) for kind in ("cpu", "cuda")
                     if torch.is_autocast_enabled(kind))
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast, numerics())


_SDPA = ("flash", "mem_efficient", "math", "cudnn")  # torch.backends.cuda.{name}_sdp_enabled / enable_{name}_sdp


def numerics() -> dict[str, Any]:
    """This process's settings that change which kernels compute: TF32 for matmuls and cuDNN, float32 matmul
    precision, reduced-precision reductions, the SDPA kernels enabled, diffusers' active attention backend."""
    matmul = torch.backends.cuda.matmul
    found: dict[str, Any] = {
        "tf32": matmul.allow_tf32, "cudnn_tf32": torch.backends.cudnn.allow_tf32,
        "precision": torch.get_float32_matmul_precision(),
        "fp16_reduced": matmul.allow_fp16_reduced_precision_reduction,
        "bf16_reduced": matmul.allow_bf16_reduced_precision_reduction,
        "sdpa": tuple(getattr(torch.backends.cuda, f"{name}_sdp_enabled")() for name in _SDPA)}
    dispatch = sys.modules.get("diffusers.models.attention_dispatch")  # not imported: the default backend
    if dispatch is not None:
        found["attention"] = str(dispatch._AttentionBackendRegistry.get_active_backend()[0].value)
    return found


@contextlib.contextmanager
def numerics_set(settings: dict[str, Any]):
    """``settings`` (``numerics``) in force in this process for the block, the worker's own back after it."""
    before = numerics()
    _apply(settings)
    try:
        if "attention" in settings:
            from diffusers.models.attention_dispatch import attention_backend  # here: only a diffusers model's call

            with attention_backend(settings["attention"]):
                yield
        else:
            yield
    finally:
        _apply(before)


def _apply(settings: dict[str, Any]) -> None:
    matmul = torch.backends.cuda.matmul
    matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = settings["tf32"], settings["cudnn_tf32"]
    torch.set_float32_matmul_precision(settings["precision"])
    matmul.allow_fp16_reduced_precision_reduction = settings["fp16_reduced"]
    matmul.allow_bf16_reduced_precision_reduction = settings["bf16_reduced"]
    for name, enabled in zip(_SDPA, settings["sdpa"]):
        getattr(torch.backends.cuda, f"enable_{name}_sdp")(enabled)


@contextlib.contextmanager
def entered(state: tuple, device: torch.device):
    grad, inference, autocast, settings = state
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.set_grad_enabled(grad))
        if inference:
            stack.enter_context(torch.inference_mode())
        for kind, dtype in autocast:
            stack.enter_context(torch.autocast(kind, dtype=dtype))
        stack.enter_context(numerics_set(settings))
        if device.type == "cuda":
            stack.enter_context(torch.cuda.device(device))
        yield
