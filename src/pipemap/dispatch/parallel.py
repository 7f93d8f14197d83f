"""Speed from a second GPU: requests whose stages overlap (``iter_many``, which ``pipemap.run_many`` and
``pipemap.iter_many`` run).

Overlapped requests: diffusers keeps a call's state on the pipeline object (the scheduler's timesteps and step
index, ``_guidance_scale``, ...), so each request in flight runs on a twin of the pipeline: the same models (and
their hooks), its own scheduler and tokenizers. Every pipemap hook holds its component's lock for the whole of a
call (``hooks.CallLock``), so two requests never run one component at once, while the text encoder of request
k+1 and the VAE of request k-1 run beside the denoiser of request k when they sit on other GPUs: the stages
pipeline by themselves, with no schedule written down.

Memory bounds the requests in flight, not ``workers`` alone: given an ``admission.Admission`` (``pipemap.run_many``
makes one for a pipeline placed on GPUs), a request starts only when its activations, measured by a dry run at its
own shape, fit beside what is resident and what the running requests hold on every device it touches, and each of
its components' calls waits for its own share (``admission``); ``workers`` is then an upper bound.

A mapped pipeline called from several threads outside ``run_many`` has its calls take turns
(``dispatch/guard.py``): correct, never corrupted, not overlapped. The other speed from a second GPU, copies
of the denoiser sharing each call, is in hooks: a batch split (``hooks/replica.py``), guidance branches at once
(``hooks/guidance.py``, which keeps each request's calls apart by thread), one call's tokens split
(``hooks/sequence.py``).
"""

from __future__ import annotations

import contextlib
import copy
import queue
import threading
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..errors import ForeignHookError, RunManyCallError
from ..hooks import PlacementHook
from ..hooks.changes import remember
from ..runtime.admission import Admission
from .following import follow
from .guard import unguarded_class

_local = threading.local()


def current_request() -> int | None:
    """The index, among ``run_many``'s calls, of the request this thread runs; None outside ``run_many``."""
    return getattr(_local, "request", None)


def iter_many(pipe, calls: Iterable[Mapping], workers: int = 2, *, return_exceptions: bool = False,
              memory: Admission | None = None) -> Iterator:
    """Run the pipeline once per keyword dict of ``calls``, ``workers`` requests in flight, yielding each result as
    soon as it and those before it are done (``pipemap.run_many`` makes the list).

    The stages of different requests overlap where they sit on different devices (the text encoders of one request
    and the VAE of another run while the denoiser works); each component runs one request at a time. The images
    equal those of the same calls made one by one, provided each call brings its own ``generator`` (a shared
    generator, or none, is drawn from in whatever order the requests reach it). ``return_exceptions=True`` puts a
    failed call's exception in its place in the results instead of raising it. ``memory`` admits each request by
    the memory it needs (``admission.Admission``; ``pipemap.iter_many`` passes the pipeline's own). ``calls`` is
    read lazily on a thread of its own (at most ``2 * workers`` ahead), so it may be an endless iterator that
    blocks, e.g. ``iter(queue.get, None)``: an answer never waits for the next request.

    >>> for out in pipemap.iter_many(pipe, ({"prompt": p} for p in prompts)):               # doctest: +SKIP
    ...     out.images[0].save(...)
    """
    _ready(pipe, workers)
    return _results(pipe, calls, workers, return_exceptions, memory)  # checked now, run as it is iterated


def iter_unordered(pipe, calls: Iterable[Mapping], workers: int = 2, *, return_exceptions: bool = False,
                   memory: Admission | None = None) -> Iterator[tuple[int, Any]]:
    """``iter_many`` with each result yielded as soon as its own call is done, whatever those before it:
    ``(index, outcome)``, ``index`` the call's place in ``calls``. A short call sent after a long one is answered
    first (no head-of-line blocking). ``calls`` is read on a thread of its own, one call when a worker is free for
    it (never ahead): a call is settled when it can start, so a source that drops work meanwhile (serve's queue)
    never hands over a call nobody wants any more.

    >>> for index, out in pipemap.dispatch.parallel.iter_unordered(pipe, calls, workers=2):  # doctest: +SKIP
    ...     answers[index] = out.images[0]
    """
    _ready(pipe, workers)
    return _unordered(pipe, calls, workers, return_exceptions, memory)


def _ready(pipe, workers: int) -> None:
    """Checked before a run of requests starts: ``workers``, the pipeline's hooks, and its models followed."""
    if not isinstance(workers, int) or workers < 1:
        raise RunManyCallError("workers", workers, "give workers=N with N >= 1 requests in flight")
    _check_hooks(pipe)
    follow(pipe)  # the twins' calls do not follow (they share the models): a LoRA loaded since is placed once, here


@contextlib.contextmanager
def _running(pipe, workers: int) -> Iterator[tuple[ThreadPoolExecutor, queue.SimpleQueue]]:
    """The thread pool a run of requests uses and the pipeline's twins its threads take turns with; at the end the
    pool is shut down (what was not started is cancelled) and the requests' own changes are no change."""
    twins: queue.SimpleQueue = queue.SimpleQueue()
    for _ in range(workers):
        twins.put(twin(pipe))
    pool = ThreadPoolExecutor(workers, thread_name_prefix="pipemap-run_many")
    try:
        yield pool, twins
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        _remember(pipe)


