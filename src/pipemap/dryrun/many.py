"""The dry run of ``run_many``: several requests on stand-in devices, admitted by the very rule a real run uses
(``admission.MemoryLedger``), each device's peak with the requests overlapped.

Each distinct call shape runs once on stand-in devices (``measure``), its course recorded as segments: a component's
call or the pipeline code between them, each with every device's activation peak and level at its end, and its work
in operations dispatched. Its ``Needs`` (what the ledger reserves) follow from them: ``rest`` is the most it holds
outside its components' calls, ``extra[component]`` the most a component's call adds on top. The requests then run
on a clock of operations: ``workers`` of them taken at once, each waiting for the ledger as ``run_many`` does (its
rest, then each component call's extra, then the component's lock); the overlapped peak of a device is its weights
plus what every request holds there at each moment.

A real run reads the same figures: ``needs_of`` is what ``api.memory_for`` measures each call shape with.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, cast

from ..errors import CallTooLargeError, SimulationFailedError
from ..plan import Plan
from ..quiet import PATCHING, quiet_diffusers, quiet_transformers
from ..runtime.admission import (
    Lease,
    MemoryLedger,
    Needs,
    Ticket,
    call_shape,
    measured_call,
    still_wanted,
    too_large,
)
from ..units import format_bytes
from . import standin
from .report import SimulationReport
from .run import _fake_copy, traced
from .trackers import PhasedTracker

_DRY_RUNS = PATCHING  # a dry run patches library code process-wide: one at a time, and never beside a load


@dataclass(frozen=True)
class Segment:
    """A stretch of one call: a component's call (``component``) or pipeline code (None), each device's
    activation peak in it and level at its end, its work in operations dispatched, and the phase it began in."""

    component: str | None
    peak: Mapping[str, int]
    end: Mapping[str, int]
    ops: int
    phase: str


@dataclass
class _Open:
    component: str | None
    peak: dict[str, int]
    phase: str
    ops: int = 0
    end: dict[str, int] = field(default_factory=dict)


class SegmentTracker(PhasedTracker):
    """The dry run's tracker that also cuts the call into segments where the running component changes."""

    replays = False  # each segment counts the operations it runs (the clock): every tile of a tiled decode runs

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.level: collections.Counter = collections.Counter()  # activation bytes live per device
        self.segments: list[_Open] = []

    def _segment(self) -> _Open:
        who = self.component() or None
        if not self.segments or self.segments[-1].component != who:
            if self.segments:
                self.segments[-1].end = dict(self.level)
            self.segments.append(_Open(who, dict(self.level), str(self.phases.current)))
        return self.segments[-1]

    def _note(self, device: str) -> None:
        self.level[device] = self.live[device] - self.weight_live[device]
        segment = self._segment()
        segment.peak[device] = max(segment.peak.get(device, 0), self.level[device])

    def _track(self, tensor, weight: bool = False) -> bool:
        tracked = super()._track(tensor, weight)
        if tracked:
            self._note(str(tensor.device))
        return tracked

    def _free(self, key: int) -> None:
        device = self._seen[key][0]
        super()._free(key)
        self._note(device)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        still_wanted()  # a dry run nobody waits for any more stops here (``admission.wanted_while``)
        self._segment().ops += 1
        return super().__torch_dispatch__(func, types, args, kwargs)

    def course(self, back: Mapping[str, str]) -> tuple[Segment, ...]:
        """The segments, devices named as the plan names them."""
        if self.segments:
            self.segments[-1].end = dict(self.level)

        def named(figures: Mapping[str, int]) -> dict[str, int]:
            out: dict[str, int] = {}
            for device, size in figures.items():
                out[back.get(device, device)] = out.get(back.get(device, device), 0) + size
            return out

        return tuple(Segment(s.component, named(s.peak), named(s.end), s.ops, s.phase) for s in self.segments)


@dataclass(frozen=True)
class Measured:
    """One call shape's dry run: what the ledger reserves for it, its course, and its report."""

    needs: Needs
    course: tuple[Segment, ...]
    report: SimulationReport


