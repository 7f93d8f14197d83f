"""A split component's ranks as threads of this process (``ranks="thread"``, and the dry run's stand-ins): the
``ranks.Ranks`` the in-process runtime gives a hook.

Each rank is a copy of the component on its device (``replica.replica``: its weights copied straight there; on the
component's own device the copy shares them) and a thread of its own, which runs the calls submitted to it in order,
under the caller's per-thread state (``replica.CallerState``: grad and inference mode, autocast, the current
streams), as ``torch.nn.DataParallel``'s ``parallel_apply`` carries it into its threads. A split's ranks meet in an
in-process group (``exchange.ThreadGroup``): diffusers' context parallelism exchanges through it as it would through
a ``torch.distributed`` group.

On the dry run's stand-in devices (``meta:N``) a rank's call runs inline, at submit: the checking modes are
thread-local, and under ``FakeTensorMode`` a collective only shapes its output, so the ranks may run one after the
other.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import Unsplittable
from ..runtime.transfer import move_tensor
from .calls import CallerState, casts_in_place, rank_copy, run_part, version_of
from .exchange import Exchange, ThreadGroup, release, thread_groups
from .ranks import Part, pick
from .resident import quietly


class ThreadCall:
    """A call submitted to thread ranks: a future per rank."""

    def __init__(self, jobs: list[Future], replies: tuple[bool, ...], expected: tuple[type, ...]):
        self.jobs, self.replies, self.expected = jobs, replies, expected

    def failures(self) -> list[BaseException]:
        """Every rank's failure, once all are done."""
        wait(self.jobs)
        return [e for e in (job.exception() for job in self.jobs) if e is not None]

    def result(self) -> list:
        failures = self.failures()
        if failures:
            raise pick(failures, self.expected)
        return [job.result() if answer else None for job, answer in zip(self.jobs, self.replies)]