def _unordered(pipe, calls: Iterable[Mapping], workers: int, return_exceptions: bool,
               memory: Admission | None) -> Iterator[tuple[int, Any]]:
    """The outcomes as they come: each submitted call's future reports to the feeder's own queue when it is done, so
    one queue carries the calls handed over (a Future), their ends (``(index, future)``) and the source's end."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    with _running(pipe, workers) as (pool, twins):

        def submit(index: int, call: dict) -> Future:
            future = pool.submit(_run_one, twins, index, call, memory)
            future.add_done_callback(lambda done: events.put((index, done)))
            return future

        feeder = _Feeder(calls, submit, workers, events)
        try:
            in_flight, ended = 0, False
            while not ended or in_flight:
                item = feeder.next()
                if item is None:
                    ended = True
                elif isinstance(item, Future):
                    in_flight += 1
                else:
                    in_flight -= 1
                    try:
                        yield item[0], _outcome(item[1], return_exceptions)
                    finally:
                        feeder.done()
        finally:
            feeder.stop()


def _results(pipe, calls: Iterable[Mapping], workers: int, return_exceptions: bool,
             memory: Admission | None) -> Iterator:
    """Each request's outcome in order, each yielded as soon as it is done: ``calls`` is read on a thread of its own
    (``_Feeder``), so a source that blocks (a request queue whose client waits for its answer before sending the
    next) never holds back an answer already computed."""
    with _running(pipe, workers) as (pool, twins):
        feeder = _Feeder(calls, lambda index, call: pool.submit(_run_one, twins, index, call, memory), 2 * workers)
        try:
            while True:
                future = feeder.next()
                if future is None:
                    return
                try:
                    yield _outcome(future, return_exceptions)
                finally:
                    feeder.done()
        finally:
            feeder.stop()


def _remember(pipe) -> None:
    """What the requests' own calls changed on the models is no change (as after a direct call: ``dispatch``):
    the twins run the unguarded class, so without this the next batch's ``follow`` would make the copies again."""
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module) and isinstance(getattr(module, "_hf_hook", None), PlacementHook):
            remember(module)


class _Feeder:
    """Reads ``calls`` on a daemon thread, at most ``ahead`` requests in flight, submitting each; ``next`` gives
    the futures in order (None at the end; the source's own error raised in its place), and whatever else was put
    on ``out``, the queue they go to."""

    def __init__(self, calls: Iterable[Mapping], submit, ahead: int, out: queue.SimpleQueue | None = None):
        self._submit, self._room = submit, threading.Semaphore(ahead)
        self._futures: queue.SimpleQueue = out if out is not None else queue.SimpleQueue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._feed, args=(iter(calls),), daemon=True,
                                        name="pipemap-iter_many-feed")
        self._thread.start()

    def _feed(self, calls: Iterator[Mapping]) -> None:
        index = 0
        try:
            while True:
                self._room.acquire()
                if self._stopped.is_set():
                    return
                call = next(calls, _END)
                if call is _END or self._stopped.is_set():
                    break
                if not isinstance(call, Mapping):
                    raise RunManyCallError(f"calls[{index}]", call, "each call is a dict of the pipeline's keyword "
                                           "arguments, e.g. {'prompt': 'a cat', 'generator': "
                                           "torch.Generator().manual_seed(0)}")
                self._futures.put(self._submit(index, call if isinstance(call, Settled) else dict(call)))
                index += 1
        except BaseException as err:  # the source's error (or a bad call): raised to the reader in its turn
            self._futures.put(err)
        self._futures.put(None)

    def next(self) -> Any:
        item = self._futures.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def done(self) -> None:
        self._room.release()  # an answer handed over: room for one more request

    def stop(self) -> None:
        """The reader is gone: read no more. A source that does not block (serve's) is done with at once, so what
        it took is in its taker's hands before this returns; one blocked (a queue) ends at its next item."""
        self._stopped.set()
        self._room.release()
        self._thread.join(timeout=1.0)


_END = object()


class Settled(dict):
    """A call with a last word once it may start (a twin is free and memory admits it): ``settle()`` gives the call
    to run, made from what is still wanted then (serve drops the members of a batch whose clients hung up while the
    batch waited), or raises to run nothing. A plain dict is run as it is."""

    def settle(self) -> dict:
        return self


def settled(call: Mapping) -> Mapping:
    return call.settle() if isinstance(call, Settled) else call


def _run_one(twins: queue.SimpleQueue, index: int, call: dict, memory: Admission | None):
    pipe = twins.get()
    _local.request = index
    try:
        if memory is None:
            return pipe(**settled(call))
        with memory.request(call, label=index):  # waits until its activations fit (a smaller settled call fits too)
            return pipe(**settled(call))
    finally:
        _local.request = None
        twins.put(pipe)


def _outcome(future: Future, return_exceptions: bool):
    error = future.exception()
    if error is None:
        return future.result()
    if return_exceptions:
        return error
    raise error


def _check_hooks(pipe) -> None:
    """Refuse hooks pipemap did not put there: accelerate's and diffusers' offload hooks move weights without a
    lock, so two requests at once would evict each other's weights mid-call."""
    for name, module in pipe.components.items():
        hook = getattr(module, "_hf_hook", None)
        if isinstance(module, torch.nn.Module) and hook is not None and not isinstance(hook, PlacementHook):
            raise ForeignHookError(name, type(hook).__name__)


def twin(pipe):
    """A pipeline object sharing ``pipe``'s models (and their hooks) with its own scheduler, tokenizers and call
    state: what one request in flight runs on. Calls of a twin do not take ``pipe``'s call lock: its class is the
    pipeline's own, not the guarded one (``dispatch/guard.py``)."""
    state = dict(pipe.__dict__)
    for name, value in pipe.components.items():
        if value is not None and not isinstance(value, torch.nn.Module):
            # a scheduler holds the step state; a fast tokenizer refuses a second thread changing its padding
            state[name] = copy.deepcopy(value)
    other: Any = object.__new__(unguarded_class(pipe))
    other.__dict__.update(state)
    return other