def measure(source, plan: Plan, call: Mapping, steps: int = 2) -> Measured:
    """Run ``call`` on stand-in devices as ``plan`` places it and read its needs and course; a dry run that fails
    raises ``SimulationFailedError``."""
    with _turn(), quiet_diffusers(), quiet_transformers():  # a prompt made long for its bucket is truncated
        report, tracker, _ = traced(source, plan, steps=steps, call=call, tracker=SegmentTracker)
    if not report.ok:
        raise SimulationFailedError(report)
    back = {v: k for k, v in standin.devices_for(plan).items()}
    course = cast(SegmentTracker, tracker).course(back)
    return Measured(needs_from(course, report.peak_phase), course, report)


@contextlib.contextmanager
def _turn():
    """The dry runs' lock, waited for in short turns: a dry run nobody wants any more leaves the line."""
    while not _DRY_RUNS.acquire(timeout=0.05):
        still_wanted()
    try:
        yield
    finally:
        _DRY_RUNS.release()


def needs_of(source, plan: Plan, call: Mapping, steps: int = 2) -> Needs:
    """What the ledger reserves for ``call`` under ``plan``: ``measure(...).needs``."""
    return measure(source, plan, call, steps).needs


def needs_from(course: Iterable[Segment], phase: Mapping[str, str] | None = None) -> Needs:
    """``rest``: the most a call holds on each device outside its components' calls (in pipeline code, and at the end
    of each segment, where it waits for the next); ``extra[component]``: what that component's calls add on top."""
    rest: collections.Counter = collections.Counter()
    peaks: dict[str, collections.Counter] = {}
    for segment in course:
        held = rest if segment.component is None else peaks.setdefault(segment.component, collections.Counter())
        for device, size in segment.peak.items():
            held[device] = max(held[device], size)
        for device, size in segment.end.items():
            rest[device] = max(rest[device], size)
    extra = {c: {d: b - rest[d] for d, b in p.items() if b > rest[d]} for c, p in peaks.items()}
    return Needs(dict(rest), {c: e for c, e in extra.items() if e}, dict(phase or {}))


def snapshot(pipe):
    """A copy of a placed pipeline whose weights are on the meta device (no memory) and whose models carry no hook:
    what its later dry runs start from, whatever its own hooks become (an out-of-memory move offloads a component,
    and a pipeline with offloaded components cannot be copied for a dry run)."""
    no_mode = cast(Any, contextlib.nullcontext())  # tensors made outside fake mode, on meta: real, and empty
    return _fake_copy(pipe, no_mode, {name: "meta" for name in pipe.components})


# ---- requests overlapped ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CallOutcome:
    """One call of ``simulate_many``: its shape's index in ``reports``, its needs' peak per device, when it was
    admitted and when it ended (in operations), or why it never ran (``CallTooLargeError``, a failed dry run)."""

    index: int
    shape: int
    peak: Mapping[str, int]
    start: int | None = None
    end: int | None = None
    error: Exception | None = None


@dataclass(frozen=True)
class ManyReport:
    """The dry run of ``run_many``: each device's peak with the requests overlapped (``peak_bytes``: its weights
    and what every request held there at each moment) and the most the ledger reserved (``reserved_bytes``: the
    plan's weights and every admitted reservation), against ``plan``'s memory; ``most_in_flight``: requests admitted
    at once; ``waits``: requests and component calls that waited for memory; one report per call shape."""

    plan: Plan
    workers: int
    calls: tuple[CallOutcome, ...]
    peak_bytes: dict[str, int]
    reserved_bytes: dict[str, int]
    weight_bytes: dict[str, int]
    most_in_flight: int
    waits: int
    reports: tuple[SimulationReport, ...]
    waited: dict[str, int] = field(default_factory=dict)  # waits by component ("request": a request's start)

    @property
    def ok(self) -> bool:
        """Whether every call that was not refused for its size ran."""
        return all(c.error is None or isinstance(c.error, CallTooLargeError) for c in self.calls)

    @property
    def refused(self) -> tuple[CallOutcome, ...]:
        return tuple(c for c in self.calls if isinstance(c.error, CallTooLargeError))

    def __str__(self) -> str:
        ran = [c for c in self.calls if c.error is None]
        which = ", ".join(f"{name} {count}" for name, count in self.waited.items())
        lines = [f"{len(self.calls)} calls, {self.workers} workers: {len(ran)} ran, at most {self.most_in_flight} "
                 f"at once, {self.waits} waits for memory{f' ({which})' if which else ''}, {len(self.refused)} "
                 "refused"]
        lines.append(f"{'device':<10}{'weights':>12}{'one call':>12}{'overlapped':>12}{'reserved':>12}{'memory':>12}")
        memory = {d.device: d.memory for d in self.plan.devices}
        for device, peak in self.peak_bytes.items():
            one = max((c.peak.get(device, 0) for c in self.calls if c.error is None), default=0)
            lines.append(f"{device:<10}{format_bytes(self.weight_bytes.get(device, 0)):>12}{format_bytes(one):>12}"
                         f"{format_bytes(peak):>12}{format_bytes(self.reserved_bytes.get(device, 0)):>12}"
                         f"{format_bytes(memory.get(device, 0)):>12}")
        lines += [f"call {c.index}: {c.error}" for c in self.calls if c.error is not None]
        return "\n".join(lines)


