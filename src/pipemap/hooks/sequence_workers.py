"""One call's tokens split across worker processes (mode ``"sequence"`` with ``PIPEMAP_WORKERS=process``): rank 0
is a copy on the transformer's own GPU in this process (sharing its weights), each other rank the worker process of
its device (``workers.py``), all of them ranks of one real ``torch.distributed`` group (gloo on the CPU, NCCL on
GPUs). Each rank's copy is made a rank of diffusers' context parallelism exactly as ``sequence.SequenceHook`` makes
its thread ranks (``enable_split``: the ``_cp_plan``'s cuts and gathers, Ulysses attention), over that group.

At each call the inputs go whole to every worker (each cuts its own share, as diffusers' ranks do), every rank runs
at once, their attention exchanging over the group; the gathered output is rank 0's, and the workers keep theirs (no
copy back). A call whose tokens do not divide among the ranks raises ``Unsplittable`` on every rank at the same
layer, before any exchange: it then runs whole here.
"""

from __future__ import annotations

import torch

from .payload import Raised
from .resident import outside_graphs
from .sequence import SequenceHook, Unsplittable, check_splittable, enable_split
from .worker import Source, caller_state
from .workers import OnWorkers, Workers, plain_copy


class ProcessSequenceHook(OnWorkers, SequenceHook):
    """``SequenceHook`` whose other ranks are worker processes, one per device of ``replicas``."""

    thread_hook = SequenceHook

    def __init__(self, component: str, device: str, execution_device: str, replicas: tuple[str, ...]):
        super().__init__(component, device, execution_device, replicas)
        self.workers: Workers | None = None

    def init_on_workers(self, module):
        check_splittable(self.component, module, 1 + len(self.replica_devices))
        self.attach_workers(module)
        self.take_forward(module)
        return module

    def detach_hook(self, module):  # the workers stay: a new hook over the module (a followed change) reuses them
        module = super().detach_hook(module)
        self.workers = self._module = None
        return module

    def run(self, *args, **kwargs):
        try:
            return split_on_workers(self.running_workers(), self.ranks[0], (), args, kwargs)
        except Unsplittable:
            self.whole += 1
            return self.forward_own(*args, **kwargs)

    def bring_up(self, module) -> None:
        """Workers given the module and made ranks 1..; rank 0 a copy here sharing the module's weights."""
        assert self.workers is not None  # set by attach_workers
        self.workers.sync(plain_copy(module), Source.of(module))
        self.workers.split()
        home = plain_copy(module)  # new workers, a new group: rank 0 made anew over it too
        enable_split(home, 0, self.workers.group)
        self.ranks = [home]

    def __getstate__(self):  # a deep copy (the dry run's fake module) leaves the workers behind
        return {**super().__getstate__(), "workers": None, "_module": None}

    def __repr__(self) -> str:
        copies = ", ".join(str(d) for d in self.replica_devices)
        return f"ProcessSequenceHook({self.component!r}, device={self.device}, workers=[{copies}])"


def split_on_workers(workers: Workers, home: torch.nn.Module, to: tuple[int, ...], args: tuple, kwargs: dict):
    """One split call: the whole inputs sent to the worker ranks ``to`` (every worker where empty), rank 0's copy
    ``home`` run here meanwhile, the workers watched (``Workers.watching``); its output, once the workers are done
    (they keep theirs). ``Unsplittable`` where the tokens do not divide (every rank met it at the same layer, before
    any exchange: the caller runs it whole); a worker's error or death inside the split ends rank 0's share at once
    and is what is raised (its traceback, typed), rank 0's own error otherwise; either stops the workers (ranks left
    inside an exchange: new ones at the next call)."""
    count = len(to) or len(workers.devices)
    call = workers.send([(args, kwargs)] * count, caller_state(), reply=False, expected=(Unsplittable,), to=to)
    seen: list[BaseException] = []
    try:
        with workers.watching(call) as seen:
            output = home(*args, **kwargs)
    except Unsplittable:
        answers = workers.receive(call)
        if not all(isinstance(a, Raised) for a in answers):
            workers.close()
        raise
    except BaseException as err:
        cause = workers.failure(call, seen)
        if cause is not None:
            raise cause from err
        raise
    if seen:  # a worker failed after rank 0's share was done
        raise workers.failure(call, seen) or seen[0]
    workers.receive(call)
    return output


outside_graphs(ProcessSequenceHook)
