"""``pipemap serve`` under the memory ledger: requests of mixed sizes at once on a tight plan are each answered 200
or a typed 400 with the figures (never 500); those that fit later wait, and ``/metrics`` counts the waits; the
default worker count follows from the plan's room."""

from __future__ import annotations

import base64
import io
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from PIL import Image

httpx = pytest.importorskip("httpx", reason="the serve tests need httpx: pip install -e '.[test]'")
pytest.importorskip("uvicorn", reason="pipemap serve needs uvicorn: pip install -e '.[serve]'")
from pipemap.serve import Background, Options, Service  # noqa: E402

GENERATIONS = "/v1/images/generations"
# the tiny SD balanced on two GPUs with no headroom: unet and text encoder on cuda:0 leave 1.8 MiB of room there, where
# a 32x32 request rests 90 KiB and its unet calls take 1.6 MiB more (16x16: a quarter of that); 64x64, or two images,
# fit on no device even alone
TIGHT = "cuda:0=5MiB,cuda:1=4MiB,cpu=1GiB"


@pytest.fixture(scope="module")
def service(tiny_folders):
    return Service.load(Options(tiny_folders["sd"], hardware=TIGHT, strategy="balanced", headroom=0.0, max_queue=8,
                                timeout=120.0, max_n=2, admit_as_planned=True))  # the stand-in GPUs' budgets


@pytest.fixture(scope="module")
def client(service):
    with Background(service) as url, httpx.Client(base_url=url, timeout=120) as session:
        yield session


def ask(client, size: str, n: int = 1, seed: int = 1) -> httpx.Response:
    return client.post(GENERATIONS, json={"prompt": "a tiny cat", "size": size, "n": n, "seed": seed,
                                          "num_inference_steps": 2})


