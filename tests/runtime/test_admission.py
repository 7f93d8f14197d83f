"""admission: the ledger's rule on byte figures written in the test, threads admitted on it, call shapes, and the
figures a call that ran alone corrects. No dry run here (tests/dryrun/test_many.py,
tests/dispatch/test_parallel_memory.py)."""

from __future__ import annotations

import threading
import types

import pytest
import torch

import pipemap
from pipemap.modes import POOL_SLACK
from pipemap.plan import DeviceUse, Placement, Plan
from pipemap.runtime.admission import (
    Admission,
    Gate,
    Lease,
    MemoryLedger,
    Needs,
    Ticket,
    call_shape,
    component_call,
    kept,
    measured_call,
    still_wanted,
    weights_ceiling,
)

MB = 1_000_000


def ledger(room: int = 10 * MB) -> MemoryLedger:
    """One GPU of 20 MB, 10 MB of it weights."""
    return MemoryLedger({"cuda:0": 10 * MB + room}, {"cuda:0": 10 * MB})


def needs(rest: int, unet: int = 0, vae: int = 0) -> Needs:
    extra = {name: {"cuda:0": size} for name, size in (("unet", unet), ("vae", vae)) if size}
    return Needs({"cuda:0": rest}, extra)


def request(book: MemoryLedger, label, figures: Needs) -> Ticket:
    ticket = Ticket(Lease(label, figures), None, dict(figures.rest))
    book.offer(ticket)
    return ticket


def call(book: MemoryLedger, ticket: Ticket, component: str) -> Ticket:
    lease = ticket.lease
    extra = Ticket(lease, component, dict(lease.needs.extra.get(component, {})))
    book.offer(extra)
    return extra


def test_needs_peak_scaled_and_grown():
    figures = needs(2 * MB, unet=5 * MB, vae=3 * MB)
    assert figures.peak == {"cuda:0": 7 * MB} and figures.most_extra("cuda:0") == 5 * MB
    measured = figures.scaled({"cuda:0": 14 * MB})  # the allocator saw twice the dry run's peak
    assert measured.rest == {"cuda:0": 4 * MB} and measured.extra["unet"] == {"cuda:0": 10 * MB}
    assert figures.grown("vae", "cuda:0", 4 * MB).extra["vae"] == {"cuda:0": 7 * MB}
    assert figures.extra["vae"] == {"cuda:0": 3 * MB}  # a value: the original is unchanged


def test_requests_share_the_room_and_the_largest_extra_stays_free():
    # room 10 MB: each request rests 2 MB and its unet call adds 5 MB. Two rest at once (4 MB) with one unet call
    # (5 MB) beside them; a third would leave no room for any unet call, so it waits
    book = ledger()
    first, second, third = (request(book, i, needs(2 * MB, unet=5 * MB)) for i in range(3))
    assert first.admitted and second.admitted and not third.admitted and third.waited
    running = call(book, first, "unet")
    waiting = call(book, second, "unet")  # 2 + 2 + 5 + 5 > 10: the second unet call waits for the first
    assert running.admitted and not waiting.admitted
    book.release(running)
    book.grant()
    assert waiting.admitted and not third.admitted
    book.release(waiting)
    book.release(first)
    book.grant()
    assert third.admitted
    assert all(record.total["cuda:0"] <= book.memory["cuda:0"] for record in book.history)
    assert book.waits == 2


def test_requests_go_in_order_and_calls_in_order_per_device():
    # a large request at the head is not overtaken by a small one behind it, which would fit
    book = ledger()
    holder = request(book, 0, needs(6 * MB))
    large, small = request(book, 1, needs(5 * MB)), request(book, 2, needs(MB))
    assert holder.admitted and not large.admitted and not small.admitted
    book.release(holder)
    book.grant()
    assert large.admitted and small.admitted
    # component calls: first come first served on their device, another device's call goes by
    two = MemoryLedger({"cuda:0": 10 * MB, "cuda:1": 10 * MB}, {})
    lease = Lease("r", Needs({}, {"unet": {"cuda:0": 6 * MB}, "te": {"cuda:0": 2 * MB}, "vae": {"cuda:1": 9 * MB}}))
    tickets = [Ticket(lease, c, dict(lease.needs.extra[c])) for c in ("unet", "unet", "te", "vae")]
    for ticket in tickets:
        two.offer(ticket)
    assert [t.admitted for t in tickets] == [True, False, False, True]  # te would fit, but waits behind the unet