class ThreadRanks:
    """The ranks of one hook as threads: copies on ``devices``, each run by a thread of its own."""

    def __init__(self, component: str, home: torch.device, devices: tuple[torch.device, ...]):
        self.component, self.home, self.devices = component, home, devices
        self.copies: list[torch.nn.Module] = []
        self.groups: list[list[ThreadGroup]] = []  # each split group's ThreadGroups, one per member
        self.exchange_of: dict[int, Exchange] = {}  # each rank's split group's meeting place
        self.outstanding: list[tuple[tuple[int, ...], ThreadCall]] = []  # split calls not known to be done
        self._threads: dict[int, ThreadPoolExecutor] = {}
        self._moved: dict[int, dict[int, tuple[torch.Tensor, int | None, torch.Tensor]]] = {}

    @property
    def running(self) -> bool:
        return bool(self.copies)

    def pids(self) -> list[int]:
        return []

    def bring_up(self, module: torch.nn.Module) -> None:
        share = not casts_in_place(module)  # a copy on the module's own device shares its weights where it may
        self.copies = [rank_copy(module, device, share) for device in self.devices]

    def split(self, module: torch.nn.Module, halves: tuple[tuple[int, ...], ...] = ()) -> torch.nn.Module | None:
        self._release()
        by_rank: dict[int, ThreadGroup] = {}
        for members in halves or (tuple(range(1 + len(self.devices))),):
            groups = thread_groups(len(members), self.component if not halves else f"{self.component}-part")
            self.groups.append(groups)
            by_rank.update(zip(members, groups))
        from .context import enable_split  # here: a plan with no split imports no context-parallel code

        for rank, group in by_rank.items():
            self.exchange_of[rank] = group.exchange
            if rank:
                enable_split(self.copies[rank - 1], group.rank(), group)
        if 0 not in by_rank:
            return None
        home = rank_copy(module, self.home)  # shares the module's weights
        enable_split(home, 0, by_rank[0])
        return home

    def submit(self, parts: Sequence[Part], to: tuple[int, ...] = (), reply: bool | tuple[bool, ...] = True,
               expected: tuple[type, ...] = ()) -> ThreadCall:
        ranks = to or tuple(range(1, len(parts) + 1))
        self._settle(ranks)
        for exchange in {id(e): e for e in (self.exchange_of.get(r) for r in ranks) if e is not None}.values():
            exchange.renew()  # no call of these ranks runs now (``_settle``): ready for this one
        state = CallerState.capture((self.home, *(self.devices[r - 1] for r in ranks)))
        jobs = []
        for rank, part in zip(ranks, parts):
            device = self.devices[rank - 1]
            # the inputs copied here, in the caller's thread: on CUDA the copy then sits on the caller's stream
            # before its later work; a rank's thread's copy would land wherever the caller has got to
            moved = self._moved_to(rank, part, device)
            run = quietly(functools.partial(run_part, self.copies[rank - 1], device, None, moved, state))
            jobs.append(self._start(rank, _aborting(self.exchange_of.get(rank), run), device))
        replies = reply if isinstance(reply, tuple) else (reply,) * len(parts)
        call = ThreadCall(jobs, replies, expected)
        if self.exchange_of:
            self.outstanding.append((ranks, call))
        return call

    def together(self, pending: Any, home: Callable[[], Any]) -> Any:
        output, failures = None, []
        try:
            output = _aborting(self.exchange_of.get(0), home)()
        except BaseException as err:
            failures.append(err)
        failures += pending.failures()  # every rank done first
        self.outstanding = [(r, c) for r, c in self.outstanding if c is not pending]
        if failures:
            raise pick(failures, pending.expected)
        return output

    def close(self) -> None:
        for thread in self._threads.values():
            thread.shutdown(wait=True)
        self._release()
        self.copies, self._threads, self._moved, self.outstanding = [], {}, {}, []

    def _release(self) -> None:
        for groups in self.groups:
            release(groups)
        self.groups, self.exchange_of = [], {}

    def _settle(self, ranks: tuple[int, ...]) -> None:
        """Wait for the split calls still out on any of ``ranks`` (a missed branch started ahead): their group's
        meeting place is renewed for the next call only once no rank is in it."""
        for others, call in list(self.outstanding):
            if set(others) & set(ranks):
                call.failures()
                self.outstanding.remove((others, call))

    def _start(self, rank: int, work: Callable[[], Any], device: torch.device) -> Future:
        if device.type == "meta":
            done: Future = Future()
            try:
                done.set_result(work())
            except Exception as err:  # as a thread's exception: raised where its result is asked for
                done.set_exception(err)
            return done
        thread = self._threads.get(rank)
        if thread is None:
            thread = self._threads[rank] = ThreadPoolExecutor(1, thread_name_prefix=f"pipemap-{self.component}")
        return thread.submit(work)

    def _moved_to(self, rank: int, part: Part, device: torch.device) -> Part:
        """``part`` on ``device``, a tensor the last call to this rank already copied there unchanged (the negative
        prompt's embeddings, every step of a guidance branch) taken from there instead of copied again."""
        leaves, spec = tree_flatten(part)
        kept, moved = self._moved.get(rank, {}), {}
        out = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.device != device:
                version = version_of(leaf)
                old = kept.get(id(leaf))
                there = old[2] if old and old[0] is leaf and version is not None and old[1] == version else None
                if there is None:
                    there = move_tensor(leaf, device)
                moved[id(leaf)] = (leaf, version, there)
                leaf = there
            out.append(leaf)
        self._moved[rank] = moved
        return tree_unflatten(out, spec)


def _aborting(exchange: Exchange | None, call: Callable[[], Any]) -> Callable[[], Any]:
    """A rank's run; if it fails, the ranks waiting for it at the exchange are released (they fail too). Every rank
    finds a share that does not divide at the same layer, so ``Unsplittable`` releases nobody."""
    if exchange is None:
        return call

    def run():
        try:
            return call()
        except Unsplittable:
            raise
        except BaseException:
            exchange.abort()
            raise

    return run

