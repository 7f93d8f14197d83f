"""serve/worker.py: the bounded queue between the handlers and the pipeline, and the thread that feeds it. Directly,
on a pipeline stand-in: jobs answered in order with their seeds, failures in their place, a full queue refusing at
once, a drain finishing what it took, a job dropped while waiting or stopped at its next step. Over HTTP, on the tiny
pipeline: a full queue answers 429, a timeout 504, a failure 500, and the server goes on."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

httpx = pytest.importorskip("httpx", reason="the serve tests need httpx: pip install -e '.[test]'")
pytest.importorskip("uvicorn", reason="pipemap serve needs uvicorn: pip install -e '.[serve]'")
from pipemap.serve import DrainingError, QueueFullError, WorkDropped, run_sequential  # noqa: E402
from pipemap.serve.worker import Job, Worker  # noqa: E402
from serving import Echo, ask, code, counted, direct, in_background, pngs, stalled, wait_until  # noqa: E402


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator("cpu").manual_seed(seed)


def _job(prompt: str, seed: int = 0, images: int = 1, seconds: float = 60, **call) -> Job:
    return Job({"prompt": prompt, "num_images_per_prompt": images, **call}, seed, images, time.monotonic() + seconds)


@pytest.fixture
def worker():
    made = []

    def make(pipe=None, **kwargs) -> Worker:
        made.append(Worker(pipe or Echo(), **kwargs))
        return made[-1]

    yield make
    for each in made:
        each.stop(10)


# ---- the queue and its worker, directly --------------------------------------------------------------------------


def test_run_sequential_answers_each_call_in_order_with_a_failure_in_its_place():
    pipe = Echo()
    outcomes = list(run_sequential(pipe, [{"prompt": "a", "generator": _seeded(1)}, {"prompt": "fail"},
                                          {"prompt": "b", "generator": _seeded(2)}]))
    assert [o.prompt for o in (outcomes[0], outcomes[2])] == ["a", "b"]
    assert isinstance(outcomes[1], RuntimeError) and pipe.calls == ["a", "fail", "b"]


def test_jobs_are_answered_with_their_seed_and_images_and_a_failure_fails_only_its_own(worker):
    finished = []
    queue = worker(on_finished=finished.append)
    jobs = [_job("a cat", seed=5, images=2), _job("fail"), _job("a dog", seed=9)]
    for job in jobs:
        queue.submit(job)
    queue.start()
    first, third = jobs[0].future.result(30), jobs[2].future.result(30)
    assert (first.prompt, first.seed, first.images, first.output_type) == ("a cat", 5, ["a cat"] * 2, "pil")
    assert (third.prompt, third.seed) == ("a dog", 9)
    assert "the pipeline broke" in str(jobs[1].future.exception(30))
    wait_until(lambda: len(finished) == 3)
    assert [f.images for f in finished] == [2, 0, 1]  # a failed job made no images
    assert all(f.seconds >= 0 for f in finished) and queue.running == 0 and queue.dropped == 0


def test_a_full_queue_refuses_at_once_with_a_retry_estimate(worker):
    queue = worker(max_queue=2)  # not started: the jobs wait
    queue.submit(_job("a"))
    queue.submit(_job("b"))
    with pytest.raises(QueueFullError) as full:
        queue.submit(_job("c"))
    assert full.value.depth == 2 and full.value.retry_after >= 1 and queue.depth == 2
    assert "retry in" in str(full.value)


def test_a_drain_takes_no_new_job_and_finishes_those_it_took(worker):
    pipe = Echo()
    queue = worker(pipe)
    waiting = [_job("a"), _job("b")]
    for job in waiting:
        queue.submit(job)
    queue.drain()
    with pytest.raises(DrainingError):
        queue.submit(_job("c"))
    queue.start()
    queue.stop(30)
    assert [job.future.result(0).prompt for job in waiting] == ["a", "b"] and pipe.calls == ["a", "b"]


def test_a_cancelled_waiting_job_leaves_the_queue_and_is_never_run(worker):
    pipe = Echo()
    queue = worker(pipe)
    gone, kept = _job("gone"), _job("kept")
    queue.submit(gone)
    queue.submit(kept)
    queue.cancel(gone)
    assert queue.depth == 1 and queue.dropped == 1
    queue.start()
    assert kept.future.result(30).prompt == "kept" and pipe.calls == ["kept"] and not gone.future.done()


def test_a_job_past_its_deadline_while_waiting_is_skipped(worker):
    pipe = Echo()
    queue = worker(pipe)
    queue.submit(_job("late", seconds=-1))
    queue.submit(_job("on time"))
    queue.start()
    wait_until(lambda: queue.dropped == 1 and pipe.calls == ["on time"])


def test_a_running_job_no_longer_wanted_stops_at_its_next_step(worker):
    pipe = Echo()
    queue = worker(pipe)
    job = _job("slow", num_inference_steps=20)
    pipe.gate.clear()
    queue.submit(job)
    queue.start()
    assert pipe.entered.wait(30)
    queue.cancel(job)
    pipe.gate.set()
    with pytest.raises(WorkDropped) as dropped:
        job.future.result(30)
    assert dropped.value.step == 1 and pipe.steps == 1  # stopped at the end of the step it was in
    wait_until(lambda: queue.dropped == 1)


def test_a_pipeline_without_step_callbacks_gets_none(worker):
    class Plain:
        def __call__(self, prompt, num_images_per_prompt=1, generator=None, output_type="pil"):
            return prompt

    queue = worker(Plain())
    job = _job("a cat")
    queue.submit(job)
    queue.start()
    assert job.future.result(30) == "a cat"


def test_a_runner_that_fails_whole_fails_each_job_it_holds(worker):
    def runner(pipe, calls):
        list(calls)  # takes every waiting call, then breaks
        raise OSError("the runner broke")

    queue = worker(runner=runner)
    jobs = [_job("a"), _job("b")]
    for job in jobs:
        queue.submit(job)
    queue.start()
    assert all(isinstance(job.future.exception(30), OSError) for job in jobs)
    wait_until(lambda: queue.running == 0)


def test_a_runner_that_fails_before_taking_any_call_fails_the_waiting_jobs_instead_of_spinning(worker):
    def runner(pipe, calls):
        raise OSError("the runner broke at once")

    queue = worker(runner=runner)
    jobs = [_job("a"), _job("b")]
    for job in jobs:
        queue.submit(job)
    queue.start()
    assert all(isinstance(job.future.exception(30), OSError) for job in jobs)
    wait_until(lambda: queue.depth == 0 and queue.running == 0)


# ---- over HTTP: a full queue, a timeout, a failure: each answered, and the server goes on ----------------------


@pytest.mark.slow  # over 2 s: out of the quick subset
def test_a_full_queue_answers_429_with_retry_after(service, client):
    before = code(client, 429)
    with stalled(service.pipe.unet) as entered:
        running = in_background(ask, client, prompt="first", seed=1)
        assert entered.wait(60)
        beside = in_background(ask, client, prompt="second", seed=2)  # the second worker's: in flight beside it
        wait_until(lambda: service.worker.running == 2)
        waiting = in_background(ask, client, prompt="third", seed=3)
        wait_until(lambda: service.worker.depth == 1)
        refused = ask(client, prompt="fourth", seed=4)
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "queue_full"
        assert counted(client)["pipemap_queue_depth"] == 1 and counted(client)["pipemap_running"] == 2
    for response, seed, prompt in ((running(), 1, "first"), (beside(), 2, "second"), (waiting(), 3, "third")):
        np.testing.assert_array_equal(pngs(response)[0], direct(service.pipe, seed, prompt=prompt)[0])
    assert code(client, 429) == before + 1


@pytest.mark.slow  # over 1 s on 2 cores: out of the quick subset
def test_a_timeout_answers_504_drops_the_work_and_the_next_request_succeeds(service, client):
    before = counted(client)
    calls = []
    counting = service.pipe.unet.register_forward_pre_hook(lambda *_: calls.append(1))
    service.timeout = 1.0
    try:
        with stalled(service.pipe.unet):
            response = ask(client, prompt="slow", seed=1, num_inference_steps=20)
            assert response.status_code == 504 and response.json()["error"]["code"] == "timeout"
    finally:
        service.timeout = 120.0
    wait_until(lambda: counted(client)["pipemap_dropped_total"] == before["pipemap_dropped_total"] + 1)
    counting.remove()
    assert len(calls) < 20  # stopped at the end of the step it was in, not run to its 20th
    assert pngs(ask(client, prompt="next", seed=2))
    assert code(client, 504) == before.get('pipemap_requests_total{code="504"}', 0) + 1


def test_a_failure_inside_the_pipeline_answers_500_and_the_next_request_succeeds(service, client):
    before = code(client, 500)
    failures = [RuntimeError("injected: the VAE decoder broke")]

    def fail_once(*_):
        if failures:
            raise failures.pop()

    handle = service.pipe.vae.decoder.register_forward_pre_hook(fail_once)
    try:
        response = ask(client, prompt="boom", seed=1)
    finally:
        handle.remove()
    assert response.status_code == 500
    assert "injected: the VAE decoder broke" in response.json()["error"]["message"]
    np.testing.assert_array_equal(pngs(ask(client, prompt="after", seed=2))[0],
                                  direct(service.pipe, 2, prompt="after")[0])
    assert code(client, 500) == before + 1


@pytest.mark.slow  # a 50-step request: a few seconds
def test_a_short_request_sent_after_a_long_one_is_answered_first(service, client):
    # the long one's unet calls each pause a little (outside the others' way: its lock is free between steps) until
    # the short one's answer is in; in submission order the short one would wait for all 50 steps
    assert pngs(ask(client, prompt="warm", seed=3))  # the shape measured by its dry run before the clock starts
    answered, threads = threading.Event(), []

    def pause(*_):
        threads.append(threading.get_ident())
        if threading.get_ident() == threads[0] and not answered.is_set():
            answered.wait(0.05)

    handle = service.pipe.unet.register_forward_pre_hook(pause)
    try:
        ended = threading.Event()
        slow = in_background(lambda: (ask(client, prompt="slow", seed=1, num_inference_steps=50), ended.set())[0])
        wait_until(lambda: len(threads) >= 1 or ended.is_set())
        assert not ended.is_set(), slow().text
        fast = ask(client, prompt="fast", seed=2)
        answered.set()
        assert not ended.is_set()  # still running when the short one was answered
        slow_images = pngs(slow())
    finally:
        handle.remove()
    np.testing.assert_array_equal(pngs(fast)[0], direct(service.pipe, 2, prompt="fast")[0])
    assert len(slow_images) == 1 and threads.count(threads[0]) == 50  # one unet call a step (guidance batched)


# ---- a client that hangs up: its work dropped, waiting or running ------------------------------------------------


def _post_and_hold(client, **fields):
    """A generation posted on a raw connection of its own, left open: closing it is the client hanging up."""
    import json
    import socket

    body = json.dumps({"size": "32x32", "num_inference_steps": 2, **fields}).encode()
    raw = socket.create_connection((client.base_url.host, client.base_url.port), timeout=60)
    raw.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return raw


def test_a_client_that_hangs_up_has_its_waiting_work_dropped_at_once(service, client):
    before = counted(client)
    prompts = []
    seen = service.pipe.text_encoder.register_forward_pre_hook(lambda *_: prompts.append(1))
    try:
        with stalled(service.pipe.unet) as entered:
            running = in_background(ask, client, prompt="first", seed=1)
            assert entered.wait(60)
            beside = in_background(ask, client, prompt="second", seed=3)  # the second worker's
            wait_until(lambda: service.worker.running == 2 and len(prompts) == 4)
            gone = _post_and_hold(client, prompt="gone", seed=2)
            wait_until(lambda: service.worker.depth == 1)
            gone.close()
            wait_until(lambda: service.worker.depth == 0)  # out of the queue while the first two still run
            assert counted(client)["pipemap_dropped_total"] == before["pipemap_dropped_total"] + 1
        assert pngs(running()) and pngs(beside())
    finally:
        seen.remove()
    assert len(prompts) == 4  # the two requests' prompts and their empty negatives: the dropped one never encoded
    after = counted(client)
    assert after['pipemap_requests_total{code="499"}'] == before.get('pipemap_requests_total{code="499"}', 0) + 1


def test_a_client_that_hangs_up_has_its_running_work_stopped_at_the_next_step(service, client):
    before = counted(client)
    calls = []
    counting = service.pipe.unet.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with stalled(service.pipe.unet) as entered:
            gone = _post_and_hold(client, prompt="gone", seed=2, num_inference_steps=20)
            assert entered.wait(60)
            gone.close()
            wait_until(lambda: counted(client).get('pipemap_requests_total{code="499"}', 0)
                       == before.get('pipemap_requests_total{code="499"}', 0) + 1)
        wait_until(lambda: counted(client)["pipemap_dropped_total"] == before["pipemap_dropped_total"] + 1)
        wait_until(lambda: service.worker.running == 0)
    finally:
        counting.remove()
    assert len(calls) < 20  # stopped at the end of the step it was in (guidance: one unet call a step)
    assert pngs(ask(client, prompt="next", seed=3))


def test_a_request_may_ask_for_a_shorter_timeout_than_the_servers(service, client):
    before = code(client, 504)
    with stalled(service.pipe.unet):
        response = ask(client, prompt="slow", seed=1, timeout=0.5)
    assert response.status_code == 504 and "its timeout of 0.5 s" in response.json()["error"]["message"]
    assert code(client, 504) == before + 1
    longer = ask(client, prompt="fine", seed=1, timeout=10_000)  # more than the server's 120 s: the server's holds
    assert pngs(longer)


def test_retry_after_is_the_time_the_waiting_work_takes_to_drain(worker):
    queue = worker(max_queue=3)  # not started: the jobs wait
    queue._recent = 2.5  # seconds between answers lately
    for prompt in "abc":
        queue.submit(_job(prompt))
    with pytest.raises(QueueFullError) as full:
        queue.submit(_job("d"))
    assert full.value.retry_after == 8  # three waiting, 2.5 s apart: 7.5 s, rounded up


def test_stop_drops_what_is_left_after_its_grace(worker):
    pipe = Echo()
    queue = worker(pipe)
    slow, waiting = _job("slow", num_inference_steps=1000), _job("waiting")
    pipe.gate.clear()
    queue.submit(slow)
    queue.start()
    assert pipe.entered.wait(30)
    queue.submit(waiting)
    stopping = in_background(queue.stop, 0.2)
    wait_until(lambda: not slow.wanted())  # the grace has passed: the jobs left are dropped
    pipe.gate.set()
    stopping()
    assert isinstance(slow.future.exception(5), WorkDropped) and pipe.steps < 1000
    assert pipe.calls == ["slow"] and queue.dropped == 2


# ---- batching: requests of one shape as one call -----------------------------------------------------------------


class _Batched:
    """A pipeline stand-in that takes prompt lists: each call recorded with its prompts and seeds; an image per
    prompt, the prompt itself."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.components: dict = {}  # no model: run_many's twins are plain copies
        self.gate = Echo().gate

    def __call__(self, prompt, num_images_per_prompt=1, width=32, generator=None, output_type="pil",
                 callback_on_step_end=None):
        assert self.gate.wait(60)
        prompts = prompt if isinstance(prompt, list) else [prompt]
        generators = generator if isinstance(generator, list) else [generator]
        self.calls.append((tuple(prompts), tuple(g.initial_seed() for g in generators)))
        return type("Out", (), {"images": [p for p in prompts for _ in range(num_images_per_prompt)]})()


