"""Denoiser replicas (mode ``"replicated"``, strategy ``"parallel"``): a whole copy of the denoiser on each of several
GPUs; each call's batch (classifier-free guidance concatenates the unconditional and conditional halves;
``num_images_per_prompt``) is cut along its first dimension, the first part run on the home copy in the calling
thread and each other part on its own rank (``ranks.Ranks``: a worker process on its GPU by default, or a thread),
and the outputs joined in order on the home device. ``torch.nn.DataParallel`` does the same cut for a training
batch, but replicates the module at every call and gathers on one device it owns; here the copies are made once, at
dispatch, and live where the plan put them.

A rank runs under the caller's per-thread state (``calls.CallerState`` for a thread; ``worker.caller_state`` for a
worker process). The batch's cut and join are ``calls.split_batch`` and ``calls.join_batch``.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from ..runtime.transfer import move
from .calls import join_batch, split_batch
from .copies import CopiesHook
from .resident import PlacementHook, outside_graphs

if TYPE_CHECKING:
    from .ranks import Pending


class ReplicaHook(CopiesHook):
    """A resident denoiser with a rank on each of ``replicas``: each call's batch split across the ranks.

    The first part runs on the module itself, in the calling thread, between ``pre_forward`` and ``post_forward``;
    the other parts are submitted to the ranks in ``pre_forward`` and joined in ``post_forward``.
    """

    takes_forward = False  # the module's own forward runs the first part

    def __init__(self, component: str, device: str, execution_device: str, replicas: tuple[str, ...],
                 runtime: str = "thread", asked: bool = False):
        super().__init__(component, device, execution_device, replicas, runtime, asked)
        self._pending: list[Pending | None] = []  # one entry per call in progress (a stack: calls may nest)
        self._joining = False  # post_forward runs: a failure there has cleaned up already

    def detach_hook(self, module):
        self._pending = []
        return super().detach_hook(module)

    def pre_forward(self, module, *args, **kwargs):
        args, kwargs = PlacementHook.pre_forward(self, module, *args, **kwargs)
        chunks = split_batch(args, kwargs, 1 + len(self.replica_devices))
        self._pending.append(self.live_ranks().submit(chunks[1:]) if len(chunks) > 1 else None)
        return chunks[0]

    def post_forward(self, module, output):
        pending = self._pending.pop()
        if pending is None:
            return PlacementHook.post_forward(self, module, output)
        self._joining = True
        try:
            # each part's output copied home here, where the caller uses it: from a rank's thread the copy would
            # make the caller's stream wait for the whole part at whatever point the caller had reached (G2)
            parts = [output] + [move(o, self.device) for o in pending.result()]
        finally:
            self._joining = False
        return PlacementHook.post_forward(self, module, join_batch(parts))

    def abort(self, module) -> None:
        """The home part failed (out of memory on the home GPU, say): wait for this call's other parts and drop
        them, so nothing of the call stays pending (the home part's own error is the one raised)."""
        if self._pending and not self._joining:
            pending = self._pending.pop()
            if pending is not None:
                with contextlib.suppress(Exception):
                    pending.result()

    def enter_part(self, module, *args, **kwargs):  # a submodule called directly runs on the home copy alone
        return PlacementHook.pre_forward(self, module, *args, **kwargs)

    def leave_part(self, module, output):
        return PlacementHook.post_forward(self, module, output)

    def __getstate__(self):
        return {**super().__getstate__(), "_pending": []}


outside_graphs(ReplicaHook)
