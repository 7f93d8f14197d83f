"""Guidance branches at once in a worker process (mode ``"guidance"`` with ``PIPEMAP_WORKERS=process``): each
step's second call predicted and started ahead exactly as ``guidance.GuidanceHook`` does it, but sent to the worker
process of the copy's device (``workers.py``), which runs it on its own copy while this process runs the first
branch; used only when the call that arrives has exactly its inputs (the exact-match speculation kept: the pipeline's
own code still makes the two calls one after the other, so only a call started ahead overlaps them).

A missed call's output is received and dropped before the next call is sent (``Workers.send``). The negative
prompt's embeddings cross to the worker once per pipeline call: at later steps the same tensor, unchanged, is named
and the worker uses the one it holds (``workers.Inputs``).
"""

from __future__ import annotations

from typing import Any

from torch.utils._pytree import tree_unflatten

from ..errors import PipemapError, Unsplittable
from .changes import signature
from .guidance import GuidanceHook, Inputs
from .payload import Raised
from .resident import outside_graphs
from .worker import Source, caller_state
from .workers import Call, OnWorkers, Workers, plain_copy


class ProcessGuidanceHook(OnWorkers, GuidanceHook):
    """``GuidanceHook`` whose copy is a worker process on ``replicas[0]``."""

    thread_hook = GuidanceHook

    def __init__(self, component: str, device: str, execution_device: str, replicas: tuple[str, ...]):
        super().__init__(component, device, execution_device, replicas)
        self.workers: Workers | None = None

    def init_on_workers(self, module):
        self._home, self._made = module, signature(module, state=True)  # what ``copy_is_current`` compares with
        self.attach_workers(module)
        self.take_forward(module)
        return module

    def bring_up(self, module) -> None:
        assert self.workers is not None  # set by attach_workers
        self.workers.sync(plain_copy(module), Source.of(module))

    def detach_hook(self, module):  # the workers stay: a new hook over the module (a followed change) reuses them
        module = super().detach_hook(module)
        self.workers = self._module = None
        return module

    def _start(self, upcoming: Inputs) -> Any:  # a Future's part: ``result()``
        inputs = tree_unflatten(list(upcoming.leaves), upcoming.spec)
        try:
            workers = self.running_workers()
            return Ahead(workers, workers.send([inputs], caller_state()))
        except PipemapError as err:  # the worker gone (stopped): this branch runs here, the next call starts anew
            return Failed(err)

    def __getstate__(self):  # a deep copy (the dry run's fake module) leaves the worker behind
        return {**super().__getstate__(), "workers": None, "_module": None}

    def __repr__(self) -> str:
        return f"ProcessGuidanceHook({self.component!r}, device={self.device}, worker={self.replica_devices[0]})"


class Ahead:
    """A call started ahead on the worker: its output received when asked for (a hit), else dropped by the next
    send (a miss). Its failure (a dead worker; tokens a split branch could not divide) raises where the result is
    asked for, so the call runs here."""

    def __init__(self, workers: Workers, call: Call):
        self.workers, self.call = workers, call

    def result(self):
        output = self.workers.receive(self.call)[0]
        if isinstance(output, Raised):
            raise Unsplittable(output.message)
        return output


class Failed:
    """A call that could not be started ahead: a miss, its error kept for whoever asks."""

    def __init__(self, error: Exception):
        self.error = error

    def result(self):
        raise self.error


outside_graphs(ProcessGuidanceHook)