def test_jobs_of_one_shape_run_as_one_call_each_answered_with_its_own_image(worker):
    pipe = _Batched()
    queue = worker(pipe, max_batch=3, batch_window=0.0)
    jobs = [_job("a", seed=1), _job("b", seed=2), _job("c", seed=3, width=64), _job("d", seed=4),
            _job("e", seed=5, images=2), _job("f", seed=6)]
    for job in jobs:
        queue.submit(job)
    queue.start()
    assert [job.future.result(30).images for job in jobs] == [["a"], ["b"], ["c"], ["d"], ["e", "e"], ["f"]]
    # a, b and d share a shape (c is wider; e asks for two images, which a batch cannot seed alike): one call
    assert pipe.calls == [(("a", "b", "d"), (1, 2, 4)), (("c",), (3,)), (("e",), (5,)), (("f",), (6,))]
    assert queue.batched == 1


def test_a_batch_holds_what_memory_lets_one_call_hold(worker):
    pipe = _Batched()
    queue = worker(pipe, max_batch=4, batch_window=0.0, fits=lambda call: len(call["prompt"]) <= 2)
    jobs = [_job(p, seed=i) for i, p in enumerate("abcd")]
    for job in jobs:
        queue.submit(job)
    queue.start()
    assert [job.future.result(30).images for job in jobs] == [["a"], ["b"], ["c"], ["d"]]
    assert pipe.calls == [(("a", "b"), (0, 1)), (("c", "d"), (2, 3))]


