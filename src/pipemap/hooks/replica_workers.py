"""Denoiser replicas in worker processes (mode ``"replicated"`` with ``PIPEMAP_WORKERS=process``): each call's
batch cut as ``replica.ReplicaHook`` cuts it, the first part run here on the home copy, each other part sent to the
worker process of its device (``workers.py``), which runs it on its own copy and sends the output back.

The hook keeps no copy in this process. Its workers outlive a new hook over the same module (a change followed:
``sync`` then sends only the tensors that changed) and stop at ``release`` (``dispatch.reset``), when the module is
collected, or at exit.
"""

from __future__ import annotations

import contextlib

from ..errors import PipemapError
from .replica import ReplicaHook, join_batch, split_batch
from .resident import PlacementHook, outside_graphs
from .worker import Source, caller_state
from .workers import Call, OnWorkers, Workers, plain_copy


class ProcessReplicaHook(OnWorkers, ReplicaHook):
    """``ReplicaHook`` whose copies are worker processes, one per device of ``replicas``."""

    thread_hook = ReplicaHook

    def __init__(self, component: str, device: str, execution_device: str, replicas: tuple[str, ...]):
        super().__init__(component, device, execution_device, replicas)
        self.workers: Workers | None = None
        self._calls: list[Call | None] = []  # per call in progress: what the workers were sent (None: nothing)

    def init_on_workers(self, module):
        self.attach_workers(module)
        return module

    def bring_up(self, module) -> None:
        assert self.workers is not None  # set by attach_workers
        self.workers.sync(plain_copy(module), Source.of(module))

    def detach_hook(self, module):  # the workers stay: a new hook over the module (a followed change) reuses them
        self.workers, self._module, self._calls = None, None, []
        return module

    def pre_forward(self, module, *args, **kwargs):
        args, kwargs = PlacementHook.pre_forward(self, module, *args, **kwargs)
        chunks = split_batch(args, kwargs, 1 + len(self.replica_devices))
        if len(chunks) < 2:
            self._calls.append(None)
            return chunks[0]
        workers = self.running_workers()
        self._calls.append(workers.send(chunks[1:], caller_state()))
        return chunks[0]

    def post_forward(self, module, output):
        call = self._calls.pop()
        if call is None or self.workers is None:
            return PlacementHook.post_forward(self, module, output)
        self._joining = True
        try:
            parts = [output, *self.workers.receive(call)]
        finally:
            self._joining = False
        return PlacementHook.post_forward(self, module, join_batch(parts))

    def abort(self, module) -> None:
        """The home part failed: receive (and drop) this call's other parts, so the workers are ready for the
        next call."""
        if not self._calls or self._joining:
            return
        call = self._calls.pop()
        if call is not None and self.workers is not None:
            with contextlib.suppress(PipemapError):  # the home part's own error is the one raised
                self.workers.receive(call)

    def __getstate__(self):  # a deep copy (the dry run's fake module) leaves the workers behind
        return {**super().__getstate__(), "workers": None, "_module": None, "_calls": []}

    def __repr__(self) -> str:
        copies = ", ".join(str(d) for d in self.replica_devices)
        return f"ProcessReplicaHook({self.component!r}, device={self.device}, workers=[{copies}])"


outside_graphs(ProcessReplicaHook)