def simulate_many(source, plan: Plan, calls: Iterable[Mapping], workers: int = 2, *, steps: int = 2) -> ManyReport:
    """``run_many(pipe, calls, workers)`` on stand-in devices: each distinct call shape dry-run once, then the calls
    run together under the ledger's rule; a call too large for the plan is refused with its figures.

    >>> plan = pipemap.plan("flux.1-dev", hardware="2x16GiB", strategy="auto")                    # doctest: +SKIP
    >>> report = pipemap.simulate_many("flux.1-dev", plan, [{"height": 1024, "width": 1024}] * 4, workers=2)
    >>> report.peak_bytes, report.most_in_flight                                                  # doctest: +SKIP
    """
    ledger = MemoryLedger.of(plan)
    shapes: dict[tuple, int] = {}
    measured: list[Measured | Exception] = []
    flights: list[_Flight] = []
    outcomes: dict[int, CallOutcome] = {}
    for index, call in enumerate(calls):
        key = call_shape(call)
        if key not in shapes:
            shapes[key] = len(measured)
            measured.append(_measured(source, plan, call, steps))
        found = measured[shapes[key]]
        if isinstance(found, Exception):
            outcomes[index] = CallOutcome(index, shapes[key], {}, error=found)
            continue
        device = ledger.too_large(found.needs)
        if device is not None:
            outcomes[index] = CallOutcome(index, shapes[key], found.needs.peak,
                                          error=too_large(ledger, found.needs, device, call))
            continue
        flights.append(_Flight(index, shapes[key], Lease(index, found.needs, key), found.course))
    clock = _Clock(ledger, flights, workers)
    clock.run()
    for f in flights:
        outcomes[f.index] = CallOutcome(f.index, f.shape, f.lease.needs.peak, f.start, f.end)
    reports = tuple(m.report for m in measured if isinstance(m, Measured))
    weights = {d: max([0, *(r.weight_peak_bytes.get(d, 0) for r in reports)]) for d in ledger.memory}
    peak = {d: weights[d] + clock.most[d] for d in ledger.memory}
    return ManyReport(plan, workers, tuple(outcomes[i] for i in sorted(outcomes)), peak, dict(clock.reserved), weights,
                      clock.most_in_flight, ledger.waits, reports, dict(clock.waited))


def _measured(source, plan: Plan, call: Mapping, steps: int) -> Measured | Exception:
    try:
        found = measure(source, plan, measured_call(call), steps)
    except SimulationFailedError as err:
        return err
    # the report shows the caller's prompts, not the longest of their bucket that was measured
    shown = {k: call[k] if "prompt" in k and k in call else v for k, v in found.report.call.items()}
    return replace(found, report=replace(found.report, call=shown))


