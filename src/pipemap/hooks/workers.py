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
import importlib.util
import io
import itertools
import multiprocessing
import multiprocessing.connection
import multiprocessing.spawn
import os
import pickle
import socket
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist

from ..errors import WorkerCallError, WorkerDiedError, WorkersOptionError
from ..runtime import transfer

ENV = "PIPEMAP_WORKERS"
TIMEOUT_ENV = "PIPEMAP_WORKER_TIMEOUT"
MODES = ("thread", "process", "ray")  # "ray": the worker processes as Ray actors (``ray_workers.py``)
_POLL_S = 0.05  # how often a wait on a pipe looks at the worker's liveness


def workers_mode() -> str:
    """How a split denoiser's other ranks run: ``"thread"`` (the default), ``"process"`` (a process per rank, which
    pipemap starts) or ``"ray"`` (the same processes as Ray actors in one placement group) (``PIPEMAP_WORKERS``)."""
    mode = os.environ.get(ENV, "thread").strip().lower() or "thread"
    if mode not in MODES:
        raise WorkersOptionError(ENV, mode, MODES)
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


# ---- what a worker loads first ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """Where a worker loads its first copy from: the component's class and the folder of its safetensors files
    (None: the component came from no folder; every tensor is then sent)."""

    module: str
    name: str
    folder: str | None
    dtype: torch.dtype

    @classmethod
    def of(cls, module: torch.nn.Module) -> Source:
        kind = type(module)
        folder = _folder(module)
        dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
        return cls(kind.__module__, kind.__qualname__, folder, dtype)

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


# ---- the exact digest of a tensor's bytes ------------------------------------------------------------------------

_CHUNK = 1 << 24


def digest(tensor: torch.Tensor) -> tuple[int, int]:
    """Two integer sums over the tensor's bytes read as integers, the second weighted by position: exact and alike on
    every device (no floating-point rounding), so a worker and rank 0 compare their copies without moving them."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return (0, 0)
    width = flat.element_size()
    view = flat.view(torch.uint8).view({8: torch.int64, 4: torch.int32, 2: torch.int16}.get(width, torch.uint8))
    plain = weighted = 0
    for start in range(0, view.numel(), _CHUNK):
        part = view[start:start + _CHUNK].to(torch.int64)
        weights = (torch.arange(start, start + part.numel(), device=part.device) % 65521) + 1
        plain += int(part.sum())
        weighted += int((part * weights).sum())
    return (plain, weighted)


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

    def persistent_id(self, obj):
        if not isinstance(obj, torch.Tensor):
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
           gloo: bool = False) -> Any:
    """A process group of its own (no default group: the user's torch.distributed stays untouched): NCCL on CUDA,
    gloo elsewhere or where ``gloo`` (ranks sharing a GPU, ``shared_gpu``: gloo then serves CUDA tensors through
    host memory, and the CPU tensors point-to-point traffic stages there), registered under ``name`` so that torch's
    functional collectives (a sequence split's Ulysses attention) find it; ``_forget`` unregisters it."""
    timeout = datetime.timedelta(seconds=seconds)
    prefix = dist.PrefixStore("pipemap", store)
    types = [torch.device(device.type)]
    if device.type == "cuda" and not gloo:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        backend: Any = dist.ProcessGroupNCCL(prefix, rank, size, options)
        kind = dist.ProcessGroup.BackendType.NCCL
    else:
        backend = dist.ProcessGroupGloo(prefix, rank, size, timeout)
        kind = dist.ProcessGroup.BackendType.GLOO
        types = list(dict.fromkeys([*types, torch.device("cpu")]))
    group = dist.ProcessGroup(prefix, rank, size)
    group._set_default_backend(kind)
    for kind_of_device in types:
        group._register_backend(kind_of_device, kind, backend)
    group._set_group_name(cast(Any, name))  # torch types it GroupName: a str
    _C10D._register_process_group(name, group)
    return group


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


