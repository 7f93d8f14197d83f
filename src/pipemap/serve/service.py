"""The service behind the HTTP app: one pipeline loaded onto its plan, its request limits, queue, worker, metrics.

It knows nothing of HTTP, so the same service runs under uvicorn (``pipemap serve``) and in a Ray Serve replica.
"""

from __future__ import annotations

import functools
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

from .. import catalog
from ..api import Request, call_needs, load, memory_for, runnable
from ..cost import bytes_moved
from ..dispatch.parallel import iter_unordered
from ..errors import CallTooLargeError, DryRunDropped, NotAPipelineError, WorkDropped, format_bytes
from ..inventory import inventory_of
from ..plan import Plan
from ..runtime.admission import Admission
from .access import Access
from .home import home_page
from .metrics import Metrics
from .requests import Generation, GenerationRequest, Limits, RequestError, per_prompt, results_per_prompt
from .worker import Job, Worker


@dataclass(frozen=True)
class Options:
    """How a service is set up: what to load and how, and how it takes requests. Plain values, so a Ray replica
    can be given them."""

    path: str
    hardware: str | None = None
    strategy: str | Mapping[str, str] | None = "balanced"
    dtype: str | None = None
    variant: str | None = None
    headroom: float | None = None
    max_queue: int = 16
    timeout: float = 300.0
    max_n: int = 4
    workers: int | None = None  # requests in flight at most; None: as many as the plan's room holds at once
    max_steps: int | None = None  # None: what the pipeline's scheduler takes (``requests.scheduler_steps``)
    max_prompt: int = 4000  # characters
    names: tuple[str, ...] = ()  # the model names served; none: the path as given
    access: Access = Access()  # who may call, and how large a body may be
    max_batch: int = 1  # requests of one shape run as one call, at most; 1: no batching
    batch_window: float = 0.02  # seconds a request waits for others of its shape
    max_frames: int = 256  # frames a video request may ask for
    # a plan whose GPUs this machine lacks runs on the CPU: its requests are admitted by the CPU's room (the devices
    # they run on), unless this asks for the planned GPUs' budgets (tests of GPU admission on a machine without one)
    admit_as_planned: bool = False

    def served_names(self) -> tuple[str, ...]:
        return self.names or (self.path,)

    def request(self) -> Request:
        """What to load and how, as every verb takes it (the folder resolved in the Hugging Face cache)."""
        return Request.of(str(resolve_folder(self.path)), self.hardware, self.strategy, dtype=self.dtype,
                          variant=self.variant, headroom=self.headroom)


def pipeline_runner(workers: int, memory: Admission | None = None):
    """``runner(pipe, calls) -> (index, outcome)`` for the worker: ``iter_unordered`` (``run_many`` as a stream,
    each call's outcome as soon as it ends), so the stages of ``workers`` requests in flight overlap across devices,
    each admitted by the memory it needs (``memory``), and a short request is not answered behind a long one; a
    failed call's error is its outcome."""
    return functools.partial(iter_unordered, workers=workers, return_exceptions=True, memory=memory)


def default_workers(plan: Plan) -> int:
    """Requests in flight at once without a memory ledger: one per device a component computes on."""
    return len({p.execution_device for p in plan.components}) or 1


MOST_WORKERS = 8  # threads held for requests in flight, however much room a plan leaves


