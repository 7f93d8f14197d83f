"""Requests admitted by memory, not by a worker count: a ledger of the activation bytes each running request holds on
each device, against the room the plan leaves there beside its weights.

A plan reserves room for one call. ``run_many`` and serve run several at once, and two components on one GPU run at
the same time (one request's VAE decode beside another's denoiser), so their activations add. Here each call's
figures come from a dry run at its own shape (``Needs``, cached by ``call_shape``), in two parts per device: ``rest``,
what the call holds for its whole course (latents, embeddings, what pipeline code allocates between components), and
``extra[component]``, what each component's call adds on top while it runs.

The rule (``MemoryLedger``), per device, with ``room`` = memory less what the plan keeps there beside activations
(``kept``: the most weight bytes it holds, and on a GPU the caching allocator's slack of each stream pool the plan
uses there, ``modes.slack``, as the planner's budgets keep it: activations are allocated in the same segments):

- a request is admitted (its ``rest`` reserved until it ends) when it fits beside what is held now, and when every
  running request's largest ``extra`` would still fit beside all the rests: so the first component call waiting on a
  device always fits once the calls running there end, and requests never wait on each other in a circle;
- a component call is admitted (its ``extra`` reserved while it runs) when it fits beside what is held; calls wait
  in the order they came on each device, requests in the order they came: none starves.

``Admission`` blocks threads on the ledger (``run_many``, serve); the dry run's ``simulate_many`` drives the same
ledger with a clock of its own. A component's hook passes ``component_call``, which also retries a call once after an
out-of-memory error, once ``Admission.relieve`` has moved resident components of that device to the host.
"""

from __future__ import annotations

import collections
import contextlib
import math
import re
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CallTooLargeError, DryRunDropped
from ..modes import Peak, facts, resolve_ranks, slack, splits
from ..plan import Plan
from ..units import format_bytes, parse_bytes

# ---- what a call needs ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Needs:
    """One call's activation bytes per device: ``rest`` held for its whole course, and ``extra[component]`` more
    during each call of that component. ``phase``: what set each device's peak in the dry run."""

    rest: Mapping[str, int]
    extra: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    phase: Mapping[str, str] = field(default_factory=dict)

    def most_extra(self, device: str) -> int:
        return max((e.get(device, 0) for e in self.extra.values()), default=0)

    @property
    def peak(self) -> dict[str, int]:
        """The most the call holds on each device: its rest and its largest extra."""
        devices = set(self.rest) | {d for e in self.extra.values() for d in e}
        return {d: self.rest.get(d, 0) + self.most_extra(d) for d in sorted(devices)}

    def scaled(self, measured: Mapping[str, int]) -> Needs:
        """These needs with each measured device's peak replaced by ``measured`` (an allocator's figure), every
        part on that device scaled alike."""
        peak = self.peak
        factor = {d: b / peak[d] for d, b in measured.items() if peak.get(d)}

        def at(device: str, value: int) -> int:
            return math.ceil(value * factor.get(device, 1.0))

        rest = {d: at(d, v) for d, v in self.rest.items()}
        rest.update({d: b for d, b in measured.items() if not peak.get(d)})
        return Needs(rest, {c: {d: at(d, v) for d, v in e.items()} for c, e in self.extra.items()}, self.phase)

    def grown(self, component: str, device: str, more: int) -> Needs:
        """These needs with ``component``'s extra on ``device`` ``more`` bytes larger (an out-of-memory error
        showed the dry run's figure short)."""
        extra = {c: dict(e) for c, e in self.extra.items()}
        extra.setdefault(component, {})[device] = extra.get(component, {}).get(device, 0) + more
        return Needs(self.rest, extra, self.phase)


# call keywords that change no device memory: the seed, the host conversion, callbacks
_UNSHAPED = frozenset({"generator", "output_type", "return_dict", "callback_on_step_end",
                       "callback_on_step_end_tensor_inputs", "callback", "callback_steps"})
TEXT_BUCKET = 256  # characters: one figure per 256 characters of prompt, measured at the longest of them


def call_shape(call: Mapping) -> tuple:
    """What of a call sets its activation memory, as a cache key: sizes, images, frames, tensors' shapes, whether
    guidance doubles the batch, steps up to 2 (steps repeat), prompt length by ``TEXT_BUCKET`` characters; not the
    seed, the prompt's words, the output type or callbacks."""
    return tuple((name, _shape(name, value)) for name, value in sorted(call.items()) if name not in _UNSHAPED)


