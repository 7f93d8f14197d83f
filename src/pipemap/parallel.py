"""Speed from a second GPU: requests whose stages overlap (``run_many``), and denoiser replicas that split a batch.

Overlapped requests: diffusers keeps a call's state on the pipeline object (the scheduler's timesteps and step
index, ``_guidance_scale``, ...), so each request in flight runs on a twin of the pipeline: the same models (and
their hooks), its own scheduler and tokenizers. Every pipemap hook holds its component's lock for the whole of a
call (``hooks.CallLock``), so two requests never run one component at once, while the text encoder of request
k+1 and the VAE of request k-1 run beside the denoiser of request k when they sit on other GPUs: the stages
pipeline by themselves, with no schedule written down.

A mapped pipeline called from several threads outside ``run_many`` has its calls take turns (``guard_calls``):
correct, never corrupted, not overlapped.

Denoiser replicas (strategy ``"parallel"``): a whole copy of the denoiser on each of several GPUs; each call's
batch (classifier-free guidance concatenates the unconditional and conditional halves; ``num_images_per_prompt``)
is cut along its first dimension, the first part run on the home copy in the calling thread and each other part
on its own copy in a thread of its own, and the outputs joined in order on the home device. ``torch.nn.
DataParallel`` does the same cut for a training batch, but replicates the module at every call and gathers on one
device it owns; here the copies are made once, at dispatch, and live where the plan put them.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import itertools
import queue
import threading
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .errors import ForeignHookError, RunManyCallError
from .hooks import PlacementHook
from .transfer import move, move_tensor

_local = threading.local()
_CALL_LOCK = "_pipemap_call_lock"
_GUARDS: dict[type, type] = {}
_GUARDS_LOCK = threading.Lock()


def current_request() -> int | None:
    """The index, among ``run_many``'s calls, of the request this thread runs; None outside ``run_many``."""
    return getattr(_local, "request", None)


def run_many(pipe, calls: Iterable[Mapping], workers: int = 2, *, return_exceptions: bool = False) -> list:
    """Run the pipeline once per keyword dict of ``calls``, ``workers`` requests in flight, results in order.

    The stages of different requests overlap where they sit on different devices (the text encoders of one request
    and the VAE of another run while the denoiser works); each component runs one request at a time. The images
    equal those of the same calls made one by one, provided each call brings its own ``generator`` (a shared
    generator, or none, is drawn from in whatever order the requests reach it). ``return_exceptions=True`` puts a
    failed call's exception in its place in the results instead of raising it.

    >>> pipe = pipemap.load("path/to/sdxl", strategy="balanced", hardware="2x24GiB")          # doctest: +SKIP
    >>> calls = [{"prompt": p, "generator": torch.Generator().manual_seed(i)} for i, p in enumerate(prompts)]
    >>> images = [out.images[0] for out in pipemap.run_many(pipe, calls, workers=3)]          # doctest: +SKIP
    """
    return list(iter_many(pipe, calls, workers, return_exceptions=return_exceptions))


def iter_many(pipe, calls: Iterable[Mapping], workers: int = 2, *, return_exceptions: bool = False) -> Iterator:
    """``run_many`` as a generator: each result as soon as it and those before it are done; ``calls`` is read
    lazily (at most ``2 * workers`` ahead), so it may be an endless iterator, e.g. a request queue.

    >>> for out in pipemap.iter_many(pipe, ({"prompt": p} for p in prompts)):               # doctest: +SKIP
    ...     out.images[0].save(...)
    """
    if not isinstance(workers, int) or workers < 1:
        raise RunManyCallError("workers", workers, "give workers=N with N >= 1 requests in flight")
    _check_hooks(pipe)
    return _results(pipe, calls, workers, return_exceptions)  # checked now, run as it is iterated