def test_a_batch_waits_its_window_for_jobs_of_its_shape(worker):
    pipe = _Batched()
    queue = worker(pipe, max_batch=2, batch_window=30.0)
    first, second = _job("a", seed=1), _job("b", seed=2)
    queue.submit(first)
    queue.start()
    wait_until(lambda: queue.depth == 0 and len(queue.taken) == 1)  # taken, waiting for a second of its shape
    queue.submit(second)  # comes within the window: the batch is full and runs at once
    assert first.future.result(30).images == ["a"] and second.future.result(30).images == ["b"]
    assert pipe.calls == [(("a", "b"), (1, 2))]


@pytest.mark.slow
def test_batched_requests_over_http_each_get_the_image_their_seed_makes_alone(service):
    from pipemap.serve import Background, Service

    own = Service(service.pipe, service.plan, service.running_plan, timeout=120.0, workers=1, max_batch=3,
                  batch_window=0.0)
    with Background(own) as url, httpx.Client(base_url=url, timeout=120) as session:
        with stalled(service.pipe.unet) as entered:
            first = in_background(ask, session, prompt="first", seed=1)
            assert entered.wait(60)
            rest = [in_background(ask, session, prompt=f"cat {seed}", seed=seed) for seed in (2, 3, 4)]
            wait_until(lambda: own.worker.depth == 3)
        answers = [first()] + [each() for each in rest]
    assert own.worker.batched == 1  # the three that waited ran as one call
    for response, seed, prompt in zip(answers, (1, 2, 3, 4), ("first", "cat 2", "cat 3", "cat 4")):
        assert response.json()["seed"] == seed
        got, want = pngs(response)[0], direct(service.pipe, seed, prompt=prompt)[0]
        assert np.abs(got.astype(int) - want).max() <= 1  # a batch's kernels may round apart


