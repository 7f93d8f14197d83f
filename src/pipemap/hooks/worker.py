"""A worker process's end of a split (``workers.py`` is rank 0's): what it is started with (``Start``, ``Source``:
where it loads its first copy), its loop (``serve``: say it lives, load, join the group, answer rank 0's messages),
and the caller's state each call runs under (``caller_state``/``entered``: grad and inference mode, autocast, and
the process-wide numerics settings a thread rank shares and a process does not, ``numerics``).
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .groups import NCCL_ERRORS_ENV, P2P_ENV, forget, joined, receive_tensors, send_tensors, subgroup, wire
from .payload import Meta, Raised, digest, metas, named_tensors, packed, received_inputs, unpacked

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
        size = sum(t.numel() * t.element_size() for t in named_tensors(module).values())
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


# ---- a worker's end ----------------------------------------------------------------------------------------------


def serve(start: Start, pipe, parent: int | None, environ: dict[str, str] | None = None) -> None:
    """A worker process: say it lives, load the copy, join the group, then answer rank 0's messages until told to
    stop or until rank 0 is gone (its end of ``pipe`` closed; where ``parent`` is rank 0's pid, also when that
    process ends: a child process outlives nothing of its parent's). ``environ``: the caller's environment when it
    started this worker (a forkserver's child has the server's otherwise)."""
    if parent is not None:
        _watch(parent)
        # Ctrl-C in a terminal reaches every process of its group, these workers too: it is the caller's to handle
        # (rank 0 stops its workers, or they follow it when it exits), never a reason for a worker to die mid-split
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    setup = set_up()
    if start.staged:  # before this process's first communicator: NCCL reads it once per process (WP5)
        os.environ[P2P_ENV] = "1"
    os.environ.setdefault(NCCL_ERRORS_ENV, "2")  # a watchdog timeout aborts the communicator, not this process
    device = torch.device(start.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    hello = {"pid": os.getpid(), "host": socket.gethostname(), "staged": start.staged, "gloo": start.gloo,
             P2P_ENV: os.environ.get(P2P_ENV), "setup": setup}
    pipe.send(("ready", hello))  # alive: the load that follows has a bound of its own (WP7)
    try:
        module = start.source.load(device)
    except Exception:  # files it cannot read alone (a variant's names, say): every tensor is then sent
        module = None
    pipe.send(("loaded", module is not None))
    store = dist.TCPStore(start.host, start.port, start.size, is_master=False,
                          timeout=datetime.timedelta(seconds=start.seconds))
    group = joined(store, start.rank, start.size, device, start.seconds, start.name, start.gloo, start.host)
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


SETUP_ENV = "PIPEMAP_WORKER_SETUP"


def set_up() -> list[str]:
    """Call each ``module:function`` named in ``PIPEMAP_WORKER_SETUP`` (comma-separated), before anything else a
    worker does: what a caller's process installed that its workers need too. The tests' fake CUDA
    (``tests/fakecuda.py``) names itself there while installed, so a worker of a process under it runs its CUDA
    branches (its device set, its allocator's peaks, gloo in place of NCCL) on the fake too. The names called."""
    names = [n.strip() for n in os.environ.get(SETUP_ENV, "").split(",") if n.strip()]
    for name in names:
        module, _, function = name.partition(":")
        _import(module, function)()
    return names


def _watch(parent: int) -> None:
    """Exit this process when rank 0's process is gone, whatever this one is waiting on. A forkserver's child has
    the server for its parent, not rank 0: multiprocessing hands it a pipe end rank 0 holds open (``sentinel``),
    which reads as closed once rank 0's process ends, killed or not."""
    known = multiprocessing.parent_process()
    sentinel = known.sentinel if known is not None and known.pid == parent else None

    def watch() -> None:
        while True:
            if sentinel is not None:
                if multiprocessing.connection.wait([sentinel], timeout=0.5):
                    os._exit(0)
                continue
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
        answer = _ANSWERS.get(kind)
        if answer is None:
            raise ValueError(f"unknown message {kind!r}")
        answer(self, pipe, *rest)

    def _digests(self, pipe) -> None:
        held = named_tensors(self.module) if self.module is not None else {}
        pipe.send(("digests", {n: (tuple(t.shape), t.dtype, digest(t)) for n, t in held.items()}))

    def _held(self, pipe) -> None:
        """The bytes of the copy's parameters and buffers (what the plan counts on this device)."""
        held = named_tensors(self.module) if self.module is not None else {}
        pipe.send(("held", sum(t.numel() * t.element_size() for t in held.values())))

    def _peak(self, pipe) -> None:
        """The most its allocator held since the last ask: rank 0's cannot see it (WP9)."""
        cuda = self.device.type == "cuda"
        pipe.send(("peak", torch.cuda.max_memory_allocated(self.device) if cuda else 0))
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def _synced(self, pipe, data: bytes, wanted: list[Meta]) -> None:
        self._module(data, wanted)
        pipe.send(("synced", os.getpid()))

    def _split(self, pipe, rank: int, members: tuple[int, ...] | None, name: str) -> None:
        from .context import enable_split  # here: only a sequence split's worker loads the context-parallel code

        if self.module is None:
            raise RuntimeError("no copy of the component was sent to this worker")
        group = self.group if members is None else self._subgroup(rank, members, name)
        enable_split(self.module, rank if members is None else members.index(rank), group)
        pipe.send(("split", os.getpid()))

    def _answer_call(self, pipe, data: bytes, wanted: list[Meta], names: list[str], state: tuple, reply: bool,
                     expected: tuple[type[BaseException], ...]) -> None:
        try:
            output = self._call(data, wanted, names, state)
        except expected as err:  # the same on every rank (a sequence split's tokens that do not divide)
            output = Raised(type(err).__name__, str(err))
        if not reply and not isinstance(output, Raised):
            output = None
        data, tensors = packed(output)
        # the header first: rank 0 allocates from it, then receives the tensors
        pipe.send(("output", (data, metas(tensors), os.getpid())))
        for work, _tensor in send_tensors(self.group, tensors, 0, self.through):
            work.wait()

    def _subgroup(self, rank: int, members: tuple[int, ...], name: str) -> Any:
        start = self.start
        if start is None or self.store is None:
            raise RuntimeError("this worker was started without a store to make a subgroup over")
        if self.part is not None:
            forget(self.part)
        self.part = subgroup(self.store, members, rank, self.device, start.seconds, name, start.gloo, start.host)
        return self.part

    def _module(self, data: bytes, wanted: list[Meta]) -> None:
        received = receive_tensors(self.group, wanted, 0, self.device, self.through)
        kept = named_tensors(self.module) if self.module is not None else {}
        self.module = unpacked(data, received, kept).to(self.device).eval()

    def _call(self, data: bytes, wanted: list[Meta], names: list[str], state: tuple):
        received = receive_tensors(self.group, wanted, 0, self.device, self.through)
        (args, kwargs), self.inputs = received_inputs(data, received, names, self.inputs)
        if self.module is None:
            raise RuntimeError("no copy of the component was sent to this worker")
        with entered(state, self.device):
            return self.module(*args, **kwargs)


# what a worker answers to each kind of message of rank 0 (``Workers`` sends them)
_ANSWERS: dict[str, Any] = {"digests": _Worker._digests, "held": _Worker._held, "peak": _Worker._peak,
                            "module": _Worker._synced, "split": _Worker._split, "call": _Worker._answer_call}

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
    """``settings`` (``numerics``) in force in this process for the block, the worker's own back after it; where
    they are the worker's own already (the caller changed none: the usual call), nothing is set."""
    before = numerics()
    if settings == before:
        yield
        return
    _apply(settings)
    try:
        if settings.get("attention", before.get("attention")) != before.get("attention"):
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