def test_a_request_that_fits_alone_never_deadlocks_the_ledger():
    # every order of releases lets each waiting call in eventually: the head fits once the calls before it end
    book = ledger()
    leases = [request(book, i, needs(3 * MB, unet=4 * MB, vae=MB)) for i in range(4)]
    done = 0
    while done < 4:
        for ticket in [t for t in leases if t.admitted and not getattr(t, "done", False)]:
            for component in ("unet", "vae"):
                extra = call(book, ticket, component)
                assert extra.admitted  # a running request's call never waits on a lone ledger
                book.release(extra)
                book.grant()
            book.release(ticket)
            ticket.done = True
            done += 1
            book.grant()
    assert book.too_large(needs(9 * MB, unet=2 * MB)) == "cuda:0"


def test_a_call_the_room_shrank_under_is_stranded_only_when_nothing_can_free_room_for_it():
    # a relief re-places components and the ledger's room shrinks (an offload's side pool): a call that no longer
    # fits beside its own request, with nothing else running, would wait forever
    book = ledger(room=10 * MB)
    first, second = request(book, "a", needs(3 * MB, unet=6 * MB)), request(book, "b", needs(MB))
    extra = Ticket(first.lease, "unet", {"cuda:0": 6 * MB})
    assert first.admitted and second.admitted and book.stranded(extra) is None  # 3 + 1 + 6 <= 10
    book.reweigh(None, {"cuda:0": 12 * MB})  # room 8 MB now
    assert book.stranded(extra) is None  # another request running: its end may free room
    book.release(second)
    assert book.stranded(extra) == ("cuda:0", 9 * MB)  # 3 + 6 > 8, and nothing else holds anything


def test_an_admission_raises_for_a_stranded_call_instead_of_waiting_forever():
    from pipemap.errors import CallTooLargeError

    admission = Admission(_plan(), lambda plan, call: Needs({"cuda:0": 2 * MB}, {"vae": {"cuda:0": 6 * MB}}))
    lease = Lease("r", Needs({"cuda:0": 2 * MB}, {"vae": {"cuda:0": 6 * MB}}))
    admission.ledger.offer(Ticket(lease, None, {"cuda:0": 2 * MB}))
    admission.ledger.reweigh(admission, {"cuda:0": admission.ledger.memory["cuda:0"] - 4 * MB})  # room 4 MB
    done: list[BaseException] = []

    def wait() -> None:
        try:
            admission._wait(Ticket(lease, "vae", {"cuda:0": 6 * MB}))
        except CallTooLargeError as err:
            done.append(err)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(10)
    assert not waiter.is_alive() and done and done[0].device == "cuda:0" and done[0].needs == 8 * MB
    assert admission.ledger.waiting == []


def test_call_shape_keeps_what_sets_memory():
    base = {"prompt": "a cat", "height": 64, "width": 64, "num_inference_steps": 30, "guidance_scale": 7.5,
            "generator": torch.Generator().manual_seed(1), "output_type": "pil"}
    same = dict(base, prompt="a dog", num_inference_steps=2, guidance_scale=5.0,
                generator=torch.Generator().manual_seed(2), output_type="np")
    assert call_shape(base) == call_shape(same)
    for other in (dict(base, height=128), dict(base, num_images_per_prompt=2), dict(base, guidance_scale=1.0),
                  dict(base, num_inference_steps=1), dict(base, prompt="a cat " * 100), dict(base, prompt=["a", "b"]),
                  dict(base, latents=torch.zeros(1, 4, 8, 8))):
        assert call_shape(other) != call_shape(base)
    long = measured_call(dict(base, prompt="a cat"))
    assert len(long["prompt"]) == 255 and long["prompt"].startswith("a cat a cat") and long["height"] == 64
    assert "generator" not in long and "output_type" not in long  # the dry run draws from no caller's generator
    assert long["num_inference_steps"] == 2  # measured in the steps its shape counts: 30 steps repeat the first 2