def _results(pipe, calls: Iterable[Mapping], workers: int, return_exceptions: bool) -> Iterator:
    twins: queue.SimpleQueue = queue.SimpleQueue()
    for _ in range(workers):
        twins.put(twin(pipe))
    numbered = enumerate(calls)
    pool = ThreadPoolExecutor(workers, thread_name_prefix="pipemap-run_many")
    pending: collections.deque[Future] = collections.deque()

    def submit(item) -> None:
        index, call = item
        if not isinstance(call, Mapping):
            raise RunManyCallError(f"calls[{index}]", call, "each call is a dict of the pipeline's keyword arguments, "
                                   "e.g. {'prompt': 'a cat', 'generator': torch.Generator().manual_seed(0)}")
        pending.append(pool.submit(_run_one, twins, index, dict(call)))

    try:
        for item in itertools.islice(numbered, 2 * workers):
            submit(item)
        while pending:
            future = pending.popleft()
            item = next(numbered, None)  # keep the pool fed before waiting on the oldest request
            if item is not None:
                submit(item)
            yield _outcome(future, return_exceptions)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _run_one(twins: queue.SimpleQueue, index: int, call: dict):
    pipe = twins.get()
    _local.request = index
    try:
        return pipe(**call)
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
    state: what one request in flight runs on. Calls of a twin do not take ``pipe``'s call lock."""
    state = {k: v for k, v in pipe.__dict__.items() if k != _CALL_LOCK}
    for name, value in pipe.components.items():
        if value is not None and not isinstance(value, torch.nn.Module):
            # a scheduler holds the step state; a fast tokenizer refuses a second thread changing its padding
            state[name] = copy.deepcopy(value)
    other = object.__new__(unguarded_class(pipe))
    other.__dict__.update(state)
    return other


# ---- calls from several threads outside run_many --------------------------------------------------------------


def guard_calls(pipe) -> None:
    """Make calls of ``pipe`` from several threads take turns (re-entrant), as ``dispatch`` does for every mapped
    pipeline: a call's state lives on the pipeline object, so two at once would silently corrupt each other.

    Python looks ``__call__`` up on the class, so the pipeline gets a subclass of its own class (same name, module
    and behaviour) whose ``__call__`` holds the lock; ``unguard_calls`` gives the class back."""
    pipe.__dict__[_CALL_LOCK] = threading.RLock()
    pipe.__class__ = _guarded(unguarded_class(pipe))


def unguard_calls(pipe) -> None:
    pipe.__dict__.pop(_CALL_LOCK, None)
    pipe.__class__ = unguarded_class(pipe)


def unguarded_class(pipe) -> type:
    return type(pipe).__dict__.get("_pipemap_unguarded", type(pipe))


