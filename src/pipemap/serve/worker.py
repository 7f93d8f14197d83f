"""The queue between the HTTP handlers and the pipeline, and the one thread that feeds the pipeline from it.

Handlers ``submit`` jobs (bounded: a full queue refuses at once, so a client can retry elsewhere). While jobs
wait, the worker streams their calls into the runner and answers each job as its outcome comes. Two kinds of runner:

- ordered, ``runner(pipe, calls) -> outcomes`` in the calls' order (``run_sequential``): the stream never blocks;
  when the queue is empty it ends, the runner finishes what it holds, and the worker waits for the next job (the
  runner may read the stream on the thread that answers, so a stream that blocked would hold back its answers);
- unordered (``ordered=False``), ``runner(pipe, calls) -> (index, outcome)`` as each call ends
  (``parallel.iter_unordered``: several requests in flight, the stream read on a thread of its own, one call when a
  worker is free for it): each job is answered when its own work ends, not behind a longer one sent before it, and
  while work runs the stream waits for the next job, so a job that comes meanwhile starts beside it.

A job past its deadline is dropped: skipped if still waiting, stopped at its next denoising step if running
(``callback_on_step_end``).

Batching (``max_batch`` > 1): a job of one image waits up to ``batch_window`` seconds for waiting jobs of its shape
(every argument the same but the prompts); they run as one call, the prompts as a list and one generator per job,
as many as the plan's memory lets one call hold (``fits``); each job is answered with its own image, the one its
seed makes alone (up to the rounding a batch's kernels may differ by). Under an unordered runner a batch is formed
only when a worker is free to run it, so a job whose client hung up while it waited leaves the queue and never
joins a batch.
"""

from __future__ import annotations

import collections
import inspect
import math
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ..dispatch.parallel import Settled, settled
from ..errors import DrainingError, QueueFullError, WorkDropped
from .requests import results_per_prompt


def run_sequential(pipe, calls: Iterable[dict]) -> Iterator:
    """The plain runner: one call after another, a failed call's exception in its place."""
    for call in calls:
        try:
            yield pipe(**settled(call))
        except Exception as error:  # noqa: BLE001 - a request's failure is its answer, not the worker's end
            yield error


@dataclass(eq=False)
class Job:
    """One request's call: ``call`` (without generator), its seed and images, and when it stops being wanted."""

    call: dict
    seed: int
    images: int
    deadline: float  # time.monotonic()
    timeout: float = 0.0  # seconds it was given: its deadline less its submission time
    future: Future = field(default_factory=Future)
    started: float = 0.0  # time.perf_counter() when the worker took it
    dropped: threading.Event = field(default_factory=threading.Event)  # set: its client left

    def wanted(self) -> bool:
        return not self.dropped.is_set() and time.monotonic() < self.deadline

    def drop(self) -> None:
        self.dropped.set()


@dataclass(frozen=True)
class Finished:
    """What the worker reports per job answered: images made (0 if it failed) and the pipeline seconds it took,
    counted from its start or the previous answer, whichever is later, so overlapped jobs are not counted twice."""

    images: int
    seconds: float