def test_weights_ceiling_counts_an_offload_room_larger_than_its_component():
    plan = Plan("balanced_low_memory", (Placement("unet", "cuda:0", 5 * MB),
                                       Placement("te", "cpu", 2 * MB, "offload", "cuda:0", room=4 * MB)),
                (DeviceUse("cuda:0", 20 * MB, 18 * MB, 7 * MB), DeviceUse("cpu", 100 * MB, 100 * MB, 2 * MB)),
                "cuda:0")
    assert weights_ceiling(plan) == {"cuda:0": 9 * MB, "cpu": 2 * MB}  # 2 MB more onloaded besides, at most


def test_too_large_names_the_figures_and_what_to_ask_for():
    admission = Admission(_plan(), lambda plan, call: Needs({"cuda:0": 2 * MB}, {"vae": {"cuda:0": 18 * MB}},
                                                            {"cuda:0": "VAE decode"}))
    with pytest.raises(pipemap.CallTooLargeError) as err:
        admission.needs({"prompt": "a", "height": 1024, "width": 1024, "num_images_per_prompt": 4})
    error = err.value
    assert isinstance(error, ValueError) and error.device == "cuda:0" and error.needs == 20 * MB
    assert error.room == 10 * MB and error.memory == 20 * MB
    assert "at most 2 images" in str(error) and "about 720x720" in str(error) and "enable_tiling" in str(error)


def _plan() -> Plan:
    return Plan("balanced", (Placement("unet", "cuda:0", 10 * MB),), (DeviceUse("cuda:0", 20 * MB, 20 * MB, 10 * MB),),
                "cuda:0")


class _Hooked(torch.nn.Module):
    """A module with what ``component_call`` reads of a pipemap hook: its component name and lock."""

    def __init__(self, name: str):
        super().__init__()
        self._hf_hook = types.SimpleNamespace(component=name, lock=threading.RLock())


