"""What starts a split's worker processes (``workers.launcher``): a child of the caller's process forked by a
forkserver that imported torch, diffusers and pipemap once (``_Spawn``, ``ranks="process"``; spawned where no
forkserver exists), or a Ray actor (``ray_workers.RayLauncher``, ``ranks="ray"``); each gives a
handle to watch and stop the worker, and rank 0's end of its connection. Also the bound every wait on a worker has
(``timeout_s``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing
import multiprocessing.connection
import multiprocessing.spawn
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import WorkersOptionError
from .worker import Start, serve

TIMEOUT_ENV = "PIPEMAP_WORKER_TIMEOUT"


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
    """Starts each worker as a child process (forkserver, else ``spawn``): ``PIPEMAP_WORKERS=process``."""

    host = "127.0.0.1"

    def launch(self, component: str, start: Start, index: int) -> tuple[_Spawned, Any]:
        """Worker ``index`` (0 for rank 1) started; its handle and rank 0's end of its pipe."""
        context = _context(start.source.module)
        ours, theirs = context.Pipe()
        # the caller's environment as it is now: a forkserver's children inherit the server's, read once at its start
        process = context.Process(target=serve, name=f"pipemap-{component}-rank{start.rank}", daemon=True,
                                  args=(start, theirs, os.getpid(), dict(os.environ)))
        with _without_main(), _nvml_check():
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

START_ENV = "PIPEMAP_WORKER_START"  # "forkserver" (the default where the platform has one) or "spawn"
# what every worker imports before it says it lives: its own loop (torch, torch.distributed, diffusers' utils and
# torch._dynamo through pipemap.hooks) and what loading any diffusers model needs (safetensors, accelerate)
PRELOAD = ("pipemap.hooks.worker", "pipemap.hooks.sequence", "diffusers.models.modeling_utils")


def start_method() -> str:
    """How worker processes start (``PIPEMAP_WORKER_START``): ``forkserver`` where the platform has it, or
    ``spawn``."""
    text = os.environ.get(START_ENV, "").strip().lower()
    methods = tuple(m for m in ("forkserver", "spawn") if m in multiprocessing.get_all_start_methods())
    if not text:
        return methods[0]
    if text not in methods:
        raise WorkersOptionError(START_ENV, text, methods)
    return text


def _context(module: str) -> Any:
    """The multiprocessing context workers start in. ``spawn`` starts a fresh interpreter per worker, which imports
    torch, diffusers and pipemap again before it can say it lives: 5-15 s of CPU each start on 2 cores, the larger
    part of a split's start and of the worker tests' time. A forkserver pays that once per caller: a fresh
    interpreter (started as ``spawn`` starts one, so nothing of the caller's state, CUDA included, is in it) imports
    ``PRELOAD`` and the first component's model module, then forks each worker from itself. It never initialises
    CUDA: torch initialises it lazily, at the first call that needs a device, and importing torch, diffusers and
    pipemap makes none (none of them calls ``torch.cuda`` at module level), so each forked worker initialises CUDA
    itself, as a spawned one does. What the server cannot give a worker is the caller's environment of now: the
    worker is handed it (``serve``'s ``environ``). ``fork`` is never used: a fork of the caller would carry its
    CUDA state."""
    method = start_method()
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        # read when the server starts (the first worker of this process): later calls change nothing
        context.set_forkserver_preload([*PRELOAD, module])
    return context


NVML_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"


@contextlib.contextmanager
def _nvml_check():
    """torch's CUDA check by NVML while a worker starts, so that the forkserver, which starts with the first worker
    and inherits this environment then, answers ``torch.cuda.is_available()`` in a module it imports without
    initialising CUDA (which a forked worker could not use). The worker itself runs with the caller's environment
    (``serve``'s ``environ``), and the caller's is as it was after the start."""
    before = os.environ.get(NVML_ENV)
    os.environ[NVML_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(NVML_ENV, None)
        else:
            os.environ[NVML_ENV] = before


@contextlib.contextmanager
def _without_main():
    """A start without the caller's main script: by default a spawned (or forkserver's) child first runs the
    parent's ``__main__`` file again (the reason scripts need ``if __name__ == "__main__":``), so ``pipe(prompt)`` at
    the top of a script would run again in each worker. A worker needs none of it: its target is a function of
    ``worker.py``."""
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


