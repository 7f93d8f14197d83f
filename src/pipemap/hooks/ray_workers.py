"""``PIPEMAP_WORKERS=ray``: a split denoiser's worker processes as Ray actors, all in one placement group.

The driver logic is ``workers.py``'s, unchanged: rank 0 (the caller's process) starts the workers, brings their
copies in line, sends calls and receives outputs; each worker runs ``workers.serve``, the same loop a spawned child
runs. Only the start differs (``RayLauncher.launch``):

- one placement group holds the workers, one bundle each, ``STRICT_PACK``: all on one node, as the ranks of one
  process group on GPUs must be. A bundle asks for a CPU, and a GPU where its rank runs on one and rank 0 holds no
  Ray GPUs itself (a driver script). Inside a Ray Serve replica deployed with bundles (``serve --ray`` with
  ``PIPEMAP_WORKERS=ray``: bundle 0 the replica's, then one per worker) the replica's own placement group is used.
- every rank sees rank 0's GPUs (its ``CUDA_VISIBLE_DEVICES``): the plan's ``cuda:1`` is the GPU rank 0 means by it.
  A replica holds every GPU its plan uses (``deployment.gpus``), text encoders and VAE included, so its workers'
  bundles ask for none and share the replica's; Ray's GPU count is a reservation, not the binding.
- rank 0's end of the control channel is a socket it listens on (Ray gives no pipe between processes): the actor
  connects, proves itself with a token sent to it through Ray, then speaks ``multiprocessing``'s connection
  protocol, as a spawned child's pipe does. Tensors go through the process group, as with spawned workers.

Why Ray: it is how a user goes past one machine (Ray Serve replicas of whole multi-GPU plans, across nodes), and a
Ray cluster is where its resources are accounted. Lifetime: the actors stop with the workers (``Workers.close``),
and Ray ends them with their owner's process; the placement group pipemap made is removed at close.
"""

from __future__ import annotations

import hmac
import multiprocessing.connection
import os
import secrets
import socket
from collections.abc import Callable
from typing import Any

import psutil
import ray
import torch
from ray.util.placement_group import get_current_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..errors import RayPlacementError

_TOKEN_BYTES = 32
_TOKEN_WAIT_S = 5.0  # how long a connection may take to send its token before it is closed


def ray_init_options(address: str | None, public: bool) -> dict:
    """``ray.init``'s arguments: a cluster's address as given; a local Ray on loopback unless ``public``."""
    options: dict = {"address": address, "ignore_reinit_error": True}
    if address is None and not public:
        options.update(_node_ip_address="127.0.0.1", dashboard_host="127.0.0.1")
    return options


class RankActor:
    """A worker as a Ray actor: ``run`` connects to rank 0 and serves it until stopped (``workers.serve``); ``pid``
    answers beside it (two calls at once: ``max_concurrency=2``)."""

    def run(self, address: tuple[str, int], token: bytes, start: Any, visible: str | None,
            serve: Callable[[Any, Any, int | None], None]) -> int:
        """``serve`` (``workers.serve``, passed in: ``workers`` picks its launcher, so this module imports it not)
        run with ``start`` (a ``workers.Start``) over the connection to rank 0 at ``address``."""
        if visible is not None:  # before CUDA starts in this process: the plan's device numbers are rank 0's
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
        sock = socket.create_connection(address, timeout=start.seconds)
        sock.settimeout(None)
        connection = multiprocessing.connection.Connection(sock.detach())
        try:
            connection.send_bytes(token)
            serve(start, connection, None)  # ends when told to stop, or when rank 0's end closes
        finally:
            connection.close()
        return os.getpid()

    def pid(self) -> int:
        return os.getpid()


_REMOTE_RANK: Any = ray.remote(RankActor)  # made once: each ``ray.remote`` of the class would export it anew


class Actor:
    """A worker actor as rank 0 watches and stops it (``workers._Spawned`` is the other kind)."""

    def __init__(self, actor: Any, running: Any):
        self.actor, self.running = actor, running  # the handle, and the reference of its ``run``
        self.pid = 0  # known from its hello
        self.here = False  # whether it runs on this machine (its hello says)

    @property
    def exitcode(self) -> int | None:
        return None  # an actor has none to give

    def greet(self, hello: dict) -> None:
        self.pid, self.here = hello["pid"], hello.get("host") == socket.gethostname()

    def alive(self) -> bool:
        """Ray tells an actor's death a while after it happened; on this machine its process tells at once."""
        done, _ = ray.wait([self.running], timeout=0)
        return not done and (not self.here or psutil.pid_exists(self.pid) and not _zombie(self.pid))

    def join(self, timeout: float) -> None:
        ray.wait([self.running], timeout=timeout)

    def kill(self) -> None:
        """End the actor now (a rank failed inside a collective: ``Workers.interrupt``)."""
        ray.kill(self.actor, no_restart=True)

    def stop(self) -> None:
        """Wait for ``run`` to end (it was asked to), then end the actor."""
        ray.wait([self.running], timeout=5)
        ray.kill(self.actor, no_restart=True)