def counted(client) -> dict[str, float]:
    text = client.get("/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(r"^(\w+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def wait_until(predicate, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "gave up waiting"
        time.sleep(0.02)


def image(response) -> np.ndarray:
    return np.array(Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"]))).convert("RGB"))


@pytest.mark.slow
def test_mixed_sizes_at_once_are_answered_200_or_a_typed_400_and_memory_waits(service, client):
    # the default worker count: (1.8 MiB of room less one unet call's 1.6 MiB) / 90 KiB of rest: two requests
    assert service.memory is not None and service.workers == 2
    for size in ("16x16", "32x32"):  # each shape measured once, by a dry run, before the rush
        assert ask(client, size).status_code == 200
    before = counted(client)
    entered, release = threading.Event(), threading.Event()

    def hold(*_) -> None:
        entered.set()
        release.wait(60)

    stall = service.pipe.unet.register_forward_pre_hook(hold)
    with ThreadPoolExecutor(5) as pool:
        first = pool.submit(ask, client, "32x32", 1, 0)  # holds the pipeline while the others arrive together
        assert entered.wait(60)
        stall.remove()
        sizes = [("16x16", 1), ("32x32", 1), ("32x32", 2), ("64x64", 1)]
        rush = [pool.submit(ask, client, size, n, seed) for seed, (size, n) in enumerate(sizes, start=2)]
        # the two that fit: one in flight beside the first (waiting for memory), one waiting in the queue
        wait_until(lambda: service.worker.running == 2 and service.worker.depth == 1)
        release.set()
        answers = [first.result()] + [r.result() for r in rush]
    codes = [a.status_code for a in answers]
    assert codes == [200, 200, 200, 400, 400], [a.text for a in answers]
    for refused, param in zip(answers[3:], ("n", "size")):
        error = refused.json()["error"]
        assert error["code"] == "insufficient_memory" and error["param"] == param
        assert re.search(r"needs [\d.]+ \w+ of activations on cuda:0 .* leaves [\d.]+ \w+ there", error["message"])
    after = counted(client)
    assert after["pipemap_memory_waits_total"] > before["pipemap_memory_waits_total"]  # the unet calls took turns
    assert after['pipemap_requests_total{code="400"}'] == before.get('pipemap_requests_total{code="400"}', 0) + 2
    assert after.get('pipemap_requests_total{code="500"}', 0) == 0
    assert after['pipemap_activation_reserved_bytes{device="cuda:0"}'] == 0 and after["pipemap_memory_waiting"] == 0
    assert after['pipemap_activation_room_bytes{device="cuda:0"}'] == service.memory.ledger.room("cuda:0")
    direct = service.pipe(prompt="a tiny cat", width=16, height=16, num_inference_steps=2, output_type="pil",
                          generator=torch.Generator("cpu").manual_seed(2)).images[0]
    np.testing.assert_array_equal(image(answers[1]), np.array(direct))


@pytest.mark.slow
def test_an_out_of_memory_move_is_answered_200_and_counted(service, client):
    # injected on the CPU inside the unet's first call: the least-used component of cuda:0 (the text encoder, the
    # vae being on cuda:1) moves to the host and the call is retried
    failures = [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 KiB. GPU 0 has a total "
                                       "capacity of 5.00 MiB of which 0 bytes are free.")]

    def fail_once(*_) -> None:
        if failures:
            raise failures.pop()

    before = counted(client)
    inner = next(m for m in service.pipe.unet.modules() if not list(m.children()))  # inside the unet's call
    handle = inner.register_forward_pre_hook(fail_once)
    try:
        response = ask(client, "32x32", seed=9)
    finally:
        handle.remove()
    assert response.status_code == 200 and not failures
    after = counted(client)
    key = 'pipemap_memory_moves_total{device="cuda:0"}'
    assert after[key] == before.get(key, 0) + 1
    (relief,) = service.memory.moves
    plan = client.get("/v1/plan").json()
    assert relief.moved == ("text_encoder",) and relief.note in plan["notes"]
    assert plan["components"]["text_encoder"]["mode"] == "offload"
    direct = service.pipe(prompt="a tiny cat", width=32, height=32, num_inference_steps=2, output_type="pil",
                          generator=torch.Generator("cpu").manual_seed(9)).images[0]
    np.testing.assert_array_equal(image(response), np.array(direct))


@pytest.mark.slow  # a load and a dry run
def test_a_plan_whose_gpus_run_on_the_cpu_admits_by_the_cpus_room_by_default(tiny_folders):
    # the same TIGHT plan, served as `pipemap serve --hardware` would on this machine without its GPUs: 64x64, which
    # the stand-in cuda:0 could not hold, fits the CPU the request runs on (issue 38)
    service = Service.load(Options(tiny_folders["sd"], hardware=TIGHT, strategy="balanced", headroom=0.0,
                                   timeout=120.0))
    assert set(service.plan.device_map.values()) == {"cuda:0", "cuda:1"} and service.memory is None
    assert service.sizes is not None and set(service.sizes.ledger.memory) == {"cpu"}
    with Background(service) as url, httpx.Client(base_url=url, timeout=120) as session:
        answer = ask(session, "64x64")
    assert answer.status_code == 200, answer.text
    assert image(answer).shape == (64, 64, 3)


# ---- a plan with no GPU: requests checked against the host's room ----------------------------------------------


@pytest.fixture(scope="module")
def on_cpu(tiny_folders):
    """The tiny SD planned for a host of 2 GiB and no GPU: no ledger admits its requests, but each call's shape is
    checked by its dry run against the 2 GiB less the weights (5.75 MiB)."""
    service = Service.load(Options(tiny_folders["sd"], hardware="cpu=2GiB", timeout=120.0, max_n=2))
    with Background(service) as url, httpx.Client(base_url=url, timeout=120) as session:
        yield service, session


@pytest.mark.slow  # two dry runs, 3 s each on 2 cores
def test_a_cpu_plan_refuses_a_request_too_large_for_the_host_with_the_figures_and_never_runs_it(on_cpu):
    service, session = on_cpu
    assert service.memory is None and service.sizes is not None  # no GPU: no admission, but a size check
    calls = []
    counting = [m.register_forward_pre_hook(lambda *_: calls.append(1)) for m in (service.pipe.unet, service.pipe.vae,
                                                                                   service.pipe.text_encoder)]
    try:
        huge = ask(session, "8192x8192")  # 101.5 GiB of activations by its dry run: the kernel would kill us
        absurd = ask(session, "16384x16384")  # the most side
        two = session.post(GENERATIONS, json={"prompt": "a cat", "size": "4096x4096", "n": 2,
                                              "num_inference_steps": 2})
    finally:
        for handle in counting:
            handle.remove()
    assert calls == []  # refused before the pipeline ran any model
    for response, param in ((huge, "size"), (absurd, "size"), (two, "n")):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("insufficient_memory", param)
        assert re.search(r"needs (about )?[\d.]+ GiB of activations on cpu", error["message"])
    assert "but the plan leaves 1.99 GiB there beside its weights" in huge.json()["error"]["message"]
    assert "scaled from" in absurd.json()["error"]["message"]  # far too large by the 8192's figures: no dry run
    assert image(ask(session, "32x32", seed=4)).shape == (32, 32, 3)  # the server goes on
    # a batch of k such requests takes k times one's activations: 1.6 MiB each against the host's 1.99 GiB
    batch = {"prompt": ["a cat"] * 1000, "num_images_per_prompt": 1, "width": 32, "height": 32,
             "num_inference_steps": 2}
    assert service.fits(batch) and not service.fits({**batch, "prompt": ["a cat"] * 2000})
    assert counted(session).get('pipemap_requests_total{code="500"}', 0) == 0


def test_the_work_a_request_is_scaled_by_counts_its_frames():
    # activations grow with pixels x images x frames; a video call that leaves its frames to the pipeline's default
    # has no figure to scale by (the default may be 81 frames), so it goes to its own dry run
    from pipemap.serve.service import _work

    assert _work({"width": 32, "height": 16, "num_images_per_prompt": 2, "num_frames": 9}, video=True) == 32 * 16 * 18
    assert _work({"width": 32, "height": 16}, video=True) is None and _work({"width": 32, "height": 16}) == 512
    assert _work({"num_frames": 9}, video=True) is None