def test_a_batch_is_formed_when_a_worker_is_free_so_a_job_dropped_meanwhile_never_runs(worker):
    # the unordered runner reads the next call only when a worker is free for it: c and d wait in the queue while
    # a and b run, so d, whose client hangs up meanwhile, leaves the queue instead of running in c's batch
    import functools

    from pipemap.dispatch.parallel import iter_unordered

    pipe = _Batched()
    pipe.gate.clear()
    runner = functools.partial(iter_unordered, workers=1, return_exceptions=True)
    queue = worker(pipe, runner=runner, max_batch=2, batch_window=0.0, ordered=False)
    jobs = [_job(p, seed=i) for i, p in enumerate("abcd")]
    for job in jobs:
        queue.submit(job)
    queue.start()
    wait_until(lambda: queue.running == 2 and queue.depth == 2)
    queue.cancel(jobs[3])
    pipe.gate.set()
    assert [job.future.result(30).images for job in jobs[:3]] == [["a"], ["b"], ["c"]]
    assert pipe.calls == [(("a", "b"), (0, 1)), (("c",), (2,))] and queue.dropped == 1 and not jobs[3].future.done()


def test_a_batch_member_whose_client_leaves_while_the_batch_waits_for_memory_is_answered_dropped_and_left_out(worker):
    # the batch (a, b) is formed and handed to the runner; its shape's dry run (the admission's measure) is under way
    # when b's client hangs up: the call that runs holds a alone, and b is answered dropped without running
    import functools

    from pipemap.dispatch.parallel import iter_unordered
    from pipemap.plan import DeviceUse, Placement, Plan
    from pipemap.runtime.admission import Admission, Needs

    measuring, measured = threading.Event(), threading.Event()

    def measure(plan, call):
        measuring.set()
        assert measured.wait(60)
        return Needs({"cuda:0": 1}, {})

    plan = Plan("balanced", (Placement("unet", "cuda:0", 10),), (DeviceUse("cuda:0", 100, 100, 10),), "cuda:0")
    pipe = _Batched()
    runner = functools.partial(iter_unordered, workers=1, return_exceptions=True, memory=Admission(plan, measure))
    queue = worker(pipe, runner=runner, max_batch=2, batch_window=30.0, ordered=False)
    kept, left = _job("a", seed=1), _job("b", seed=2)
    queue.submit(kept)
    queue.submit(left)
    queue.start()
    assert measuring.wait(30)  # the batch waits for memory
    queue.cancel(left)
    measured.set()
    assert kept.future.result(30).images == ["a"]
    assert isinstance(left.future.exception(30), WorkDropped)
    assert pipe.calls == [(("a",), (1,))] and queue.dropped == 1 and queue.batched == 0


def test_a_batched_video_calls_share_is_its_own_video():
    from pipemap.serve.worker import Share

    videos = type("Out", (), {"frames": [["a0", "a1"], ["b0", "b1"]]})()
    images = type("Out", (), {"images": ["a", "b"]})()
    assert Share.of(videos, 1) == Share([], [["b0", "b1"]]) and Share.of(images, 0) == Share(["a"])