@contextlib.contextmanager
def _p2p_off(staged: bool):
    """``NCCL_P2P_DISABLE=1`` in this process while a staged group starts (NCCL reads it when the communicator is
    made), the caller's own value back afterwards."""
    if not staged:
        yield
        return
    before = os.environ.get(P2P_ENV)
    os.environ[P2P_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(P2P_ENV, None)
        else:
            os.environ[P2P_ENV] = before


def _joined(store: dist.Store, rank: int, size: int, device: torch.device, seconds: float, name: str,
            staged: bool, gloo: bool = False) -> Any:
    """``_group``, with NCCL's peer-to-peer off when ``staged``: the communicator is made at once (a one-element
    all-reduce every rank runs) so that it reads the setting while it is set."""
    with _p2p_off(staged):
        group = _group(store, rank, size, device, seconds, name, gloo)
        if staged and device.type == "cuda" and not gloo:
            group.allreduce([torch.zeros(1, device=device)]).wait()
    return group


def subgroup(store: dist.Store, members: tuple[int, ...], rank: int, device: torch.device, seconds: float,
             name: str, staged: bool, gloo: bool) -> Any:
    """The group of the ranks ``members`` (``rank``: one of them, in the whole group's numbering) over the whole
    group's store: only those ranks take part in making it. Its own collectives (a branch's sequence split) never
    wait for the other ranks'."""
    store = dist.PrefixStore(name, store)
    return _joined(store, members.index(rank), len(members), device, seconds, name, staged, gloo)


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


def launcher(component: str, devices: tuple[torch.device, ...]) -> Any:
    """What starts the workers on ``devices``, as ``PIPEMAP_WORKERS`` says: child processes, or Ray actors."""
    if workers_mode() == "ray":
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


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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


@dataclass(frozen=True)
class Raised:
    """An exception a worker's call raised that its caller expects (``Workers.send(expected=...)``)."""

    kind: str
    message: str


@dataclass(eq=False)  # one call is itself only (``Workers.outstanding``)
class Call:
    """A call sent to the workers, its outputs not yet received."""

    ranks: list[_Rank]
    works: list = field(default_factory=list)


class Workers:
    """The worker processes of one component: one per device of ``devices``, ranks 1.. of a group with this
    process. ``start`` launches them, ``sync`` brings their copies in line with the component, ``send``/``receive``
    run a call, ``close`` stops them all; a failure anywhere stops them all too (``WorkerDiedError``), and the next
    ``sync`` starts new ones."""

    def __init__(self, component: str, home: torch.device, devices: tuple[torch.device, ...]):
        self.component, self.home, self.devices = component, home, devices
        self.ranks: list[_Rank] = []
        self.group: Any = None  # a ProcessGroup with a gloo or NCCL backend (``_group``)
        self.name = ""  # the group's name: its subgroups' names start with it
        self.subgroups: list[Any] = []  # rank 0's subgroups (``split``): forgotten at close
        self.store: dist.TCPStore | None = None
        self.outstanding: list[Call] = []  # calls sent whose outputs were not received yet, oldest first
        self.served: list[int] = []  # the pid of the process that computed each output received (tests read it)
        self.sent: list[int] = []  # per worker synced last: how many tensors it was sent (the others it kept)
        self.staged = False  # the copy check staged a pair of these ranks: they exchange through host memory
        self.gloo = False  # two ranks share a GPU (``shared_gpu``): gloo carries the tensors, through the host
        self.wire = home  # where rank 0's tensors travel from (``wire``)
        self.hellos: list[dict] = []  # per worker started last: what it reported at start (tests read it)
        self.launcher: Any = None  # what started them (``launcher``): it frees what it holds at close

    @property
    def running(self) -> bool:
        return bool(self.ranks) and all(_alive(r) for r in self.ranks)

    def pids(self) -> list[int]:
        return [r.pid for r in self.ranks]

    def describe(self) -> str:
        """One line for an explanation: the ranks' devices and how they exchange (the copy check's verdict)."""
        devices = ", ".join(str(d) for d in (self.home, *self.devices))
        if self.gloo:
            return (f"{self.component!r}: ranks on {devices}, two on one GPU: exchanging through host memory over "
                    "gloo (NCCL takes one rank per GPU)")
        if not self.staged:
            return f"{self.component!r}: ranks on {devices}, exchanging directly"
        how = "NCCL with peer-to-peer off" if self.home.type == "cuda" else "gloo, through the host anyway"
        return (f"{self.component!r}: ranks on {devices}, exchanging through host memory ({how}): the copy check "
                "found a pair of these devices corrupting direct copies")

    # -- lifetime --

    def start(self, source: Source) -> None:
        self.close()
        seconds = timeout_s()
        size = 1 + len(self.devices)
        name = self.name = f"pipemap-{self.component}-{os.getpid()}-{next(_NAMES)}"
        self.staged = staged = staged_ranks((self.home, *self.devices))
        self.gloo = gloo = shared_gpu((self.home, *self.devices))
        self.wire = wire(self.home, gloo)
        try:
            self.launcher = launcher(self.component, self.devices)
            host = self.launcher.host
            port = _free_port(host)
            self.store = dist.TCPStore(host, port, size, is_master=True,
                                       timeout=datetime.timedelta(seconds=seconds), wait_for_workers=False)
            for index, device in enumerate(self.devices):
                start = Start(index + 1, size, host, port, str(device), source, seconds, name, staged, gloo)
                handle, pipe = self.launcher.launch(self.component, start, index)
                self.ranks.append(_Rank(index + 1, device, handle, pipe, handle.pid))
            self.hellos = []
            for r in self.ranks:  # each has loaded its copy from the folder: only now join the group
                hello = self._receive(r, "start")
                r.pid = hello["pid"]
                r.process.greet(hello)
                self.hellos.append(hello)
            self.group = _joined(self.store, 0, size, self.home, seconds, name, staged, gloo)
        except BaseException:
            self.close()
            raise

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
                mine = self._guarded(functools.partial(subgroup, store, members, 0, self.home, timeout_s(), name,
                                                       self.staged, self.gloo), None, "sync")
                self.subgroups.append(mine)
        for r in self.ranks:
            self._receive(r, "sync")
        return mine

    def send(self, parts: list[tuple[tuple, dict]], state: tuple, reply: bool | tuple[bool, ...] = True,
             expected: tuple[type, ...] = (), to: tuple[int, ...] = ()) -> Call:
        """Start one call per worker: ``parts[i]`` (args, kwargs) to rank i + 1 (to rank ``to[i]`` where given),
        under the caller's ``state``. A call to any of these ranks whose outputs nobody asked for (a guidance branch
        started ahead and missed) is received first; calls to other ranks run on. ``reply=False`` (per part where a
        tuple): the outputs stay in the workers (a sequence split's ranks each hold the gathered whole); an exception
        of a class in ``expected`` comes back as a ``Raised`` output, the workers kept."""
        ranks = [self.ranks[i - 1] for i in to] if to else self.ranks[:len(parts)]
        while True:
            earlier = next((c for c in self.outstanding if any(r in ranks for r in c.ranks)), None)
            if earlier is None:
                break
            self.receive(earlier)
        call = Call(ranks)
        self.outstanding.append(call)
        replies = reply if isinstance(reply, tuple) else (reply,) * len(parts)
        for r, part, answer in zip(call.ranks, parts, replies):
            data, tensors, names = r.inputs.packed(part)
            self._post(r, ("call", data, metas(tensors), names, state, answer, expected), "call")
            call.works += self._guarded(functools.partial(_send, self._live_group(), tensors, r.rank, self.wire),
                                        r, "call")
        return call

    def receive(self, call: Call) -> list:
        """Each worker's output of ``call``, in rank order, on the home device."""
        if call not in self.outstanding:
            raise RuntimeError("this call's outputs were received already, or its workers stopped since")
        self.outstanding.remove(call)
        try:
            self._finish(call.works, None, "call")
            return [self._output(r, call.ranks) for r in call.ranks]
        except BaseException:
            self.close()
            raise

    def _output(self, r: _Rank, peers: list[_Rank]):
        data, wanted, pid = self._receive(r, "call", peers)
        self.served.append(pid)
        tensors = self._guarded(functools.partial(_receive_tensors, self._live_group(), wanted, r.rank, self.home,
                                                  self.wire), r, "call")
        return unpacked(data, tensors)

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

    def _receive(self, r: _Rank, phase: str, peers: list[_Rank] | None = None):
        """The worker's next answer: waited for while it and its ``peers`` in this call live (a rank waiting in a
        collective for a dead peer would wait out the group's timeout), for at most the timeout."""
        deadline = time.monotonic() + timeout_s()
        while not r.pipe.poll(_POLL_S):
            gone = next((p for p in (r, *(peers or ())) if not _alive(p)), None)
            if gone is not None:
                raise self._died(gone, phase)
            if time.monotonic() > deadline:
                raise self._died(r, phase, timed_out=True)
        try:
            kind, *rest = r.pipe.recv()
        except (EOFError, OSError) as err:
            raise self._died(r, phase) from err
        if kind == "error":
            self.close()
            raise WorkerCallError(self.component, str(r.device), r.pid, phase, rest[0])
        return rest[0]

    def _finish(self, works: list, r: _Rank | None, phase: str) -> None:
        for work, _tensor in works:
            self._guarded(work.wait, r, phase)

    def _guarded(self, run, r: _Rank | None, phase: str):
        try:
            return run()
        except WorkerDiedError:
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
                devices: tuple[torch.device, ...]) -> Workers:
    """The workers of ``module`` (made now, none started, if it has none or they serve other devices): they
    outlive a new hook over the module (a followed change keeps them, ``sync`` sends what changed) and stop with
    ``stop_workers`` or when the module is collected."""
    with _LOCK:
        found = _ALL.get(module)
        if found is not None and (found.home, found.devices) == (home, devices):
            return found
        if found is not None:
            found.close()
        made = _ALL[module] = Workers(component, home, devices)
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
    derive from, ``thread_hook``): the thread hook on the dry run's stand-ins, the workers stopped at reset, their
    process ids."""

    thread_hook: type
    workers: Workers | None
    _module: Any = None  # a weak reference to the component: new workers are given it after a death
    component: str  # the hook's own (``PlacementHook``, ``CopiesHook``)
    device: torch.device
    replica_devices: tuple[torch.device, ...]

    @classmethod
    def for_placement(cls, p, execution_device: str, ledger):
        """The hook of this mode's placement on workers; the threads' hook on the dry run's stand-ins."""
        hook = cls.thread_hook if on_standins(p) else cls
        return hook(p.component, p.device, execution_device, p.replicas)

    def release(self, module) -> None:
        """Stop this component's worker processes (``dispatch.reset``)."""
        stop_workers(module)

    def pids(self) -> list[int]:
        """The process ids of the workers running now."""
        return self.workers.pids() if self.workers is not None and self.workers.running else []

    def attach_workers(self, module: torch.nn.Module) -> Workers:
        """The component's workers (``workers_for``: kept across hooks over it), brought up for this hook."""
        self._module = weakref.ref(module)
        workers = self.workers = workers_for(module, self.component, self.device, self.replica_devices)
        self.bring_up(module)
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
    """A worker process: load the copy, join the group, then answer rank 0's messages until told to stop or until
    rank 0 is gone (its end of ``pipe`` closed; where ``parent`` is rank 0's pid, also when this process's parent
    changes: a child process outlives nothing of its parent's)."""
    if parent is not None:
        _watch(parent)
    device = torch.device(start.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        module = start.source.load(device)
    except Exception:  # files it cannot read alone (a variant's names, say): every tensor is then sent
        module = None
    with _p2p_off(start.staged):
        hello = {"pid": os.getpid(), "host": socket.gethostname(), "staged": start.staged, "gloo": start.gloo,
                 P2P_ENV: os.environ.get(P2P_ENV)}
    pipe.send(("ready", hello))
    store = dist.TCPStore(start.host, start.port, start.size, is_master=False,
                          timeout=datetime.timedelta(seconds=start.seconds))
    group = _joined(store, start.rank, start.size, device, start.seconds, start.name, start.staged, start.gloo)
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
        except Exception:
            pipe.send(("error", traceback.format_exc()))


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
        self.part = subgroup(self.store, members, rank, self.device, start.seconds, name, start.staged, start.gloo)
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
    """What of the caller's per-thread state a worker's call runs under: grad and inference mode, autocast."""
    autocast = tuple((kind, torch.get_autocast_dtype(kind)) for kind in ("cpu", "cuda")
                     if torch.is_autocast_enabled(kind))
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast)


@contextlib.contextmanager
def entered(state: tuple, device: torch.device):
    grad, inference, autocast = state
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.set_grad_enabled(grad))
        if inference:
            stack.enter_context(torch.inference_mode())
        for kind, dtype in autocast:
            stack.enter_context(torch.autocast(kind, dtype=dtype))
        if device.type == "cuda":
            stack.enter_context(torch.cuda.device(device))
        yield
