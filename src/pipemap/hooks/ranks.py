"""The seam between a split component's hook and what runs its ranks: one interface (``Ranks``), three runtimes.

A hook that keeps copies of its component (``replica.py``, ``guidance.py``, ``sequence.py``,
``guidance_sequence.py``: ``copies.CopiesHook``) is rank 0, in the caller's thread, on the component's own device;
its other ranks, one per device of its placement's ``replicas`` (rank 1, 2, ...), are what ``Ranks`` gives it:

- ``threads.ThreadRanks``: copies in this process, each rank a thread of its own (``ranks="thread"``, and always the
  dry run's stand-in devices, whose checking modes are thread-local);
- ``workers.Workers``: a spawned worker process per device over ``torch.distributed`` (NCCL between GPUs, gloo on
  the CPU): ``ranks="process"``, the default where a plan splits a denoiser;
- the same workers as Ray actors in one placement group (``ranks="ray"``: only their start differs,
  ``launch.launcher``).

A mode's hook is written once, over this interface: it brings its ranks up (``bring_up``: each rank holds its own
copy of the component; ``split``: each copy made its rank of a sequence split, over the whole group or over its own
half), sends parts of a call to chosen ranks (``submit``) and takes their outputs (``Pending.result``), or runs its
own share meanwhile while they run theirs (``together``), and closes them. So adding a parallel mode is one hook
file, and the dry run runs the same hook code as a real run.

``copies.ranks_for`` picks the runtime from the hook's (the plan's ``ranks``), and ``copies.CopiesHook`` makes the
checks ``ranks="auto"`` makes before it starts a worker: a component that cannot travel to another process
(``workers.travel_problem``) or a group that fails its bring-up check runs on threads instead, with a
``RanksFallbackWarning`` that says why.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

Part = tuple[tuple, dict]  # one rank's (args, kwargs)


class Pending(Protocol):
    """A call submitted to some ranks (``Ranks.submit``), their outputs not taken yet."""

    def result(self) -> list:
        """Each rank's output, in the order the ranks were given (None for a rank asked for no reply), once every
        rank is done; the failure of the rank that failed first, raised (an exception of a class the submit
        ``expected`` raised as itself, the ranks kept)."""
        ...


class Ranks(Protocol):
    """The other ranks of one split component: rank ``i`` on ``devices[i - 1]``, rank 0 the caller's thread on the
    component's own device (``home``)."""

    home: torch.device
    devices: tuple[torch.device, ...]

    @property
    def running(self) -> bool:
        """Whether every rank is up (a worker that died since: False; the hook brings them up again)."""
        ...

    def bring_up(self, module: torch.nn.Module) -> None:
        """Each rank holds its own copy of ``module`` as it is now (started anew where none runs)."""
        ...

    def split(self, module: torch.nn.Module, halves: tuple[tuple[int, ...], ...] = ()) -> torch.nn.Module | None:
        """Each rank's copy made its rank of a sequence split (``context.enable_split``) over all the ranks, or over
        its own of ``halves`` (disjoint tuples of ranks, each a group of its own); rank 0's copy of ``module``, made
        its rank likewise (None where rank 0 is in none of ``halves``)."""
        ...

    def submit(self, parts: Sequence[Part], to: tuple[int, ...] = (), reply: bool | tuple[bool, ...] = True,
               expected: tuple[type, ...] = ()) -> Pending:
        """``parts[i]`` started on rank ``to[i]`` (rank ``i + 1`` where ``to`` is empty), under the caller's
        per-thread state; ``reply=False`` (per part where a tuple): its output stays on the rank. Each rank runs
        its calls in the order they were submitted."""
        ...

    def together(self, pending: Pending, home: Callable[[], Any]) -> Any:
        """``home`` (rank 0's share of a split call) run here while the ranks of ``pending`` run theirs, each
        meeting the others in the split's collectives; ``home``'s output once they are all done. A rank's failure
        ends the others' shares at once (no collective waits out a timeout) and is what is raised; a share that
        does not divide (``Unsplittable``, met by every rank at the same layer) is raised as such."""
        ...

    def pids(self) -> list[int]:
        """The process ids of the ranks that are processes of their own, running now."""
        ...

    def close(self) -> None:
        """Every rank stopped and what it held freed."""
        ...


def pick(failures: Sequence[BaseException], expected: tuple[type, ...]) -> BaseException:
    """The failure of a split call to raise: an expected one (``Unsplittable``: every rank met it), else the first
    that is not a rank released from a collective because another failed."""
    found = next((e for e in failures if isinstance(e, expected)), None) if expected else None
    if found is not None:
        return found
    return next((e for e in failures if not isinstance(e, threading.BrokenBarrierError)), failures[0])
