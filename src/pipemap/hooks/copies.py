"""What the guidance-branch and sequence-split hooks share (``guidance.py``, ``sequence.py``): a component resident
on its GPU with a whole copy on each of ``replicas`` (``replica.replica``: weights copied straight there), threads
that run the copies, and the component's own forward replaced by the hook's ``run``.

accelerate's ``ModelHook`` always runs the module's forward between ``pre_forward`` and ``post_forward``; these two
modes decide per call what runs instead (a result computed ahead on another GPU, or the call's share of the tokens on
every GPU at once), so ``init_hook`` puts ``run`` where accelerate's hook looks the forward up at each call
(``module._old_forward``) and ``detach_hook`` puts the module's own forward back.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .replica import CallerState, _run_replica, replica
from .resident import PlacementHook, quietly


class CopiesHook(PlacementHook):
    """A resident component with a copy on each of ``replicas``, whose calls run through ``run``."""

    rehooked_on_change = True  # its copies are made from the model as it was: a changed model gets new ones
    keeps_copies = True

    def __init__(self, component: str, device: str, execution_device: str, replicas: tuple[str, ...]):
        super().__init__(component, device, execution_device)
        self.replica_devices = tuple(torch.device(d) for d in replicas)
        self.replicas: list[torch.nn.Module] = []
        self.own_forward: Callable | None = None
        self._pool: ThreadPoolExecutor | None = None

    @classmethod
    def for_placement(cls, p, execution_device: str, ledger) -> CopiesHook:
        """The hook of a placement of this mode (``hooks.HOOKS``): copies on ``p.replicas``."""
        return cls(p.component, p.device, execution_device, p.replicas)

    def init_hook(self, module):
        self.replicas = [replica(module, device) for device in self.replica_devices]
        self.take_forward(module)
        return module

    def take_forward(self, module) -> None:
        """``run`` where accelerate's hook looks the forward up at each call, the module's own kept for
        ``forward_own`` (``detach_hook`` puts it back)."""
        self.own_forward = module._old_forward  # accelerate set it before calling init_hook
        module._old_forward = self.run

    def detach_hook(self, module):
        if self.own_forward is not None:
            module._old_forward = self.own_forward
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.replicas, self._pool, self.own_forward = [], None, None
        return module

    def forward_own(self, *args, **kwargs):
        """The component's own forward, as it was before this hook."""
        if self.own_forward is None:
            raise RuntimeError(f"{self!r} is not attached to its component")
        return self.own_forward(*args, **kwargs)

    def run(self, *args, **kwargs):
        """The component's call, its inputs already on ``device`` (``pre_forward``)."""
        raise NotImplementedError

    def start(self, work: Callable[[], object], device: torch.device) -> Future:
        """``work`` on a thread of this hook's pool; inline on the dry run's stand-in devices, whose checking modes
        are thread-local."""
        if device.type == "meta":
            done: Future = Future()
            try:
                done.set_result(work())
            except Exception as err:  # as a thread's exception: raised where its result is asked for
                done.set_exception(err)
            return done
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max(1, len(self.replicas)), thread_name_prefix=f"pipemap-{self.component}")
        return self._pool.submit(quietly(work))  # what a copy's call sets on itself is no change (``resident``)

    def __getstate__(self):  # a deep copy (the dry run's fake copy of a module) leaves the copies and threads behind
        return {**self.__dict__, "replicas": [], "_pool": None}

    def __repr__(self) -> str:
        copies = ", ".join(str(d) for d in self.replica_devices)
        return f"{type(self).__name__}({self.component!r}, device={self.device}, replicas=[{copies}])"


def call_on(module: torch.nn.Module, device: torch.device, home: torch.device | None, inputs: tuple[tuple, dict],
            state: CallerState):
    """``module(*args, **kwargs)`` on a copy's thread, as a replica's part of a batch runs (``replica.py``): the
    inputs moved to ``device``, under the caller's per-thread state (grad and inference mode, autocast, current
    streams: ``state``, captured in the caller's thread), ``device`` current, the output moved to ``home`` (left on
    ``device`` when ``home`` is None: the caller copies it home where it uses it)."""
    return _run_replica(module, device, home, inputs, state)
