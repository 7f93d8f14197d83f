"""A process per device for a split denoiser: the caller's process is rank 0 and keeps the pipeline (its ``__call__``
unchanged, no launcher); each other device a split denoiser uses gets a worker process of its own (forked by a
forkserver that imported torch and diffusers once, or spawned: ``launch.py``), rank 1, 2, ... of a
``torch.distributed`` process group with rank 0 (NCCL between GPUs, gloo on the CPU), which holds its own copy of
the component and runs the calls rank 0 sends it.

Why processes: the ranks as threads of the caller's process (``threads.py``) share its GIL and each
other's CUDA streams (issue 34). Here each rank launches its own kernels on its own streams, and the only traffic is
the call's inputs going out and its outputs coming back.

What travels, and how (``payload.py``):

- a small header through a pipe per worker (``multiprocessing.Pipe``): what to do and the call's structure,
  pickled with every tensor left out (``payload.Pickler``: a tensor is pickled as its place in the list sent);
- the tensors through the process group (``groups.py``), point to point, each rank on its own device;
- the worker's copy of the component: first loaded by the worker from the pipeline folder's safetensors files
  (``worker.Source``), then brought in line with rank 0's model (``Workers.sync``): the module's structure pickled
  without its tensors, each tensor named by where it sits, and a tensor sent only where the worker's own differs (a
  hash of its bytes, ``payload.digest``). No weight is ever pickled. What cannot travel (a diffusers hook's closure,
  a class of the caller's ``__main__``) is found before any worker starts (``travel_problem``).

The modules: ``workers.py`` (this one: rank 0's end, the workers of each component; ``Workers`` is the seam's
``ranks.Ranks`` for processes, as ``threads.ThreadRanks`` is for threads), ``worker.py`` (a worker's end:
``serve``, the caller's state and numerics a call runs under), ``groups.py`` (process groups: transports, the
bring-up check, loopback listening), ``payload.py`` (what travels), ``launch.py`` (what starts a worker: a forked or
spawned child, or a Ray actor, ``ray_workers.py``; the waits' bound).

Waits are bounded: rank 0 polls each pipe with the worker's liveness checked (``_receive``) and a deadline
(``PIPEMAP_WORKER_TIMEOUT``, seconds, default 120; a first copy's load has a bound of its own, ``load_bound``); the
group's own timeout is the same. A worker that dies raises ``WorkerDiedError`` (the workers of that component are
stopped; the next call starts new ones); an exception in a worker's call raises ``WorkerCallError`` with its
traceback (an out-of-memory error as ``torch.OutOfMemoryError`` naming the worker's device). Inside a sequence split,
where rank 0 waits in collectives on every rank, a watcher (``Workers.watching``) interrupts the group at a worker's
error or death, so that error is raised at once, not the group's timeout. Workers stop when the component is reset
(``stop_workers``, called by ``dispatch.reset``), when a dispatch fails, when the component is garbage-collected, at
the interpreter's exit (``atexit``), and by themselves when rank 0's process dies.

Which runtime runs a split's ranks is the plan's ``ranks`` (``modes.RANKS``; ``pipemap.plan(..., ranks=)``):
``"auto"`` (the default) means worker processes (``PIPEMAP_WORKERS`` where set says otherwise). Under ``"auto"`` a
component that cannot travel (``travel_problem``), or a group that fails its bring-up check, runs on threads instead,
with a ``RanksFallbackWarning`` (``copies.CopiesHook.attach_ranks``); named by the user, it is an error. ``"ray"`` is
the same with each worker a Ray actor: only the start differs (``launch.launcher``).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import importlib.util
import io
import itertools
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..errors import (
    RanksSelfTestError,
    WorkerCallError,
    WorkerDiedError,
    WorkersOptionError,
)
from ..modes import RANKS, resolve_ranks
from .calls import replica
from .groups import (
    GROUP_NAMES,
    forget,
    joined,
    listener,
    nccl_transport,
    receive_tensors,
    send_tensors,
    shared_gpu,
    staged_ranks,
    subgroup,
    wire,
)
from .launch import launcher, timeout_s
from .payload import Inputs, Pickler, Raised, digest, metas, named_tensors, packed, unpacked
from .worker import Source, Start, caller_state

ENV = "PIPEMAP_WORKERS"
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
    pickler = Pickler(io.BytesIO())
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


def _alive(r: _Rank) -> bool:
    return r.process.alive()


START_S = 120.0  # the least a worker's interpreter gets to start and import torch: a minute on a busy 2-core host


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
                 runtime: str | None = None):
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
        self.watcher: Watcher | None = None  # watches a split call's workers (``watching``)

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
            way = "over gloo: this torch has no NCCL" if self.home.type == "cuda" and self.gloo else "directly"
            return f"{self.component!r}: ranks on {devices}, exchanging {way}"
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
        name = self.name = f"pipemap-{self.component}-{os.getpid()}-{next(GROUP_NAMES)}"
        self.staged = staged = staged_ranks((self.home, *self.devices))
        shared = shared_gpu((self.home, *self.devices))
        self.transport = "shared" if shared else nccl_transport(staged, self.home.type == "cuda")
        self.gloo = gloo = self.transport in ("shared", "gloo")
        self.wire = wire(self.home, gloo)
        try:
            self.launcher = launcher(self.component, self.devices, self.runtime or workers_mode())
            host = self.host = self.launcher.host
            server = listener(host)
            port = server.getsockname()[1]
            self.store = dist.TCPStore(host, port, size, is_master=True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=seconds), master_listen_fd=server.detach())
            for index, device in enumerate(self.devices):
                start = Start(index + 1, size, host, port, str(device), source, seconds, name, staged, gloo)
                handle, pipe = self.launcher.launch(self.component, start, index)
                self.ranks.append(_Rank(index + 1, device, handle, pipe, handle.pid))
            self.hellos = []
            started = time.monotonic() + max(timeout_s(), START_S)
            for r in self.ranks:  # alive, before its load: an interpreter started and torch imported
                hello = self._receive(r, "start", until=started)
                r.pid = hello["pid"]
                r.process.greet(hello)
                self.hellos.append(hello)
            bound = time.monotonic() + load_bound(source, len(self.ranks))
            for r in self.ranks:  # each has loaded its copy from the folder: only now join the group
                self._receive(r, "load", until=bound)
            self.group = self.joined(joined, self.store, 0, size, self.home, seconds, name, gloo, host)
        except BaseException:
            self.close()
            raise

    def joined(self, make, *args) -> Any:
        """A group made and checked (``joined``): a wrong result is ``RanksSelfTestError`` naming the component."""
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
                forget(group)
        self.group = self.store = self.launcher = None
        self.subgroups = []
        if self.watcher is not None:
            self.watcher.close()
            self.watcher = None
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
        names = named_tensors(plain)
        self.sent = []
        for r in self.ranks:
            theirs = self._ask(r, ("digests",), "sync")
            keep = {id(t): n for n, t in names.items()
                    if theirs.get(n) == (tuple(t.shape), t.dtype, digest(t))}
            data, sent = packed(plain, keep)
            self.sent.append(len(sent))
            r.pipe.send(("module", data, metas(sent)))
            self._finish(send_tensors(self._live_group(), sent, r.rank, self.wire), r, "sync")
            self._receive(r, "sync")

    def held(self) -> list[int]:
        """Per worker: the bytes its copy's parameters and buffers hold (on its device; the plan's figure for it)."""
        return [self._ask(r, ("held",), "sync") for r in self.ranks]

    def peaks(self) -> dict[str, int]:
        """Per worker's device: the most bytes its CUDA allocator held since the last ask (0 on the CPU), what
        rank 0's allocator cannot see (WP9)."""
        return {str(r.device): self._ask(r, ("peak",), "call") for r in self.ranks}

    # -- the seam (``ranks.Ranks``): what a mode's hook asks of its ranks --

    def bring_up(self, module: torch.nn.Module) -> None:
        """Each worker's copy made equal to ``module`` (its hooks left here), workers started where none runs."""
        self.sync(plain_copy(module), Source.of(module))

    def split(self, module: torch.nn.Module, halves: tuple[tuple[int, ...], ...] = ()) -> torch.nn.Module | None:
        """Each worker's copy made its rank of a sequence split (``split_group``); rank 0's, a copy of ``module``
        here sharing its weights, made anew over the new group too (None where rank 0 is in none of ``halves``)."""
        from .context import enable_split

        group = self.split_group(halves)
        if group is None:
            return None
        home = plain_copy(module)
        enable_split(home, 0, group)
        return home

    def submit(self, parts: Sequence[tuple[tuple, dict]], to: tuple[int, ...] = (),
               reply: bool | tuple[bool, ...] = True, expected: tuple[type, ...] = ()) -> Sent:
        return Sent(self, self.send(list(parts), caller_state(), reply, expected, to), expected)

    def together(self, pending: Any, home: Callable[[], Any]) -> Any:  # a ``Sent``
        """``home`` run here while the workers of ``pending`` run their shares, watched (``watching``): a worker's
        error or death inside the split ends rank 0's share at once and is what is raised (its traceback, typed),
        rank 0's own error otherwise; either stops the workers (ranks left inside an exchange: new ones at the next
        call). ``Unsplittable`` where the tokens do not divide: every rank met it at the same layer, before any
        exchange (the workers are kept where each raised it too)."""
        call = pending.call
        seen: list[BaseException] = []
        try:
            with self.watching(call) as seen:
                output = home()
        except tuple(pending.expected):
            answers = self.receive(call)
            if not all(isinstance(a, Raised) for a in answers):
                self.close()
            raise
        except BaseException as err:
            cause = self.failure(call, seen)
            if cause is not None:
                raise cause from err
            raise
        if seen:  # a worker failed after rank 0's share was done
            raise self.failure(call, seen) or seen[0]
        self.receive(call)
        return output

    # -- calls --

    def split_group(self, halves: tuple[tuple[int, ...], ...] = ()) -> Any:
        """Make each worker's copy its rank of a sequence split (``context.enable_split``) over the whole group, or
        over its own of ``halves`` (disjoint lists of ranks, each a group of its own: ``subgroup``); rank 0's group
        (None where rank 0 is in none of them)."""
        if not halves:
            for r in self.ranks:
                self._ask(r, ("split", r.rank, None, ""), "sync")
            return self.group
        for group in self.subgroups:  # a split made anew (a followed change): the halves' last groups go
            forget(group)
        self.subgroups = []
        names = [f"{self.name}-part{next(GROUP_NAMES)}" for _ in halves]
        for r in self.ranks:  # every member asked before any joins: making a group waits for all its members
            members, name = next((m, n) for m, n in zip(halves, names) if r.rank in m)
            self._post(r, ("split", r.rank, members, name), "sync")
        mine, store = None, self.store
        assert store is not None  # set by start, before any sync
        for members, name in zip(halves, names):
            if 0 in members:
                mine = self.joined(subgroup, store, members, 0, self.home, timeout_s(), name, self.gloo, self.host)
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
                call.works += self._guarded(functools.partial(send_tensors, self._live_group(), tensors, r.rank,
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
        tensors = self._guarded(functools.partial(receive_tensors, self._live_group(), wanted, r.rank, self.home,
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
        if self.watcher is None:
            self.watcher = Watcher(self)
        self.watcher.arm(call, seen)
        try:
            yield seen
        finally:
            self.watcher.disarm()

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


class Watcher:
    """One thread per ``Workers`` that watches a split call's ranks while it is armed (``Workers.watching``): a
    thread started per call cost a split call of a small model about 2 ms of wall time on a busy host. A check runs
    under the lock ``disarm`` takes, so once ``disarm`` returns the thread reads no pipe of the call."""

    def __init__(self, workers: Workers):
        self.workers = workers
        self.cond = threading.Condition()
        self.armed: tuple[Call, list[BaseException]] | None = None
        self.closed = False
        self.thread = threading.Thread(target=self._run, name=f"pipemap-{workers.component}-watch", daemon=True)
        self.thread.start()

    def arm(self, call: Call, seen: list[BaseException]) -> None:
        with self.cond:
            self.armed = (call, seen)
            self.cond.notify()

    def disarm(self) -> None:
        with self.cond:
            self.armed = None

    def close(self) -> None:
        with self.cond:
            self.closed, self.armed = True, None
            self.cond.notify()

    def _run(self) -> None:
        while True:
            with self.cond:
                while self.armed is None and not self.closed:
                    self.cond.wait()
                if self.closed or self.armed is None:
                    return
                call, seen = self.armed
                found = self.workers._failed(call)
                if found is not None:
                    seen.append(found)
                    self.armed = None
            if found is not None:
                self.workers.interrupt()  # outside the lock: it kills the workers, and ``close`` may wait
            time.sleep(_POLL_S)


class Sent:
    """A call sent to the workers (``Workers.submit``): ``ranks.Pending``. An expected exception a worker met (a
    share that does not divide) is raised as itself (the workers kept: each met it at the same layer)."""

    def __init__(self, workers: Workers, call: Call, expected: tuple[type, ...]):
        self.workers, self.call, self.expected = workers, call, expected

    def result(self) -> list:
        outputs = self.workers.receive(self.call)
        raised = next((o for o in outputs if isinstance(o, Raised)), None)
        if raised is not None:
            raise next((c for c in self.expected if c.__name__ == raised.kind), self.expected[0])(raised.message)
        return outputs