def _guarded(cls: type) -> type:
    with _GUARDS_LOCK:
        if cls not in _GUARDS:
            body = {"__call__": _taking_turns(cls.__call__), "_pipemap_unguarded": cls, "__module__": cls.__module__,
                    "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}
            _GUARDS[cls] = type(cls.__name__, (cls,), body)
        return _GUARDS[cls]


def _taking_turns(call):
    @functools.wraps(call)
    def taking_turns(self, *args, **kwargs):
        lock = self.__dict__.get(_CALL_LOCK)
        if lock is None:  # a new pipeline of the class (``type(pipe)(...)``) that no dispatch marked
            return call(self, *args, **kwargs)
        with lock:
            return call(self, *args, **kwargs)

    return taking_turns


# ---- denoiser replicas --------------------------------------------------------------------------------------------

class ReplicaHook(PlacementHook):
    """A resident denoiser with a copy on each of ``replicas``: each call's batch split across the copies.

    The first part runs on the module itself, in the calling thread, between ``pre_forward`` and ``post_forward``;
    the other parts start in ``pre_forward`` on threads of this hook's pool (inline on the dry run's stand-in
    devices, whose checking modes are thread-local) and are joined in ``post_forward``.
    """

    def __init__(self, component: str, device: str, execution_device: str, replicas: tuple[str, ...]):
        super().__init__(component, device, execution_device)
        self.replica_devices = tuple(torch.device(d) for d in replicas)
        self.replicas: list[torch.nn.Module] = []
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[list[Future]] = []  # one entry per call in progress (a stack: calls may nest)

    def init_hook(self, module):
        self.replicas = [replica(module, device) for device in self.replica_devices]
        return module

    def detach_hook(self, module):
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.replicas, self._pool, self._pending = [], None, []
        return module

    def pre_forward(self, module, *args, **kwargs):
        args, kwargs = super().pre_forward(module, *args, **kwargs)
        chunks = split_batch(args, kwargs, 1 + len(self.replicas))
        grad = torch.is_grad_enabled()  # grad mode is per thread: the pipeline's no_grad must reach the copies
        self._pending.append([self._start(r, d, c, grad) for r, d, c in
                              zip(self.replicas, self.replica_devices, chunks[1:])])
        return chunks[0]

    def post_forward(self, module, output):
        parts = [output] + [job.result() for job in self._pending.pop()]
        return super().post_forward(module, join_batch(parts) if len(parts) > 1 else output)

    def _start(self, module: torch.nn.Module, device: torch.device, chunk, grad: bool) -> Future:
        run = functools.partial(_run_replica, module, device, self.device, chunk, grad)
        if device.type == "meta":
            done: Future = Future()
            done.set_result(run())
            return done
        if self._pool is None:
            self._pool = ThreadPoolExecutor(len(self.replicas), thread_name_prefix=f"pipemap-{self.component}")
        return self._pool.submit(run)

    def __getstate__(self):  # a deep copy (the dry run's fake copy of a module) leaves the copies and threads behind
        return {**self.__dict__, "replicas": [], "_pool": None, "_pending": []}

    def __repr__(self) -> str:
        copies = ", ".join(str(d) for d in self.replica_devices)
        return f"ReplicaHook({self.component!r}, device={self.device}, replicas=[{copies}])"


def replica(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A copy of ``module`` whose weights are on ``device``, copied there straight from where they are (never
    through the home GPU); on the module's own device the copy shares the weights (inference only reads them)."""
    memo: dict[int, object] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if id(tensor) in memo:
            continue
        if tensor.device == device:
            memo[id(tensor)] = tensor
            continue
        moved = move_tensor(tensor.detach(), device)
        memo[id(tensor)] = torch.nn.Parameter(moved, requires_grad=False) if isinstance(
            tensor, torch.nn.Parameter) else moved
    copied = copy.deepcopy(module, memo)
    for name in ("_hf_hook", "_old_forward", "forward", "encode", "decode", "tiled_encode", "tiled_decode"):
        copied.__dict__.pop(name, None)  # a hooked module's traces: the copy runs its class's own methods
    return copied


def _run_replica(module, device: torch.device, home: torch.device, chunk, grad: bool):
    args, kwargs = move(chunk, device)
    on_gpu = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with torch.set_grad_enabled(grad), on_gpu:
        return move(module(*args, **kwargs), home)


def _batched(leaf, batch: int) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == batch


def split_batch(args: tuple, kwargs: dict, parts: int) -> list[tuple[tuple, dict]]:
    """``(args, kwargs)`` cut into up to ``parts`` calls along the batch: the first dimension of the first tensor
    that has one (the latents); every tensor of that first dimension is cut, everything else goes whole to each."""
    leaves, spec = tree_flatten((args, kwargs))
    batch = next((t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0), 0)
    parts = min(parts, batch)
    if parts < 2:
        return [(args, kwargs)]
    pieces = [leaf.tensor_split(parts) if _batched(leaf, batch) else [leaf] * parts for leaf in leaves]
    return [tree_unflatten([p[i] for p in pieces], spec) for i in range(parts)]


def join_batch(outputs: list):
    """The outputs of the parts of a call as one output: every tensor concatenated along the batch, in order."""
    flat = [tree_flatten(o)[0] for o in outputs]
    first, spec = tree_flatten(outputs[0])
    joined = [torch.cat([f[i] for f in flat]) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 else leaf
              for i, leaf in enumerate(first)]
    return tree_unflatten(joined, spec)