class Channel:
    """Rank 0's end of a worker actor's connection: accepted once the actor connects and sends its token (waited
    for in ``poll``, bounded as every wait on a worker is); then a ``multiprocessing`` connection."""

    def __init__(self, listener: socket.socket, token: bytes):
        self.listener, self.token = listener, token
        self.connection: Any = None

    def poll(self, timeout: float) -> bool:
        if self.connection is None:
            self._accept(timeout)
            return self.connection is not None and self.connection.poll(0)
        return self.connection.poll(timeout)

    def recv(self) -> Any:
        return self._connected().recv()

    def send(self, message: Any) -> None:
        self._connected().send(message)

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()
        self.listener.close()

    def _connected(self) -> Any:
        if self.connection is None:
            raise OSError("the worker actor has not connected")
        return self.connection

    def _accept(self, timeout: float) -> None:
        """One connection, taken if it sends this channel's token first (anything else is closed, unread)."""
        self.listener.settimeout(timeout)
        try:
            sock, _ = self.listener.accept()
        except TimeoutError:
            return
        sock.settimeout(None)
        connection = multiprocessing.connection.Connection(sock.detach())
        try:
            token = connection.recv_bytes(_TOKEN_BYTES) if connection.poll(_TOKEN_WAIT_S) else b""
        except (OSError, EOFError):
            token = b""
        if hmac.compare_digest(token, self.token):
            self.connection = connection
        else:
            connection.close()


class RayLauncher:
    """Starts each worker as a Ray actor in one placement group (see the module's docstring); ``host`` is where
    rank 0 listens and keeps its store: this node's address, which every actor of the group can reach."""

    def __init__(self, component: str, devices: tuple[torch.device, ...], seconds: float,
                 serve: Callable[[Any, Any, int | None], None]):
        self.serve = serve  # ``workers.serve``: each actor's loop
        if not ray.is_initialized():  # a local Ray, on loopback, unless RAY_ADDRESS names a cluster
            ray.init(**ray_init_options(os.environ.get("RAY_ADDRESS"), public=False), log_to_driver=False)
        self.host = ray.util.get_node_ip_address()
        self.visible = _visible() if any(d.type == "cuda" for d in devices) else None
        current = get_current_placement_group()
        if current is not None and len(current.bundle_specs) > len(devices):
            self.group, self.first, self.owned = current, 1, False  # a replica's: bundle 0 is the replica's own
        else:
            self.bundles = [_bundle(d) for d in devices]
            self.group, self.first, self.owned = placement_group(self.bundles, strategy="STRICT_PACK"), 0, True
            ready, _ = ray.wait([self.group.ready()], timeout=seconds)
            if not ready:
                available = ray.available_resources()
                self.close()
                raise RayPlacementError(component, self.bundles, available, seconds)

    def launch(self, component: str, start: Any, index: int) -> tuple[Actor, Channel]:
        """Worker ``index`` (0 for rank 1) started in its bundle; its handle and rank 0's end of its channel."""
        listener = socket.create_server((self.host, 0))
        token = secrets.token_bytes(_TOKEN_BYTES)
        bundle = self.group.bundle_specs[self.first + index]
        actor: Any = _REMOTE_RANK.options(
            name=None, max_restarts=0, max_concurrency=2, num_cpus=bundle.get("CPU", 0),
            num_gpus=bundle.get("GPU", 0), scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=self.first + index)).remote()
        running = actor.run.remote(listener.getsockname()[:2], token, start, self.visible, self.serve)
        return Actor(actor, running), Channel(listener, token)

    def close(self) -> None:
        if self.owned:
            remove_placement_group(self.group)
            self.owned = False


def _bundle(device: torch.device) -> dict[str, float]:
    """One worker's bundle: a CPU, and its GPU where rank 0 holds no Ray GPUs of its own (see the docstring)."""
    if device.type == "cuda" and not ray.get_gpu_ids():
        return {"CPU": 1.0, "GPU": 1.0}
    return {"CPU": 1.0}


def _visible() -> str:
    """Rank 0's GPUs, as ``CUDA_VISIBLE_DEVICES`` names them (all of this machine's where it is not set)."""
    found = os.environ.get("CUDA_VISIBLE_DEVICES")
    if found is not None:
        return found
    return ",".join(str(i) for i in range(torch.cuda.device_count()))


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
