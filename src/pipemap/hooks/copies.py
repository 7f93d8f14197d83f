"""What the hooks of a component with ranks on other devices share (``replica.py``, ``guidance.py``,
``sequence.py``, ``guidance_sequence.py``): the component resident on its GPU (rank 0, the caller's thread), its
other ranks, one per device of ``replicas``, behind the seam (``ranks.Ranks``), and, for the modes that decide per
call what runs instead of the component's own forward, that forward replaced by the hook's ``run``.

Which runtime runs the ranks is the plan's (``Plan.ranks``, given to the hook as ``runtime``): threads
(``threads.ThreadRanks``), worker processes or Ray actors (``workers.Workers``). The dry run's stand-in devices
always get threads. Under ``ranks="auto"`` a component that cannot travel to another process, or a group that fails
its bring-up check, gets threads too, with a ``RanksFallbackWarning`` that says why (``fallback``); named by the user
(``asked``), either is an error.

accelerate's ``ModelHook`` always runs the module's forward between ``pre_forward`` and ``post_forward``; guidance
and sequence decide per call what runs instead (a result computed ahead on another rank, or the call's share of the
tokens on every rank at once), so ``take_forward`` puts ``run`` where accelerate's hook looks the forward up at each
call (``module._old_forward``) and ``detach_hook`` puts the module's own forward back.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..errors import CannotTravelError, RanksFallbackWarning, RanksSelfTestError
from .ranks import Ranks
from .resident import PlacementHook


class CopiesHook(PlacementHook):
    """A resident component with a rank on each of ``replicas`` (``ranks``, brought up at ``init_hook``)."""

    rehooked_on_change = True  # its copies are made from the model as it was: a changed model gets new ones
    keeps_copies = True
    takes_forward = True  # its calls run through ``run`` (the replicated mode cuts the batch around the forward)

    def __init__(self, component: str, device: str, execution_device: str, replicas: tuple[str, ...],
                 runtime: str = "thread", asked: bool = False):
        super().__init__(component, device, execution_device)
        self.replica_devices = tuple(torch.device(d) for d in self.copied(replicas))
        self.runtime, self.asked = runtime, asked  # what runs the ranks; named by the user (no fall-back)
        self.fallback: str | None = None  # why the ranks run as threads after all (``ranks="auto"``)
        self.ranks: Ranks | None = None
        self.own_forward: Callable | None = None
        self._module: Any = None  # a weak reference to the component: new workers are given it after a death

    @property
    def replicas(self) -> list[torch.nn.Module]:
        """The ranks' copies held in this process (thread ranks'); worker processes hold theirs, none here."""
        return list(getattr(self.ranks, "copies", []))

    @staticmethod
    def copied(replicas: tuple[str, ...]) -> tuple[str, ...]:
        """The devices of the placement's ``replicas`` this hook keeps a rank on: all of them."""
        return replicas

    @classmethod
    def for_placement(cls, p, execution_device: str, ledger, runtime: str = "thread", asked: bool = False):
        """The hook of a placement of this mode (``hooks.hook_maker``): ranks on ``p.replicas``, run by ``runtime``
        (threads on the dry run's stand-in devices)."""
        if any(torch.device(d).type == "meta" for d in (p.device, *p.replicas)):
            runtime, asked = "thread", False
        return cls(p.component, p.device, execution_device, p.replicas, runtime, asked)

    def renewed(self, p) -> CopiesHook:
        """A new hook of this kind whose ranks run as this one's do (a fall-back to threads kept, with its why)."""
        fresh = type(self).for_placement(p, str(self.execution_device), None, self.runtime, self.asked)
        fresh.fallback = self.fallback
        return fresh

    def init_hook(self, module):
        self.attach_ranks(module)
        if self.takes_forward:
            self.take_forward(module)
        return module

    def bring_up(self, module: torch.nn.Module) -> None:
        """The ranks given the module (started anew where none runs): each hook adds its own (a split's groups)."""
        assert self.ranks is not None
        self.ranks.bring_up(module)

    def attach_ranks(self, module: torch.nn.Module) -> None:
        """The component's ranks (``ranks_for``), brought up for this hook; under ``ranks="auto"``, threads instead
        where the component cannot travel or the group fails its bring-up check. No worker outlives a failure here
        (WP3): a dispatch that fails has no hook that reset could stop them through."""
        self._module = weakref.ref(module)
        if self.runtime != "thread":
            self._check_travel(module)
        self.ranks = ranks_for(self, module)
        try:
            self.bring_up(module)
        except RanksSelfTestError as err:
            self.stop_ranks(module)
            if self.asked:
                raise
            self._fall_back(str(err))
            self.ranks = ranks_for(self, module)
            self.bring_up(module)
        except BaseException:
            self.stop_ranks(module)
            raise

    def _check_travel(self, module: torch.nn.Module) -> None:
        from .workers import plain_copy, travel_problem

        problem = travel_problem(plain_copy(module))
        if problem is not None and self.asked:
            raise CannotTravelError(self.component, problem)
        if problem is not None:
            self._fall_back(problem)

    def _fall_back(self, why: str) -> None:
        warnings.warn(RanksFallbackWarning(self.component, self.runtime, why), stacklevel=4)
        self.fallback, self.runtime = why, "thread"

    def live_ranks(self) -> Ranks:
        """The ranks, brought up anew where one died since the last call (a worker process)."""
        module = self._module() if self._module is not None else None
        if self.ranks is None or module is None:
            raise RuntimeError(f"{self!r} is not attached to its component")
        if not self.ranks.running:
            self.bring_up(module)
        return self.ranks

    def stop_ranks(self, module: torch.nn.Module) -> None:
        """This component's ranks stopped (worker processes: ``workers.stop_workers``)."""
        if self.runtime == "thread":
            if self.ranks is not None:
                self.ranks.close()
        else:
            from .workers import stop_workers

            stop_workers(module)
        self.ranks = None

    def release(self, module) -> None:
        """Stop this component's worker processes (``dispatch.reset``)."""
        if self.runtime != "thread":
            self.stop_ranks(module)

    def pids(self) -> list[int]:
        """The process ids of the ranks that are processes, running now."""
        return self.ranks.pids() if self.ranks is not None and self.ranks.running else []

    def take_forward(self, module) -> None:
        """``run`` where accelerate's hook looks the forward up at each call, the module's own kept for
        ``forward_own`` (``detach_hook`` puts it back)."""
        self.own_forward = module._old_forward  # accelerate set it before calling init_hook
        module._old_forward = self.run

    def detach_hook(self, module):
        """The module's own forward back; thread ranks closed. Worker processes stay: a new hook over the module (a
        followed change) reuses them, sending only what changed; they stop at ``release`` (reset), when the module
        is collected, or at exit."""
        if self.own_forward is not None:
            module._old_forward = self.own_forward
        if self.runtime == "thread" and self.ranks is not None:
            self.ranks.close()
        self.ranks, self.own_forward, self._module = None, None, None
        return module

    def forward_own(self, *args, **kwargs):
        """The component's own forward, as it was before this hook."""
        if self.own_forward is None:
            raise RuntimeError(f"{self!r} is not attached to its component")
        return self.own_forward(*args, **kwargs)

    def run(self, *args, **kwargs):
        """The component's call, its inputs already on ``device`` (``pre_forward``)."""
        raise NotImplementedError

    def __getstate__(self):  # a deep copy (the dry run's fake copy of a module) leaves the ranks behind
        return {**self.__dict__, "ranks": None, "_module": None}

    def __repr__(self) -> str:
        copies = ", ".join(str(d) for d in self.replica_devices)
        return (f"{type(self).__name__}({self.component!r}, device={self.device}, replicas=[{copies}], "
                f"ranks={self.runtime})")


def ranks_for(hook: CopiesHook, module: torch.nn.Module) -> Ranks:
    """The ranks of ``hook``'s component, by the hook's runtime: threads of its own, or the component's worker
    processes (``workers.workers_for``: kept across hooks over it)."""
    if hook.runtime == "thread":
        from .threads import ThreadRanks

        return ThreadRanks(hook.component, hook.device, hook.replica_devices)
    from .workers import workers_for

    return workers_for(module, hook.component, hook.device, hook.replica_devices, hook.runtime)