class Worker:
    """A bounded queue of jobs and the thread that runs them through ``runner`` on ``pipe``."""

    def __init__(self, pipe, runner=run_sequential, max_queue: int = 16, on_finished=None, in_flight: int = 1,
                 max_batch: int = 1, batch_window: float = 0.02, fits=None, ordered: bool = True):
        self.pipe, self.runner, self.max_queue, self.in_flight = pipe, runner, max_queue, in_flight
        self.ordered = ordered  # the runner's outcomes in the calls' order; else ``(index, outcome)`` as they end
        self.max_batch, self.batch_window = max_batch, batch_window
        self.fits = fits or (lambda call: True)  # whether one call of this shape fits the plan's memory
        self.batched = 0  # calls that ran several jobs
        self.on_finished = on_finished or (lambda finished: None)
        self.taken: set[Job] = set()  # handed to the runner, not yet answered
        self.draining = False
        self._waiting: collections.deque[Job] = collections.deque()
        self._ready = threading.Condition()
        self._thread: threading.Thread | None = None
        self._steps = "callback_on_step_end" in inspect.signature(pipe.__call__).parameters
        self._recent = 1.0  # seconds between answers, smoothed: the Retry-After estimate
        self._last = 0.0  # time.perf_counter() of the last answer
        self.dropped = 0  # jobs dropped (timed out or abandoned) since the start

    @property
    def running(self) -> int:
        """Jobs running: those the runner holds, up to the calls it runs at once (it reads a few more ahead)."""
        return min(len(self.taken), self.in_flight * self.max_batch)

    @property
    def depth(self) -> int:
        """Jobs waiting: in the queue, and those the runner read ahead but cannot run yet."""
        return len(self._waiting) + len(self.taken) - self.running

    def start(self) -> None:
        with self._ready:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="pipemap-serve-worker", daemon=True)
                self._thread.start()

    def submit(self, job: Job) -> Future:
        with self._ready:
            if self.draining:
                raise DrainingError()
            if len(self._waiting) >= self.max_queue:
                raise QueueFullError(self.depth, self.retry_after())
            self._waiting.append(job)
            self._ready.notify()
        return job.future

    def retry_after(self) -> int:
        """Seconds until the work waiting now has drained, at the rate answers came lately (``_recent`` seconds
        apart): a client retrying sooner would find the queue as full; at least 1."""
        return max(1, math.ceil(max(1, self.depth) * self._recent))

    def drain(self) -> None:
        """Take no new job; those waiting and running still finish."""
        with self._ready:
            self.draining = True
            self._ready.notify_all()

    def stop(self, timeout: float | None = None) -> None:
        """Drain, then wait for the thread to finish what it took, ``timeout`` seconds at most; then drop every job
        left (a running one stops at its next step) and wait a little more: a step that never ends is left to the
        process's exit (the thread is a daemon)."""
        self.drain()
        if self._thread is None:
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.drop()
            self._thread.join(5)

    def drop(self) -> None:
        """Drain, and drop every job: out of the queue, or stopped at its next step if it runs."""
        self.drain()
        with self._ready:
            left = [*self._waiting, *self.taken]
        for job in left:
            self.cancel(job)

    def cancel(self, job: Job) -> None:
        """Drop ``job``: out of the queue if it waits there, stopped at its next step if it runs."""
        job.drop()
        with self._ready:
            if job in self._waiting:
                self._waiting.remove(job)
                self.dropped += 1

    def _loop(self) -> None:
        while self._work_waits():
            taken: dict[int, list[Job]] = {}  # each call's jobs by its index in the stream, oldest first
            try:
                for outcome in self.runner(self.pipe, self._stream(taken)):
                    index, outcome = (next(iter(taken)), outcome) if self.ordered else outcome
                    self._answer_group(taken.pop(index), outcome)
            except Exception as error:  # noqa: BLE001 - a runner that fails whole fails each job it holds
                for group in list(taken.values()):
                    self._answer_group(group, error)
                if not taken:  # it failed before taking any: the waiting jobs would only make it fail again
                    with self._ready:
                        waiting = [job for job in list(self._waiting) if self._run(job)]
                        self._waiting.clear()
                    for job in waiting:
                        self._answer(job, error)
                taken.clear()

    def _work_waits(self) -> bool:
        with self._ready:
            while not self._waiting and not self.draining:
                self._ready.wait()
            return bool(self._waiting)

    def _stream(self, taken: dict[int, list[Job]]) -> Iterator[dict]:
        """The waiting jobs' calls, as the runner asks for them; ends when none waits (an unordered runner's stream
        first waits for the work running to end: a job may come meanwhile). A job that can be batched waits up to the
        batch window for others of its shape (``_group``)."""
        index = 0
        while (job := self._take()) is not None:
            group = self._group(job)
            taken[index] = group
            index += 1
            yield self._armed(group)

    def _take(self) -> Job | None:
        with self._ready:
            while True:
                while self._waiting:
                    job = self._waiting.popleft()
                    if self._run(job):
                        return job
                if self.ordered or self.draining or not self.taken:
                    return None
                self._ready.wait()  # woken by a new job, a drain, or the last answer

    def _run(self, job: Job) -> bool:
        """Mark a job taken off the queue as running, or count it dropped; under ``_ready``."""
        # a future marked running can no longer be cancelled by its handler: its answer can always be set
        if job.wanted() and job.future.set_running_or_notify_cancel():
            self.taken.add(job)
            job.started = time.perf_counter()
            return True
        self.dropped += 1
        return False

    def _group(self, job: Job) -> list[Job]:
        """``job`` and the waiting jobs of its shape (``batch_key``) that come within ``batch_window`` seconds, up to
        ``max_batch`` in all and as many as ``fits`` (the plan's memory) lets one call hold; the rest go back to the
        front of the queue."""
        key = batch_key(job.call)
        if self.max_batch <= 1 or key is None:
            return [job]
        others: list[Job] = []
        deadline = time.monotonic() + self.batch_window
        with self._ready:
            while len(others) + 1 < self.max_batch and not self.draining:
                found = [j for j in self._waiting if batch_key(j.call) == key][:self.max_batch - 1 - len(others)]
                for other in found:
                    self._waiting.remove(other)
                others += found
                left = deadline - time.monotonic()
                if left <= 0 or len(others) + 1 >= self.max_batch:
                    break
                self._ready.wait(left)
        while others and not self.fits(batched_call([job, *others])):  # a dry run, maybe: outside the lock
            with self._ready:
                self._waiting.appendleft(others.pop())
        with self._ready:
            return [job, *(other for other in others if self._run(other))]

    def _answer_group(self, group: list[Job], outcome) -> None:
        """Each job of a call its own share: one image each of a batched call, or the call's error."""
        if len(group) == 1:
            self._answer(group[0], outcome)
            return
        self.batched += 1
        for index, job in enumerate(group):
            share = outcome if isinstance(outcome, BaseException) else Share.of(outcome, index)
            self._answer(job, share)

    def _answer(self, job: Job, outcome) -> None:
        now = time.perf_counter()
        seconds, self._last = now - max(job.started, self._last), now
        self._recent = 0.7 * self._recent + 0.3 * seconds
        with self._ready:
            self.taken.discard(job)
            self.dropped += isinstance(outcome, WorkDropped)
            self._ready.notify_all()  # an unordered runner's stream waits for the last answer
        if isinstance(outcome, BaseException):
            job.future.set_exception(outcome)
        else:
            job.future.set_result(outcome)
        self.on_finished(Finished(0 if isinstance(outcome, BaseException) else job.images, seconds))

    def _armed(self, group: list[Job]) -> dict:
        """The group's call with its generators (one per job, so each image is the one its seed makes alone), and a
        step callback that stops it once no job of it is wanted. Settled when it may start (``parallel.Settled``):
        the jobs whose clients left while it waited for a worker or for memory are answered dropped and left out."""
        return _Armed(self._call(group), group, self)

    def _leave_out(self, group: list[Job]) -> dict:
        """The call for ``group``'s jobs still wanted, the others answered dropped; ``group`` keeps the wanted ones
        (their answers are the call's images in order). ``WorkDropped`` when none is wanted: nothing runs."""
        kept = [job for job in group if job.wanted()]
        if len(kept) == len(group):
            return self._call(group)
        if not kept:
            raise WorkDropped(0)
        for job in group:
            if job not in kept:
                self._answer(job, WorkDropped(0))
        group[:] = kept
        return self._call(group)

    def _call(self, group: list[Job]) -> dict:
        seeded = [torch.Generator("cpu").manual_seed(job.seed) for job in group]
        call = {**batched_call(group), "generator": seeded if len(group) > 1 else seeded[0], "output_type": "pil"}
        if self._steps:
            def stop_when_unwanted(pipe, step, timestep, tensors):
                if not any(job.wanted() for job in group):
                    raise WorkDropped(step + 1)
                return {}

            call["callback_on_step_end"] = stop_when_unwanted
        return call