def test_threads_on_the_ledger_never_exceed_the_room():
    # 6 requests on 4 threads, each resting 2 MB with a 5 MB unet call (x3) and a 3 MB vae call: memory, not the
    # thread count, bounds them: at most 2 admitted at once, the unet calls one at a time
    admission = Admission(_plan(), lambda plan, call: needs(2 * MB, unet=5 * MB, vae=3 * MB))
    unet, vae = _Hooked("unet"), _Hooked("vae")
    inside = {"unet": 0, "most": 0}

    start = threading.Barrier(3)

    def run(index: int) -> None:
        if index < 3:
            start.wait(5)  # the first three requests offered together: the third must wait
        with admission.request({"prompt": "a"}, label=index):
            for _ in range(3):
                component_call(unet, lambda hook: _count(inside))
            component_call(vae, lambda hook: None)

    threads = [threading.Thread(target=lambda i=i: [run(i + k) for k in (0, 4)]) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    history = list(admission.ledger.history)
    assert len(history) == 6 * 5 and all(r.total["cuda:0"] <= 20 * MB for r in history)
    assert max(r.running for r in history) == 2 and admission.ledger.waits > 0
    assert admission.ledger.held() == {"cuda:0": 0} and admission.waiting == 0


def _count(inside: dict) -> None:
    inside["unet"] += 1
    inside["most"] = max(inside["most"], inside["unet"])
    threading.Event().wait(0.001)
    inside["unet"] -= 1


def test_measure_then_correct_with_the_allocator_figures():
    class Allocator:  # what CudaPeaks reads on a GPU: here, the figures a call would show
        started = 0

        def start(self):
            self.started += 1

        def peaks(self):
            return {"cuda:0": 9 * MB}

    allocator = Allocator()
    admission = Admission(_plan(), lambda plan, call: needs(2 * MB, unet=4 * MB), allocator=allocator)
    with admission.request({"prompt": "a"}):
        pass
    assert allocator.started == 1 and admission.needs({"prompt": "b"}).peak == {"cuda:0": 9 * MB}
    with admission.request({"prompt": "a"}):  # corrected once per shape
        pass
    assert allocator.started == 1


def test_a_shape_the_dry_run_cannot_follow_runs_alone():
    def fails(plan, call):
        raise RuntimeError("no dry run of this")

    admission = Admission(_plan(), fails)
    with pytest.warns(RuntimeWarning, match="run alone"):
        figures = admission.needs({"prompt": "a"})
    assert figures.rest == {"cuda:0": 10 * MB} and "no dry run of this" in next(iter(admission.unmeasured.values()))


def test_the_gate_closes_once_the_calls_inside_end():
    gate, order = Gate(), []
    inside, closing = threading.Event(), threading.Event()

    def call():
        with gate.passing():
            inside.set()
            closing.wait(5)
            order.append("call")

    def move():
        with gate.closed():
            order.append("move")

    first = threading.Thread(target=call)
    first.start()
    inside.wait(5)
    mover = threading.Thread(target=move)
    mover.start()
    closing.set()
    mover.join(5)
    first.join(5)
    assert order == ["call", "move"]


def test_a_dry_run_holds_no_lock_a_measured_shape_needs_and_a_shape_is_measured_once():
    # the 64-wide shape's dry run stalls until released: meanwhile a request of the measured 32-wide shape is served,
    # start to end, and a second request of the stalled shape waits for that same dry run instead of a second one
    started, release, measured = threading.Event(), threading.Event(), []

    def measure(plan, call):
        measured.append(call["width"])
        if call["width"] == 64:
            started.set()
            assert release.wait(30)
        return needs(call["width"] * 1000)

    peaks = types.SimpleNamespace(start=lambda: None, peaks=lambda: {"cuda:0": 40_000})  # as a GPU's allocator reads
    admission = Admission(_plan(), measure, allocator=peaks)
    admission.needs({"width": 32})
    stalled = [threading.Thread(target=admission.needs, args=({"width": 64},)) for _ in range(2)]
    for thread in stalled:
        thread.start()
    assert started.wait(30)
    with admission.request({"width": 32}) as lease:  # it runs alone: its figures corrected at its end
        assert lease.needs.rest == {"cuda:0": 32_000}
    assert admission.needs({"width": 32}).rest == {"cuda:0": 40_000}
    release.set()
    for thread in stalled:
        thread.join(30)
    assert measured == [32, 64] and admission.needs({"width": 64}).rest == {"cuda:0": 64_000}


def test_a_dry_run_goes_on_while_a_caller_wants_it_and_stops_once_none_does():
    # the dry run asks ``still_wanted`` between its operations (here: a loop until released); callers are threads of
    # requests whose clients may leave
    from pipemap.errors import DryRunDropped

    runs, release = [], threading.Event()

    def measure(plan, call):
        runs.append(call["width"])
        while not release.is_set():
            still_wanted()
            threading.Event().wait(0.01)
        return needs(call["width"] * 1000)

    admission = Admission(_plan(), measure)
    outcome: dict = {}

    def ask(name, width, gone):
        try:
            outcome[name] = admission.needs({"width": width}, lambda: not gone.is_set()).rest
        except DryRunDropped:
            outcome[name] = "dropped"

    def callers(width, *names):
        gone = {name: threading.Event() for name in names}
        threads = [threading.Thread(target=ask, args=(name, width, gone[name])) for name in names]
        for thread in threads:
            thread.start()
        shape = call_shape({"width": width})
        while shape not in admission._pending or len(admission._pending[shape].wanted) < len(names):
            threading.Event().wait(0.01)
        return gone, threads

    gone, threads = callers(64, "a", "b")
    gone["a"].set()  # one client leaves: the other still waits, so the same dry run goes on to its end
    threading.Event().wait(0.1)
    release.set()
    for thread in threads:
        thread.join(30)
    assert outcome == {"a": {"cuda:0": 64_000}, "b": {"cuda:0": 64_000}} and runs == [64]
    release.clear()
    gone, threads = callers(96, "c", "d")
    gone["c"].set()
    gone["d"].set()  # both gone: it stops at its next operation, its shape unmeasured, and is no failure
    for thread in threads:
        thread.join(30)
    assert outcome["c"] == outcome["d"] == "dropped" and runs == [64, 96]
    assert call_shape({"width": 96}) not in admission._figures and admission.unmeasured == {}
    assert admission._pending == {}


def test_the_figures_kept_are_bounded_the_least_recently_used_dropped(monkeypatch):
    monkeypatch.setattr("pipemap.runtime.admission.MOST_SHAPES", 3)
    measured = []
    admission = Admission(_plan(), lambda plan, call: measured.append(call["width"]) or needs(1000))
    for width in (8, 16, 24, 8, 32, 8, 16):  # 8 used again before 32 comes: 16 is the one dropped, then 24
        admission.needs({"width": width})
    assert measured == [8, 16, 24, 32, 16]


def test_two_pipelines_admitted_on_one_shared_ledger_never_exceed_the_device_together():
    # pipeline a planned 20 MB with 10 MB of weights; b planned after it, on the 10 MB a left free, with 4 MB of
    # weights: 6 MB are left on the GPU for both one's and the other's activations. On one ledger (``api.memory_for``
    # shares the process's), each request resting 2 MB with a 3 MB unet call: together they never hold more than
    # 6 MB; each pipeline on a ledger of its own would admit up to 10 MB and 6 MB at once (issue 39)
    from pipemap.runtime.admission import SharedLedger

    shared = SharedLedger()
    b_plan = Plan("balanced", (Placement("unet", "cuda:0", 4 * MB),), (DeviceUse("cuda:0", 10 * MB, 10 * MB, 4 * MB),),
                  "cuda:0")
    figures = needs(2 * MB, unet=3 * MB)
    admissions = [Admission(plan, lambda plan, call: figures, ledger=shared) for plan in (_plan(), b_plan)]
    assert shared.room("cuda:0") == 6 * MB and all(a.ledger.shared is shared for a in admissions)
    held = {"now": 0, "most": 0}
    count = threading.Lock()

    def hold(size: int) -> None:
        with count:
            held["now"] += size
            held["most"] = max(held["most"], held["now"])

    def run(admission: Admission) -> None:
        unet = _Hooked("unet")
        for _ in range(4):
            with admission.request({"prompt": "a"}):
                hold(2 * MB)
                for _ in range(2):
                    component_call(unet, lambda hook: [hold(3 * MB), threading.Event().wait(0.002), hold(-3 * MB)])
                hold(-2 * MB)

    threads = [threading.Thread(target=run, args=(admissions[i % 2],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert held["now"] == 0 and 5 * MB <= held["most"] <= 6 * MB and shared.admitted == 16
    assert shared.held() == {"cuda:0": 0} and all(a.waiting == 0 for a in admissions)
    del admissions[1]  # b reset and collected: the room is a's alone again
    import gc

    gc.collect()
    assert shared.room("cuda:0") == 10 * MB


def test_the_room_keeps_the_allocator_slack_of_each_stream_pool_the_plan_uses():
    # a 200 MiB GPU holding a 100 MiB unet, a 20 MiB text encoder offloaded onto it: the default stream's pool and
    # the offload's side pool each keep modes.POOL_SLACK (22 MiB) reserved beside what tensors allocate, as the
    # planner's budgets do; the CPU keeps none
    mib = 2**20
    plan = Plan("balanced_low_memory", (Placement("unet", "cuda:0", 100 * mib),
                                       Placement("te", "cpu", 20 * mib, "offload", "cuda:0", room=20 * mib)),
                (DeviceUse("cuda:0", 200 * mib, 200 * mib, 120 * mib), DeviceUse("cpu", 1000 * mib, 1000 * mib,
                                                                                  20 * mib)), "cuda:0")
    assert kept(plan) == {"cuda:0": 120 * mib + 2 * POOL_SLACK, "cpu": 20 * mib}
    book = MemoryLedger.of(plan)
    assert book.room("cuda:0") == 80 * mib - 2 * POOL_SLACK
    # a call that fits the bytes left beside the weights alone, but not beside the slack too, is too large
    assert book.too_large(Needs({"cuda:0": 70 * mib})) == "cuda:0"
    assert book.too_large(Needs({"cuda:0": 80 * mib - 2 * POOL_SLACK})) is None
    assert Admission(plan, lambda plan, call: Needs({})).ledger.room("cuda:0") == book.room("cuda:0")