@dataclass(eq=False)
class _Flight:
    """One request on the clock: where it is in its course, the ticket it waits on or runs under, when its running
    segment ends."""

    index: int
    shape: int
    lease: Lease
    course: tuple[Segment, ...]
    at: int = 0
    ticket: Ticket | None = None  # the wait in progress, or the component call running
    admitted: Ticket | None = None  # its rest, held from its start to its end
    until: int | None = None
    start: int | None = None
    end: int | None = None

    def holding(self) -> Mapping[str, int]:
        """What it holds now: its running segment's peak, else what the last one left."""
        if self.start is None:
            return {}
        if self.until is not None:
            return self.course[self.at].peak
        return self.course[self.at - 1].end if self.at else {}


class _Clock:
    """Requests taken ``workers`` at a time and run segment by segment on a clock of operations, each waiting for
    the ledger (its rest, then each component call's extra) and for the component's lock, as in ``run_many``."""

    def __init__(self, ledger: MemoryLedger, flights: list[_Flight], workers: int):
        self.ledger, self.workers = ledger, workers
        self.pending = collections.deque(flights)
        self.flying: list[_Flight] = []
        self.busy: dict[str, _Flight] = {}  # component -> the request whose call holds its lock
        self.now = 0
        self.most: collections.Counter = collections.Counter()  # most activation bytes held at once per device
        self.reserved = {d: ledger.weights.get(d, 0) for d in ledger.memory}  # most weights and reservations
        self.most_in_flight = 0
        self.waited: collections.Counter = collections.Counter()

    def run(self) -> None:
        while self.pending or self.flying:
            while self._step():
                pass
            self._tally()
            if not self.flying:
                break
            running = [f.until for f in self.flying if f.until is not None]
            if not running:  # cannot happen: the head of every queue fits once the calls before it end
                raise RuntimeError(f"simulate_many stalled at {self.now} with {len(self.flying)} requests waiting")
            self.now = min(running)
            for flight in self.flying:
                if flight.until == self.now:
                    self._finish_segment(flight)

    def _step(self) -> bool:
        """Every move that takes no time; whether any was made."""
        moved = False
        while self.pending and len(self.flying) < self.workers:
            flight = self.pending.popleft()
            flight.ticket = Ticket(flight.lease, None, dict(flight.lease.needs.rest))
            self._offer(flight.ticket)
            self.flying.append(flight)
            moved = True
        for flight in list(self.flying):
            moved |= self._advance(flight)
        return moved

    def _advance(self, flight: _Flight) -> bool:
        ticket = flight.ticket
        if flight.until is not None or (ticket is not None and not ticket.admitted):
            return False  # running, or waiting for memory
        if flight.start is None:
            flight.start, flight.admitted, flight.ticket = self.now, ticket, None
            self.most_in_flight = max(self.most_in_flight, len(self.ledger.running))
            return True
        if ticket is None:
            return self._next(flight)
        component = ticket.component or ""  # a component call's ticket: a request's was taken at its start
        if self.busy.get(component) is None:  # its extra admitted: the component's lock next
            self.busy[component] = flight
            flight.until = self.now + flight.course[flight.at].ops
            return True
        return False

    def _next(self, flight: _Flight) -> bool:
        if flight.at == len(flight.course) and flight.admitted is not None:
            self.ledger.release(flight.admitted)
            self.ledger.grant()
            flight.end = self.now
            self.flying.remove(flight)
            return True
        segment = flight.course[flight.at]
        if segment.component is None:
            flight.until = self.now + segment.ops
        else:
            flight.ticket = Ticket(flight.lease, segment.component,
                                   dict(flight.lease.needs.extra.get(segment.component, {})))
            self._offer(flight.ticket)
        return True

    def _offer(self, ticket: Ticket) -> None:
        if not self.ledger.offer(ticket):
            self.waited[ticket.component or "request"] += 1

    def _finish_segment(self, flight: _Flight) -> None:
        if flight.ticket is not None:
            self.busy.pop(flight.ticket.component or "", None)
            self.ledger.release(flight.ticket)
            self.ledger.grant()
            flight.ticket = None
        flight.until = None
        flight.at += 1

    def _tally(self) -> None:
        held: collections.Counter = collections.Counter()
        for flight in self.flying:
            held.update(flight.holding())
        for device, size in held.items():
            self.most[device] = max(self.most[device], size)
        for device, size in self.ledger.held().items():
            self.reserved[device] = max(self.reserved[device], self.ledger.weights.get(device, 0) + size)