class _Armed(Settled):
    """A group's call as the runner is handed it; settled (``Worker._leave_out``) when it may start."""

    def __init__(self, call: dict, group: list[Job], worker: Worker):
        super().__init__(call)
        self.group, self.worker = group, worker

    def settle(self) -> dict:
        return self.worker._leave_out(self.group)


@dataclass(frozen=True)
class Share:
    """One job's image (or, from a video pipeline, its video: ``frames``) of a batched call's output."""

    images: list
    frames: list | None = None

    @classmethod
    def of(cls, outcome, index: int) -> Share:
        frames = getattr(outcome, "frames", None)
        if frames is not None:
            return cls([], frames[index:index + 1])
        return cls(outcome.images[index:index + 1])


_PROMPTS = ("prompt", "negative_prompt")


def batch_key(call: dict) -> tuple | None:
    """What calls run as one share: every argument but the prompts, and which prompts are given; None for a call
    that is not batched (several images: their latents come from one generator, which a batch cannot repeat)."""
    if results_per_prompt(call) != 1 or not isinstance(call.get("prompt"), str):
        return None
    return tuple(sorted((name, value if name not in _PROMPTS else None) for name, value in call.items()))


def batched_call(group: list[Job]) -> dict:
    """The jobs' calls as one: their prompts as lists (no generator yet); a single job's call as it is."""
    if len(group) == 1:
        return dict(group[0].call)
    call = dict(group[0].call)
    for name in _PROMPTS:
        if name in call:
            call[name] = [job.call[name] for job in group]
    return call