def _shape(name: str, value: Any) -> Any:
    if name == "num_inference_steps" and isinstance(value, int):
        return min(value, 2)
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return ("text", len(value) // TEXT_BUCKET) if "prompt" in name else value
    if isinstance(value, float) and ("guidance" in name or "cfg" in name):
        return ("guided", value > 1)  # classifier-free guidance doubles the batch above 1, whatever the scale
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return (len(value), *dict.fromkeys(_shape(name, v) for v in value))
    if hasattr(value, "shape"):
        return ("array", tuple(value.shape), str(getattr(value, "dtype", "")))
    if hasattr(value, "size") and hasattr(value, "mode"):  # a PIL image
        return ("image", tuple(value.size), value.mode)
    return type(value).__name__


def measured_call(call: Mapping) -> dict:
    """The call a dry run measures for ``call``'s shape: each prompt made as long as the longest of its bucket, so
    the figure holds for every call of the shape (a pipeline that does not pad its prompts, Qwen-Image's, grows with
    them); the caller's generator and callbacks left out (the dry run draws from none of them); the steps as the
    shape counts them (steps repeat: a 200-step request is measured in 2, not 200)."""
    return {name: _longest(value) if "prompt" in name else _shape(name, value) if name == "num_inference_steps"
            else value for name, value in call.items() if name not in _UNSHAPED}


def _longest(value: Any) -> Any:
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return [_longest(v) for v in value]
    if not isinstance(value, str) or not value:
        return value
    target = (len(value) // TEXT_BUCKET + 1) * TEXT_BUCKET - 1
    text = value
    while len(text) < target:
        text += " " + value
    return text[:target]


def weights_ceiling(plan: Plan) -> dict[str, int]:
    """The most weight bytes each device holds at once: the plan's figure, plus what an offload room larger than
    the largest component offloaded there lets it keep onloaded besides."""
    out = {d.device: d.used for d in plan.devices}
    for device in out:
        offloaded = [p for p in plan.components if facts(p.mode).peak is Peak.ONLOADED and p.execution_device == device]
        if offloaded:
            out[device] += max(0, max(p.room for p in offloaded) - max(p.bytes for p in offloaded))
    return out


def kept(plan: Plan) -> dict[str, int]:
    """What the plan keeps on each device beside a call's activations: its most weight bytes (``weights_ceiling``)
    and the allocator's slack of the stream pools it uses there (``modes.slack``: none on the CPU or a stand-in GPU)."""
    memory = {d.device: d.memory for d in plan.devices}
    return {d: b + slack(plan.components, d, memory[d]) for d, b in weights_ceiling(plan).items()}


def too_large(ledger: MemoryLedger, needs: Needs, device: str, call: Mapping) -> CallTooLargeError:
    """The error for a call whose needs on ``device`` exceed its room even alone, with what to ask for instead:
    fewer images, a smaller size (activations grow with the pixels), VAE tiling when decoding set the peak."""
    need, room = needs.peak[device], ledger.room(device)
    share = max(room, 0) / need
    advice = []
    images = call.get("num_images_per_prompt") or 1
    if isinstance(images, int) and images > 1 and images * share >= 1:
        fit = math.floor(images * share)
        advice.append(f"ask for at most {fit} image{'s' if fit > 1 else ''} a request")
    height, width = call.get("height"), call.get("width")
    if isinstance(height, int) and isinstance(width, int):
        side = math.sqrt(share)
        advice.append(f"a smaller size (about {_eighth(width * side)}x{_eighth(height * side)} or less)")
    else:
        advice.append("a smaller size")
    phase = needs.phase.get(device, "")
    if phase.startswith("VAE decode"):
        advice.append("VAE tiling (pipe.vae.enable_tiling())")
    return CallTooLargeError(device, need, room, ledger.memory.get(device, 0), phase, tuple(advice))


def _eighth(side: float) -> int:
    return max(8, int(side) // 8 * 8)


# ---- the rule -------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Lease:
    """A request under the ledger: its label, its needs, the shape they were measured at, and how many component
    calls are open on its thread (a call inside another runs under the outer one's reservation)."""

    label: object
    needs: Needs
    shape: tuple = ()
    depth: int = 0
    owner: object = None  # the ``Admission`` it runs under: on a shared ledger, whose history records it


@dataclass(eq=False)
class Ticket:
    """A wait for room: a request's ``rest`` (``component`` None) or one component call's extra, ``bytes`` per
    device."""

    lease: Lease
    component: str | None
    bytes: Mapping[str, int]
    admitted: bool = False
    waited: bool = False


@dataclass(frozen=True)
class Admitted:
    """One admission as the ledger recorded it: whose, each device's weights and reservations after it, and how
    many requests were admitted then."""

    label: object
    component: str | None
    total: Mapping[str, int]
    running: int = 0


class MemoryLedger:
    """Each device's memory, what the plan keeps there beside activations (``weights``: ``kept``, its weights and
    the allocator's slack), and the activation bytes reserved by the requests admitted: the admission rule, with no
    clock and no thread (``Admission`` blocks threads on it, the dry run's ``simulate_many`` drives it with a clock
    of its own). ``history`` keeps the latest admissions."""

    def __init__(self, memory: Mapping[str, int], weights: Mapping[str, int], history: int = 4096):
        self.memory, self.weights = dict(memory), dict(weights)
        self.changed = threading.Condition()  # what threads admitted on this ledger (``Admission``) wait on
        self.rest: collections.Counter = collections.Counter()
        self.extra: collections.Counter = collections.Counter()
        self.running: list[Lease] = []
        self.waiting: list[Ticket] = []
        self.history: collections.deque[Admitted] = collections.deque(maxlen=history)
        self.waits = 0  # tickets that had to wait
        self.admitted = 0  # requests admitted so far

    @classmethod
    def of(cls, plan: Plan) -> MemoryLedger:
        return cls({d.device: d.memory for d in plan.devices}, kept(plan))

    def room(self, device: str) -> int:
        return self.memory.get(device, 0) - self.weights.get(device, 0)

    def join(self, owner: object, memory: Mapping[str, int], weights: Mapping[str, int],
             alive: Callable[[], bool] | None = None) -> MemoryLedger:
        """``owner`` (an ``Admission``) admits its requests here, over ``memory`` with ``weights`` on each device,
        while ``alive()``; what it reads the ledger by. A ledger of its own was made with them already."""
        return self

    def reweigh(self, owner: object, weights: Mapping[str, int]) -> None:
        """``owner``'s components were re-placed (``relief``): its devices now keep ``weights``."""
        self.weights = dict(weights)

    def held(self) -> dict[str, int]:
        """Activation bytes reserved on each device now."""
        return {d: self.rest[d] + self.extra[d] for d in self.memory}

    def too_large(self, needs: Needs) -> str | None:
        """The first device where ``needs`` do not fit even when the call runs alone, or None."""
        return next((d for d, peak in needs.peak.items() if peak > self.room(d)), None)

    def stranded(self, ticket: Ticket) -> tuple[str, int] | None:
        """Where a waiting component call can never be admitted, and what it needs there with its request's rest;
        None while it may be: its request is the only one running, no other call holds anything there, and its
        bytes do not fit beside its request's rest. Nothing then can free room for it (the room shrank under it: a
        relief's re-placing, a pipeline joining the shared ledger), and waiting would wait forever."""
        if ticket.component is None or any(lease is not ticket.lease for lease in self.running):
            return None
        return next(((d, self.rest[d] + b) for d, b in ticket.bytes.items()
                     if b > 0 and self.extra[d] == 0 and self.rest[d] + b > self.room(d)), None)

    def offer(self, ticket: Ticket) -> bool:
        """Queue ``ticket`` and admit what the rule lets go; whether ``ticket`` is admitted already."""
        self.waiting.append(ticket)
        self.grant()
        if not ticket.admitted:
            ticket.waited = True
            self.waits += 1
        return ticket.admitted

    def grant(self) -> list[Ticket]:
        """Admit every waiting ticket that may go, in order: requests one after another, component calls first
        come first served on each device they need."""
        admitted: list[Ticket] = []
        blocked: set[str] = set()
        requests_wait = False
        for ticket in list(self.waiting):
            if ticket.component is None:
                if requests_wait or not self._request_fits(ticket.lease.needs):
                    requests_wait = True
                    continue
            else:
                devices = {d for d, b in ticket.bytes.items() if b > 0}
                if devices & blocked or not self._call_fits(ticket.bytes):
                    blocked |= devices
                    continue
            self._admit(ticket)
            admitted.append(ticket)
        return admitted

    def release(self, ticket: Ticket) -> None:
        """A component call ended (its extra freed), or a request did (its rest freed); call ``grant`` next."""
        held = self.extra if ticket.component is not None else self.rest
        for device, size in ticket.bytes.items():
            held[device] -= size
        if ticket.component is None:
            self.running.remove(ticket.lease)

    def _request_fits(self, needs: Needs) -> bool:
        for device in set(self.memory) | set(needs.peak):
            rest = self.rest[device] + needs.rest.get(device, 0)
            most = max([needs.most_extra(device), *(lease.needs.most_extra(device) for lease in self.running)])
            if rest + max(self.extra[device], most) > self.room(device):
                return False
        return True

    def _call_fits(self, extra: Mapping[str, int]) -> bool:
        return all(self.rest[d] + self.extra[d] + b <= self.room(d) for d, b in extra.items() if b > 0)

    def _admit(self, ticket: Ticket) -> None:
        self.waiting.remove(ticket)
        ticket.admitted = True
        held = self.extra if ticket.component is not None else self.rest
        for device, size in ticket.bytes.items():
            held[device] += size
        if ticket.component is None:
            self.running.append(ticket.lease)
            self.admitted += 1
        total = {d: self.weights.get(d, 0) + b for d, b in self.held().items()}
        self.history.append(Admitted(ticket.lease.label, ticket.component, total, len(self.running)))


class SharedLedger(MemoryLedger):
    """The ledger the placed pipelines of one process admit their requests on (``shared_ledger``): two pipelines on
    one GPU each reserve their calls' activations from the same room, so together they never exceed it (issue 39).

    Each device's room is the smallest its members plan there, as ``hooks.moving.SharedCache`` takes the smallest
    offload room: a plan is made on the memory free when it is made, so a pipeline planned after another saw the
    other's weights as taken, and its room is the one still true once both are placed. One ledger for every device,
    not one per device: a request that spans two GPUs is admitted on both at once, in one queue. A member dropped
    (its pipeline reset or collected) leaves by itself, and the rooms are the rest's again.
    """

    def __init__(self, history: int = 4096):
        super().__init__({}, {}, history)
        self.members: weakref.WeakKeyDictionary[object, _Member] = weakref.WeakKeyDictionary()
        self.views: weakref.WeakKeyDictionary[object, LedgerView] = weakref.WeakKeyDictionary()

    def join(self, owner: object, memory: Mapping[str, int], weights: Mapping[str, int],
             alive: Callable[[], bool] | None = None) -> MemoryLedger:
        with self.changed:
            self.members[owner] = _Member(dict(memory), dict(weights), alive or (lambda: True))
            self._smallest()
            view = self.views[owner] = LedgerView(self, owner, self.history.maxlen or 0)
            return view

    def _admit(self, ticket: Ticket) -> None:
        super()._admit(ticket)
        view = self.views.get(ticket.lease.owner) if ticket.lease.owner is not None else None
        if view is not None:
            view.history.append(self.history[-1])

    def reweigh(self, owner: object, weights: Mapping[str, int]) -> None:
        with self.changed:
            found = self.members.get(owner)
            if found is not None:
                self.members[owner] = _Member(found.memory, dict(weights), found.alive)
                self._smallest()

    def room(self, device: str) -> int:
        self._smallest()  # a member collected since leaves its room behind
        return super().room(device)

    def _smallest(self) -> None:
        """Each device's memory and weights: its member's with the smallest room there."""
        memory: dict[str, int] = {}
        weights: dict[str, int] = {}
        for owner, member in list(self.members.items()):
            if not member.alive():  # its pipeline reset: an admission in a reference cycle may outlive it a while
                self.members.pop(owner, None)
                continue
            for device, size in member.memory.items():
                held = member.weights.get(device, 0)
                if device not in memory or size - held < memory[device] - weights[device]:
                    memory[device], weights[device] = size, held
        self.memory, self.weights = memory, weights


class LedgerView(MemoryLedger):
    """One pipeline's view of the shared ledger (its ``Admission.ledger``): the shared rule, rooms and reservations,
    with the history of its own admissions (each record's totals the shared ledger's)."""

    def __init__(self, shared: SharedLedger, owner: object, history: int):
        self.shared, self.owner = shared, weakref.ref(owner)
        self.history = collections.deque(maxlen=history)

    # what ``Admission`` and its readers ask of a ledger, answered by the shared one
    memory = property(lambda self: self.shared.memory)
    weights = property(lambda self: self.shared.weights)
    running = property(lambda self: self.shared.running)
    waiting = property(lambda self: self.shared.waiting)
    admitted = property(lambda self: self.shared.admitted)
    waits = property(lambda self: self.shared.waits)
    changed = property(lambda self: self.shared.changed)

    def room(self, device: str) -> int:
        return self.shared.room(device)

    def held(self) -> dict[str, int]:
        return self.shared.held()

    def offer(self, ticket: Ticket) -> bool:
        return self.shared.offer(ticket)

    def grant(self) -> list[Ticket]:
        return self.shared.grant()

    def release(self, ticket: Ticket) -> None:
        self.shared.release(ticket)

    def stranded(self, ticket: Ticket) -> tuple[str, int] | None:
        return self.shared.stranded(ticket)

    def reweigh(self, owner: object, weights: Mapping[str, int]) -> None:
        self.shared.reweigh(owner, weights)


@dataclass(frozen=True)
class _Member:
    """A pipeline's admission on the shared ledger: its plan's memory and weights per device, and whether it is
    still its pipeline's."""

    memory: dict[str, int]
    weights: dict[str, int]
    alive: Callable[[], bool]


_SHARED: list[SharedLedger] = []
_MAKING = threading.Lock()


def shared_ledger() -> SharedLedger:
    """The process's one ledger for placed pipelines' requests (``api.memory_for``)."""
    with _MAKING:
        if not _SHARED:
            _SHARED.append(SharedLedger())
        return _SHARED[0]


# ---- threads on the ledger ------------------------------------------------------------------------------------


class Gate:
    """Component calls pass it together; an out-of-memory move closes it: it waits for the calls inside to end and
    holds new ones back until the move is done (a readers-writer lock whose writer goes first)."""

    def __init__(self):
        self._changed = threading.Condition()
        self._closer = threading.Lock()  # one move at a time
        self._inside = 0
        self._closing = False

    @contextlib.contextmanager
    def passing(self) -> Iterator[None]:
        with self._changed:
            while self._closing:
                self._changed.wait()
            self._inside += 1
        try:
            yield
        finally:
            with self._changed:
                self._inside -= 1
                self._changed.notify_all()

    @contextlib.contextmanager
    def closed(self) -> Iterator[None]:
        with self._closer:
            with self._changed:
                self._closing = True
                while self._inside:
                    self._changed.wait()
            try:
                yield
            finally:
                with self._changed:
                    self._closing = False
                    self._changed.notify_all()


@dataclass(frozen=True)
class OutOfMemory:
    """An out-of-memory error inside a component's call: the plan's device it hit, the bytes it tried to allocate
    (0 when the message does not say), and what the call had reserved there."""

    component: str
    device: str
    tried: int
    reserved: int
    message: str


@dataclass
class _Pending:
    """A shape's dry run under way: its outcome, and whether each caller waiting for it still does (None: always)."""

    future: Future = field(default_factory=Future)
    wanted: list[Callable[[], bool] | None] = field(default_factory=list)

    def anyone(self) -> bool:
        return any(check is None or check() for check in list(self.wanted))


_wanting = threading.local()


@contextlib.contextmanager
def wanted_while(check: Callable[[], bool]) -> Iterator[None]:
    """Dry runs on this thread in the block stop at their next operation (``still_wanted``) once ``check()`` is
    false: a request's dry run is its work, bounded by its time and dropped when its client leaves."""
    outer = getattr(_wanting, "check", None)
    _wanting.check = check
    try:
        yield
    finally:
        _wanting.check = outer


def still_wanted() -> None:
    """``DryRunDropped`` when the dry run on this thread is wanted no more (``wanted_while``); the dry run calls it
    before each operation it follows."""
    check = getattr(_wanting, "check", None)
    if check is not None and not check():
        raise DryRunDropped()


MOST_SHAPES = 256  # call shapes whose figures an ``Admission`` keeps (a few hundred bytes each)
_TRIED = re.compile(r"Tried to allocate (\d+(?:\.\d+)?) ?([KMGT]i?B|bytes?)", re.IGNORECASE)
_GPU = re.compile(r"\bGPU (\d+)\b")


class Admission:
    """A placed pipeline's requests admitted by memory: the ledger over ``plan``'s devices, each call shape's needs
    (``measure(plan, call)``: a dry run, once per shape), the gate component calls pass, and the moves an
    out-of-memory error caused (``relieve(admission, failure)``, which re-places components; ``moves``).

    ``running`` is the plan the pipeline runs on (``plan`` remapped onto the CPU, in tests); ``allocator`` reads a
    real device's figures (``CudaPeaks``): after a call that ran alone they replace its shape's dry-run figures.

    >>> admission = pipemap.api.memory_for(pipe)                                             # doctest: +SKIP
    >>> with admission.request({"prompt": "a cat", "height": 1024, "width": 1024}):         # doctest: +SKIP
    ...     pipe("a cat", height=1024, width=1024)
    """

    def __init__(self, plan: Plan, measure: Callable[[Plan, dict], Needs], *, running: Plan | None = None,
                 relieve: Callable | None = None, allocator=None, ledger: MemoryLedger | None = None,
                 alive: Callable[[], bool] | None = None):
        self.plan, self.running = plan, running or plan
        self.asked: Plan | None = None  # the plan it was asked for (``api.memory_for``), None: the pipeline's own
        # its own ledger, or one it shares with other pipelines (``shared_ledger``), which it joins
        own = MemoryLedger.of(plan) if ledger is None else ledger
        self.ledger = own.join(self, {d.device: d.memory for d in plan.devices}, kept(plan), alive)
        self.gate = Gate()
        self.moves: list = []  # ``relief.Relief`` values, oldest first
        self.unmeasured: dict[tuple, str] = {}  # shapes whose dry run failed: why (they run alone)
        self._measure, self.relieve, self.allocator = measure, relieve, allocator
        # each shape's figures, the least recently used first dropped past MOST_SHAPES: a flood of sizes and prompt
        # lengths costs dry runs, never unbounded memory; ``_figures`` is read and written under ``_cache``, which no
        # dry run holds: a shape measured already never waits for another shape's dry run, nor a request's end for
        # one (dry runs take turns on the dry-run wing's own lock, with loads: ``quiet.PATCHING``)
        self._figures: collections.OrderedDict[tuple, Needs] = collections.OrderedDict()
        self._corrected: set[tuple] = set()
        self._pending: dict[tuple, _Pending] = {}  # shapes being measured: a second request of one waits for it
        self._cache = threading.Lock()
        self._changed = self.ledger.changed  # shared with every pipeline on its ledger: a release wakes theirs

    @property
    def waiting(self) -> int:
        """Requests and component calls waiting for memory now."""
        return len(self.ledger.waiting)

    def needs(self, call: Mapping, wanted: Callable[[], bool] | None = None) -> Needs:
        """``call``'s needs, measured once per shape; ``CallTooLargeError`` when they fit on no device even alone.
        ``wanted``: whether the caller still waits (None: until the end); a dry run that no caller wants any more
        stops at its next operation (``DryRunDropped``), and one a caller still wants is run again for it."""
        needs = self._needs(call_shape(call), call, wanted)
        device = self.ledger.too_large(needs)
        if device is not None:
            raise too_large(self.ledger, needs, device, call)
        return needs

    def _needs(self, shape: tuple, call: Mapping, wanted: Callable[[], bool] | None) -> Needs:
        while True:
            with self._cache:
                found = self._figures.get(shape)
                if found is not None:
                    self._figures.move_to_end(shape)
                    return found
                pending = self._pending.get(shape)
                mine = pending is None
                if pending is None:
                    pending = self._pending[shape] = _Pending()
                pending.wanted.append(wanted)
            if mine:
                return self._measure_pending(shape, call, pending)
            try:
                return pending.future.result()  # the same shape's dry run, under way on another thread
            except DryRunDropped:
                if wanted is not None and not wanted():
                    raise
                # dropped as the callers before this one left: measured again, for this one

    def _measure_pending(self, shape: tuple, call: Mapping, pending: _Pending) -> Needs:
        try:
            with wanted_while(pending.anyone):
                needs = self._measured(shape, call)
            with self._cache:
                self._store(shape, needs)
            pending.future.set_result(needs)
            return needs
        except BaseException as err:
            pending.future.set_exception(err)
            raise
        finally:
            with self._cache:
                del self._pending[shape]

    def _store(self, shape: tuple, needs: Needs) -> None:
        """Keep ``shape``'s figures, dropping the least recently used past ``MOST_SHAPES``; under ``_cache``."""
        self._figures[shape] = needs
        self._figures.move_to_end(shape)
        while len(self._figures) > MOST_SHAPES:
            old, _ = self._figures.popitem(last=False)
            self._corrected.discard(old)

    def _measured(self, shape: tuple, call: Mapping) -> Needs:
        try:
            return self._measure(self.plan, measured_call(call))
        except Exception as err:  # noqa: BLE001 - a call the dry run cannot follow still runs, alone
            self.unmeasured[shape] = f"{type(err).__name__}: {err}"
            warnings.warn(f"pipemap: no dry run of this call's shape ({type(err).__name__}: {err}); its requests "
                          "run alone", RuntimeWarning, stacklevel=4)
            return Needs({d: max(0, self.ledger.room(d)) for d in self.ledger.memory})

    @contextlib.contextmanager
    def request(self, call: Mapping, label: object = None) -> Iterator[Lease]:
        """Run one call under the ledger: wait until its ``rest`` fits, and hold it until the call ends; its
        components' calls (``component_call``) wait for their extra."""
        shape = call_shape(call)
        lease = Lease(label, self.needs(call), shape, owner=self)
        ticket = Ticket(lease, None, dict(lease.needs.rest))
        self._wait(ticket)
        outer = getattr(_local, "lease", None)
        _local.lease = (self, lease)
        try:
            with self._correcting(lease):
                yield lease
        finally:
            _local.lease = outer
            self._release(ticket)

    @contextlib.contextmanager
    def _correcting(self, lease: Lease) -> Iterator[None]:
        """Measure, then correct: a call of a new shape that runs alone has its dry-run figures replaced by the
        allocator's own."""
        if self.allocator is None or lease.shape in self._corrected or len(self.ledger.running) != 1:
            yield
            return
        admitted = self.ledger.admitted
        self.allocator.start()
        yield
        if self.ledger.admitted == admitted and self.ledger.running == [lease]:  # it ran alone all along
            measured = self.allocator.peaks()
            with self._cache:
                self._store(lease.shape, lease.needs.scaled(measured))
                self._corrected.add(lease.shape)

    def run_component(self, module: torch.nn.Module, lease: Lease, call: Callable):
        """One call of a placed component inside a request: past the gate, its extra admitted, under the
        component's lock; after an out-of-memory error, ``relieve`` moves resident components off that device and
        the call runs once more."""
        for last in (False, True):
            with self.gate.passing():
                hook: Any = module._hf_hook  # read past the gate: a move may have hooked the module anew
                ticket = Ticket(lease, hook.component, dict(lease.needs.extra.get(hook.component, {})))
                self._wait(ticket)
                lease.depth += 1
                try:
                    with hook.lock:
                        return call(hook)
                except torch.OutOfMemoryError as err:
                    if last or self.relieve is None:
                        raise
                    failure = self._failure(err, hook, ticket)
                    error = err.with_traceback(None)  # the failed call's frames, and their tensors, are freed
                    error.__context__ = None
                finally:
                    lease.depth -= 1
                    self._release(ticket)
            self._recover(failure, error, lease)
        raise AssertionError("unreachable")  # the second attempt returned or raised

    def _recover(self, failure: OutOfMemory, error: BaseException, lease: Lease) -> None:
        with self.gate.closed():  # no component call runs while components are re-placed
            relief = self.relieve(self, failure) if self.relieve is not None else None
        if relief is None or not relief.moved:
            add_note = getattr(error, "add_note", None)  # Python 3.11
            if relief is not None and add_note is not None:  # refused: no host room; the figures with the error
                add_note(relief.note)
            raise error
        with self._changed:
            self.plan, self.running = relief.plan, relief.running
            self.ledger.reweigh(self, kept(relief.plan))
            self.moves.append(relief)
            self._grant()
        if failure.tried:  # the dry run's figure was short by at least this: later calls of the shape reserve it
            grown = lease.needs.grown(failure.component, failure.device, failure.tried)
            if self.ledger.too_large(grown) is None:
                with self._cache:
                    self._store(lease.shape, grown)

    def _failure(self, err: BaseException, hook, ticket: Ticket) -> OutOfMemory:
        message = str(err)
        device = self.plan.placement(hook.component).execution_device
        gpu = _GPU.search(message)
        if gpu and f"cuda:{gpu[1]}" in self.ledger.memory and self.running.device_map == self.plan.device_map:
            device = f"cuda:{gpu[1]}"  # a split component's shard on another GPU
        tried = _TRIED.search(message)
        size = parse_bytes(f"{tried[1]}{tried[2].replace('bytes', '').replace('byte', '')}") if tried else 0
        return OutOfMemory(hook.component, device, size, ticket.bytes.get(device, 0), message.splitlines()[0][:300])

    def _wait(self, ticket: Ticket) -> None:
        with self._changed:
            if not self.ledger.offer(ticket):
                while not ticket.admitted:
                    stranded = self.ledger.stranded(ticket)
                    if stranded is not None:  # nothing can ever admit it: the call fails as too large, not hangs
                        self.ledger.waiting.remove(ticket)
                        device, need = stranded
                        raise CallTooLargeError(device, need, self.ledger.room(device),
                                                self.ledger.memory.get(device, 0),
                                                f"{ticket.component!r}'s call beside its request")
                    self._changed.wait()
            self._changed.notify_all()

    def _release(self, ticket: Ticket) -> None:
        with self._changed:
            self.ledger.release(ticket)
            self._grant()

    def _grant(self) -> None:
        if self.ledger.grant():
            self._changed.notify_all()

    def describe(self) -> str:
        """The ledger now, a line per device: weights, reserved, room."""
        held = self.ledger.held()
        return "\n".join(f"{d}: weights {format_bytes(self.ledger.weights.get(d, 0))}, reserved "
                         f"{format_bytes(held[d])} of {format_bytes(self.ledger.room(d))} room"
                         for d in self.ledger.memory)


_local = threading.local()


def component_call(module: torch.nn.Module, call: Callable):
    """Run ``call(hook)``, one call of a placed component, under its lock; inside ``Admission.request`` also past
    the admission of its extra (``Admission.run_component``). A call inside another runs under the outer one's."""
    found = getattr(_local, "lease", None)
    if found is None or found[1].depth:
        hook: Any = module._hf_hook
        with hook.lock:
            return call(hook)
    admission, lease = found
    return admission.run_component(module, lease, call)


class CudaPeaks:
    """The CUDA allocator's own figures for a call that ran alone: on each of ``devices`` (ledger name -> CUDA
    device), the most bytes allocated during the call above what was allocated when it started. Devices where
    offloaded or streamed weights are onloaded are left out: their onloads would count as activations."""

    def __init__(self, devices: Mapping[str, str]):
        self.devices = dict(devices)
        self._base: dict[str, int] = {}

    def start(self) -> None:
        for name, device in self.devices.items():
            torch.cuda.reset_peak_memory_stats(device)
            self._base[name] = torch.cuda.memory_allocated(device)

    def peaks(self) -> dict[str, int]:
        return {n: max(0, torch.cuda.max_memory_allocated(d) - self._base[n]) for n, d in self.devices.items()}


def cuda_peaks(plan: Plan, running: Plan) -> CudaPeaks | None:
    """The allocator reader for a pipeline running ``plan`` as planned on CUDA GPUs, or None (remapped, no GPU)."""
    if running.device_map != plan.device_map or not torch.cuda.is_available():
        return None
    moving = {p.execution_device for p in plan.components if facts(p.mode).moves_weights}
    # a split's copies in worker processes allocate in those processes: this one's allocator reads ~0 there, which
    # would set the device's needs to 0 (WP9); the dry run's figures stay for them
    threads = (running.ranks or resolve_ranks(None)[0]) == "thread"
    elsewhere = set() if threads else {d for p in plan.components if splits(p) for d in p.replicas}
    homes = {p.device for p in plan.components} | {p.execution_device for p in plan.components}
    left_out = moving | (elsewhere - homes)
    devices = {d.device: d.device for d in plan.devices if d.device.startswith("cuda") and d.device not in left_out}
    return CudaPeaks(devices) if devices else None
