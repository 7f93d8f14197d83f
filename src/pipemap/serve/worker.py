"""The queue between the HTTP handlers and the pipeline, and the one thread that feeds the pipeline from it.

Handlers ``submit`` jobs (bounded: a full queue refuses at once, so a client can retry elsewhere); the worker takes
what is waiting, up to ``batch`` jobs, and hands their calls to the runner, ``runner(pipe, calls) -> outcomes``
(each an output or the exception its call raised), then answers each job's future. A job past its deadline is
dropped: skipped if still waiting, stopped at its next denoising step if running (``callback_on_step_end``).
"""

from __future__ import annotations

import collections
import inspect
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ..errors import PipemapError


class QueueFullError(PipemapError):
    """The queue holds ``max_queue`` waiting requests; ``retry_after`` is the seconds it should take to drain."""

    def __init__(self, depth: int, retry_after: int):
        self.depth, self.retry_after = depth, retry_after
        super().__init__(f"the queue is full ({depth} requests waiting): retry in {retry_after} s")


class DrainingError(PipemapError):
    """The server is shutting down: it finishes the work it took and takes no more."""

    def __init__(self):
        super().__init__("the server is shutting down and takes no new work: send the request to another one")


class WorkDropped(PipemapError):
    """Raised inside a pipeline call (at a step's end) whose request timed out, so its remaining steps are not run."""

    def __init__(self, step: int):
        self.step = step
        super().__init__(f"the request timed out; its work was dropped after step {step}")


def run_sequential(pipe, calls: list[dict]) -> list:
    """The plain runner: one call after another, a failed call's exception in its place."""
    outcomes = []
    for call in calls:
        try:
            outcomes.append(pipe(**call))
        except Exception as error:  # noqa: BLE001 - a request's failure is its answer, not the worker's end
            outcomes.append(error)
    return outcomes


@dataclass(eq=False)
class Job:
    """One request's call: ``call`` (without generator), its seed and images, and when it stops being wanted."""

    call: dict
    seed: int
    images: int
    deadline: float  # time.monotonic()
    future: Future = field(default_factory=Future)
    dropped: threading.Event = field(default_factory=threading.Event)

    def wanted(self) -> bool:
        return not self.dropped.is_set() and time.monotonic() < self.deadline

    def drop(self) -> None:
        self.dropped.set()


@dataclass(frozen=True)
class Finished:
    """What the worker reports per batch: images made, seconds taken, jobs failed."""

    images: int
    seconds: float
    failed: int


class Worker:
    """A bounded queue of jobs and the thread that runs them through ``runner`` on ``pipe``."""

    def __init__(self, pipe, runner=run_sequential, max_queue: int = 16, batch: int = 1, on_finished=None):
        self.pipe, self.runner, self.max_queue, self.batch = pipe, runner, max_queue, batch
        self.on_finished = on_finished or (lambda finished: None)
        self.running = 0
        self.draining = False
        self._waiting: collections.deque[Job] = collections.deque()
        self._ready = threading.Condition()
        self._thread: threading.Thread | None = None
        self._steps = "callback_on_step_end" in inspect.signature(pipe.__call__).parameters
        self._recent = 1.0  # seconds per job, smoothed: the Retry-After estimate
        self.dropped = 0  # jobs dropped (timed out or abandoned) since the start

    @property
    def depth(self) -> int:
        return len(self._waiting)

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
                raise QueueFullError(len(self._waiting), self.retry_after())
            self._waiting.append(job)
            self._ready.notify()
        return job.future

    def retry_after(self) -> int:
        """Seconds until the queue has room, from the recent seconds per job; at least 1."""
        return max(1, round(self._recent * (len(self._waiting) + self.running) / self.batch))

    def drain(self) -> None:
        """Take no new job; those waiting and running still finish."""
        with self._ready:
            self.draining = True
            self._ready.notify_all()

    def stop(self, timeout: float | None = None) -> None:
        """Drain, then wait for the thread to finish what it took."""
        self.drain()
        if self._thread is not None:
            self._thread.join(timeout)

    def cancel(self, job: Job) -> None:
        """Drop ``job``: out of the queue if it waits there, stopped at its next step if it runs."""
        job.drop()
        with self._ready:
            if job in self._waiting:
                self._waiting.remove(job)
                self.dropped += 1

    def _take(self) -> list[Job] | None:
        with self._ready:
            while not self._waiting and not self.draining:
                self._ready.wait()
            if not self._waiting:
                return None
            jobs = [self._waiting.popleft() for _ in range(min(self.batch, len(self._waiting)))]
            # a future marked running can no longer be cancelled by its handler, so its answer can always be set
            taken = [job for job in jobs if job.wanted() and job.future.set_running_or_notify_cancel()]
            self.dropped += len(jobs) - len(taken)
            self.running = len(taken)
            return taken

    def _loop(self) -> None:
        while (jobs := self._take()) is not None:
            try:
                self._run(jobs)
            finally:
                self.running = 0

    def _run(self, jobs: list[Job]) -> None:
        start = time.perf_counter()
        try:
            outcomes = self.runner(self.pipe, [self._armed(job) for job in jobs]) if jobs else []
        except Exception as error:  # noqa: BLE001 - a runner that fails whole fails each of its jobs
            outcomes = [error] * len(jobs)
        seconds = time.perf_counter() - start
        images = failed = 0
        for job, outcome in zip(jobs, outcomes):
            if isinstance(outcome, BaseException):
                failed += not isinstance(outcome, WorkDropped)
                self.dropped += isinstance(outcome, WorkDropped)
                job.future.set_exception(outcome)
            else:
                images += job.images
                job.future.set_result(outcome)
        if jobs:
            self._recent = 0.7 * self._recent + 0.3 * seconds / len(jobs)
        self.on_finished(Finished(images, seconds, failed))

    def _armed(self, job: Job) -> dict:
        """The job's call with its generator, and a step callback that stops it once it is no longer wanted."""
        call = {**job.call, "generator": torch.Generator("cpu").manual_seed(job.seed), "output_type": "pil"}
        if self._steps:
            def stop_when_unwanted(pipe, step, timestep, tensors):
                if not job.wanted():
                    raise WorkDropped(step + 1)
                return {}

            call["callback_on_step_end"] = stop_when_unwanted
        return call