def workers_for(memory: Admission | None, plan: Plan, call: dict) -> int:
    """Requests in flight at most: as many calls like ``call`` (the pipeline's default size, one image) as the
    plan's room holds at once under the ledger's rule (every rest, and the largest extra beside them); memory admits
    each request anyway, so this only bounds the threads."""
    if memory is None:
        return default_workers(plan)
    try:
        needs = memory.needs(call)
    except CallTooLargeError:
        return 1
    fits = [(memory.ledger.room(d) - needs.most_extra(d)) // rest for d, rest in needs.rest.items() if rest > 0]
    return max(1, min([MOST_WORKERS, *fits]))


def sizes_for(plan: Plan, folder: Path) -> Admission:
    """What checks a request's activations against the room a plan with no GPU leaves in the host's memory: the
    same dry run per call shape as a GPU plan's ledger (``api.memory_for``), used only to refuse calls too large
    (the CPU runs them without admission)."""
    return Admission(plan, lambda asked, call: call_needs(str(folder), asked, call))


# a request this many times over a device's room, by a linear scaling of a smaller shape's measured peak, is refused
# without a dry run of its own: activations grow at least as the pixels (attention faster), and the margin covers the
# parts that do not grow (the text encoders), so no request that fits is refused by it
_SURE = 16


# what a RuntimeError's text says when the device itself is broken: every later call fails too, so the service stops
# taking work (not ready, /health 503) and the process must be restarted
STICKY = ("illegal memory access", "device-side assert", "unspecified launch failure", "misaligned address",
          "uncorrectable ecc error")


class Service:
    """A pipeline, the plan it runs on, and the queue in front of it. ``runner``: an ordered runner for the worker
    (``worker.run_sequential``); by default the pipeline's unordered one (``pipeline_runner``).

    >>> service = Service.load(Options("path/to/sdxl", hardware="2x24GiB"))                  # doctest: +SKIP
    >>> app = pipemap.serve.create_app(service)      # an ASGI app: uvicorn, or a Ray Serve replica
    """

    def __init__(self, pipe, plan: Plan, running_plan: Plan | None = None, *, max_queue: int = 16,
                 timeout: float = 300.0, max_n: int = 4, workers: int | None = None, runner=None,
                 memory: Admission | None = None, sizes: Admission | None = None, max_steps: int | None = None,
                 max_prompt: int = 4000, names: tuple[str, ...] = (), access: Access | None = None,
                 max_batch: int = 1, batch_window: float = 0.02, max_frames: int = 256):
        self.pipe, self.plan, self.running_plan = pipe, plan, running_plan or plan
        self.timeout = timeout
        self.limits = Limits.of(pipe, max_n, max_steps=max_steps, max_prompt=max_prompt, names=names,
                                max_frames=max_frames)
        self.names = names or ("pipemap",)
        self.access = access or Access()
        self.memory = memory  # the ledger requests are admitted by (``api.memory_for``); None: no GPU in the plan
        self.sizes = memory or sizes  # what refuses calls too large for the plan's room (CPU plans too)
        self._measured: list[tuple[int, dict[str, int]]] = []  # (pixels x images, peak per device) seen
        self.broken: str | None = None  # a sticky device error: the process must be restarted
        self.created = int(time.time())
        pipe.set_progress_bar_config(disable=True)
        one = {"prompt": "a", per_prompt(self.limits.parameters): 1}
        self.workers = workers or workers_for(memory, self.running_plan, one)
        self.worker = Worker(pipe, runner or pipeline_runner(self.workers, memory), max_queue, in_flight=self.workers,
                             max_batch=max_batch, batch_window=batch_window, fits=self.fits, ordered=runner is not None)
        self.metrics = Metrics(pipe, self.worker, memory)
        self.worker.on_finished = self.metrics.finished
        self._home: str | None = None

    @classmethod
    def load(cls, options: Options, plan: Plan | None = None) -> Service:
        """Plan ``options.path`` (for ``options.hardware``, or this machine) unless ``plan`` is given, load it onto
        the plan, and serve it; planned devices this machine lacks run on the CPU, and requests are admitted by the
        room of the devices they run on (``options.admit_as_planned``: by the planned devices' budgets)."""
        folder = resolve_folder(options.path)
        plan = plan or make_plan(options)
        running = runnable(plan)
        pipe = load(folder, plan=running, progress=False)
        memory = memory_for(pipe, plan if options.admit_as_planned else running, source=str(folder))
        return cls(pipe, plan, running, max_queue=options.max_queue, timeout=options.timeout, max_n=options.max_n,
                   workers=options.workers, memory=memory, sizes=None if memory else sizes_for(running, folder),
                   max_steps=options.max_steps, max_prompt=options.max_prompt, names=options.served_names(),
                   access=options.access, max_batch=options.max_batch, batch_window=options.batch_window,
                   max_frames=options.max_frames)

    def start(self) -> None:
        self.worker.start()

    def drain(self) -> None:
        """Take no new work; what was taken still finishes (an exit signal's first step)."""
        self.worker.drain()

    def drop(self) -> None:
        """Take no new work and drop all that was taken: waiting jobs leave the queue, running ones stop at their next
        step (a second exit signal's doing; it waits for nothing)."""
        self.worker.drop()

    def stop(self, grace: float | None = None) -> None:
        """Drain: the work taken may finish for ``grace`` seconds (the timeout by default); then what is still
        waiting or running is dropped (stopped at its next step) and the worker given a few seconds more."""
        self.worker.stop(self.timeout if grace is None else grace)

    def submit(self, request: GenerationRequest, dropped: threading.Event | None = None,
               deadline: float | None = None) -> tuple[Generation, Job]:
        """The checked request and its job, queued (RequestError, QueueFullError or DrainingError if not). A request
        whose activations fit the plan's room on no device, even alone, is a RequestError with the figures (its
        shape's dry run, once, may take seconds: the app calls this off its event loop). ``dropped`` (set: the
        client left) and ``deadline`` (``time.monotonic()``; by default the request's timeout from now) bound that
        dry run too: it stops at its next operation once the request is not wanted, and nothing is queued
        (``WorkDropped``)."""
        seed = request.seed if request.seed is not None else secrets.randbits(31)
        generation = self.limits.check(request, seed)
        timeout = self.timeout_of(request)
        job = Job(generation.call, seed, generation.n, deadline or time.monotonic() + timeout, timeout,
                  dropped=dropped or threading.Event())
        if self.sizes is not None:
            try:
                self._check_room(generation, job.wanted)
            except DryRunDropped:
                raise WorkDropped(0) from None
        if not job.wanted():
            raise WorkDropped(0)
        self.worker.submit(job)
        job.future.add_done_callback(lambda done: done.cancelled() or self.notice(done.exception()))
        return generation, job

    def timeout_of(self, request: GenerationRequest) -> float:
        """Seconds ``request`` may take: its own ``timeout``, at most the server's."""
        return min(self.timeout, request.timeout or self.timeout)

    def _check_room(self, generation: Generation, wanted=None) -> None:
        """A RequestError with the figures when the call's activations fit the plan's room on no device, even alone:
        sure by arithmetic (``_floor``, the shapes measured so far), else by its own shape's dry run (stopped once
        ``wanted()`` is false)."""
        assert self.sizes is not None
        param = "n" if generation.n > 1 else "num_frames" if "num_frames" in generation.call else "size"
        work = _work(generation.call, video="num_frames" in self.limits.parameters)
        for device, needs, seen in [*self._floor(work), *self._scaled(work)]:
            room = self.sizes.ledger.room(device)
            if needs > (_SURE * room if seen else room):
                source = f"scaled from {format_bytes(seen)} measured at a smaller size" if seen else \
                    "its decoded images alone, as 16-bit floats"
                raise RequestError(param, f"the call needs about {format_bytes(needs)} of activations on {device} "
                                   f"({source}), but the plan leaves {format_bytes(room)} there beside its weights: "
                                   "ask for a smaller size or fewer images", "insufficient_memory")
        try:
            self._seen(work, self.sizes.needs(generation.call, wanted).peak)
        except CallTooLargeError as err:
            self._seen(work, {err.device: err.needs})
            raise RequestError(param, str(err), "insufficient_memory") from None

    def _floor(self, work: int | None) -> list[tuple[str, int, int]]:
        """``(device, bytes, 0)``: what the call needs at least where its VAE decodes, by arithmetic alone: its
        pixels, three channels of 16-bit floats (no pipeline decodes in fewer bytes)."""
        assert self.sizes is not None
        decodes = {p.component: p.execution_device for p in self.sizes.plan.components}.get("vae")
        return [] if work is None or decodes is None else [(decodes, work * 3 * 2, 0)]

    def _seen(self, work: int | None, peak: dict[str, int]) -> None:
        if work and len(self._measured) < 64:  # a few shapes suffice to scale from; a flood of sizes adds none
            self._measured.append((work, peak))

    def _scaled(self, work: int | None):
        """``(device, bytes, measured bytes)``: each measured smaller shape's peak scaled linearly to ``work``."""
        for seen, peak in list(self._measured):
            if work is not None and seen < work:
                yield from ((device, bytes_ * work // seen, bytes_) for device, bytes_ in peak.items())

    def fits(self, call: dict) -> bool:
        """Whether one call like ``call`` (prompts as a list: a batch) fits the plan's room on every device, alone:
        a batch of k takes k times one request's activations (its shape measured when it was submitted), so no batch
        size costs a dry run here (a GPU plan's ledger measures the batch's own shape before it runs)."""
        if self.sizes is None:
            return True
        prompts = call.get("prompt")
        k = len(prompts) if isinstance(prompts, list) else 1
        one = {name: value[0] if name in ("prompt", "negative_prompt") and k > 1 else value
               for name, value in call.items()}
        try:
            peak = self.sizes.needs(one).peak
        except CallTooLargeError:
            return False
        return all(k * needs <= self.sizes.ledger.room(device) for device, needs in peak.items())

    def plan_json(self) -> dict:
        """The plan as made (with the moves an out-of-memory error caused since, in its notes); where it runs on
        other devices (planned GPUs this machine lacks), ``runs_on`` says."""
        plan, running = (self.memory.plan, self.memory.running) if self.memory else (self.plan, self.running_plan)
        data = plan.to_dict()
        if running != plan:
            data["runs_on"] = running.device_map
        return data

    def home_page(self) -> str:
        """The server's home page: the plan as made, drawn with its bytes moved per image, and a prompt box."""
        if self._home is None:
            moved = bytes_moved(self.plan, inventory_of(self.pipe))
            self._home = home_page(self.plan, type(self.pipe).__name__, moved={k: v for k, v in moved.items() if v})
        return self._home

    def health(self) -> dict:
        status = "device_error" if self.broken is not None else "draining" if self.worker.draining else "ok"
        return {"status": status, "queue_depth": self.worker.depth, "running": self.worker.running}

    def notice(self, err: BaseException | None) -> bool:
        """Whether ``err``, a request's failure, is a sticky device error (every later call on the device fails
        too): then the service is ``broken``, takes no more work and says so in ``health``/``readiness``, so an
        orchestrator restarts the process."""
        if isinstance(err, RuntimeError) and any(words in str(err).lower() for words in STICKY):
            self.broken = self.broken or f"{type(err).__name__}: {str(err)[:300]}"
            return True
        return False

    def readiness(self) -> str | None:
        """Why this service takes no work now (a sticky device error, a drain), or None when it is ready."""
        if self.broken is not None:
            return f"device error: {self.broken}"
        return "draining" if self.worker.draining else None


class Loading:
    """A service loaded on a thread of its own while the app already answers (``pipemap serve``): until it is
    loaded, ``/health/live`` is 200, ``/health/ready`` and ``/health`` 503 with the reason, every other route 503
    JSON with a Retry-After; then the loaded ``service`` answers. ``load`` makes the service
    (``Service.load(options)`` by default); ``on_ready(service)`` and ``on_failed(error)`` hear how it went.

    >>> pipemap.serve.run(Loading(Options("path/to/sdxl", hardware="2x24GiB")))               # doctest: +SKIP
    """

    RETRY_AFTER = 5  # seconds: a load takes seconds to minutes; a client polling faster learns nothing more

    def __init__(self, options: Options, load=None, on_ready=None, on_failed=None):
        self.options, self.access, self.timeout = options, options.access, options.timeout
        self._load = load or (lambda: Service.load(options))
        self.on_ready = on_ready or (lambda service: None)
        self.on_failed = on_failed or (lambda error: None)
        self.service: Service | None = None
        self.failed: BaseException | None = None
        self.draining = False
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # a drain and the end of the load: one before the other

    def reason(self) -> str:
        """Why no request is taken yet: loading, its failure, or a drain that came first."""
        if self.failed is not None:
            return f"the pipeline failed to load: {type(self.failed).__name__}: {self.failed}"
        return "draining" if self.draining else "loading"

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pipemap-serve-load", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            service = self._load()
            with self._lock:
                if self.draining:  # stopped while it loaded: it never takes work
                    service.drain()
                    return
                service.start()
                self.service = service
        except BaseException as error:  # noqa: BLE001 - reported to the server, which stops
            self.failed = error
            self.on_failed(error)
            return
        self.on_ready(service)

    def drain(self) -> None:
        with self._lock:
            self.draining = True
        if self.service is not None:
            self.service.drain()

    def drop(self) -> None:
        self.drain()
        if self.service is not None:
            self.service.drop()

    def stop(self, grace: float | None = None) -> None:
        self.drain()
        if self.service is not None:
            self.service.stop(grace)


def _work(call: dict, video: bool = False) -> int | None:
    """Pixels times images times frames: what activations grow with; None when the size, or a video pipeline's
    frames, are the pipeline's default (a default is no figure to scale by)."""
    if "width" not in call or (video and "num_frames" not in call):
        return None
    return call["width"] * call["height"] * results_per_prompt(call) * call.get("num_frames", 1)


def make_plan(options: Options) -> Plan:
    """The plan ``options`` ask for (``headroom="measure"``: the planner and the dry run composed)."""
    return options.request().plan()


def resolve_folder(name: str) -> Path:
    """A pipeline folder, or a catalog name or Hub repo id resolved to its folder in the Hugging Face cache
    (downloaded there first when online)."""
    folder = Path(name)
    if folder.is_dir():
        return folder
    known = catalog.resolve(name)
    repo = catalog.entry(known).repo if known else name
    try:
        return Path(snapshot_download(repo))
    except (LocalEntryNotFoundError, HFValidationError) as error:
        raise NotAPipelineError(name, f"it is not a folder, and the Hub repository {repo!r} is not in the Hugging "
                                f"Face cache and could not be downloaded ({type(error).__name__})") from None
