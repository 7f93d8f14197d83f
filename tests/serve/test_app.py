"""``pipemap serve`` for real: uvicorn on a free loopback port, requests through httpx, the tiny pipeline on CPU.

Stalls and failures are put inside the pipeline with plain torch forward pre-hooks on its own modules, so the
server sees what a slow or broken model would do to it.
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from PIL import Image

import pipemap
from pipemap.planner import forcing_hardware

httpx = pytest.importorskip("httpx", reason="the serve tests need httpx: pip install -e '.[test]'")
pytest.importorskip("uvicorn", reason="pipemap serve needs uvicorn: pip install -e '.[serve]'")
from pipemap.serve import Background, Options, Service, resolve_folder  # noqa: E402

GENERATIONS = "/v1/images/generations"
STEPS = 2


@pytest.fixture(scope="module")
def service(tiny_folders):
    """The tiny SD pipeline on a plan that offloads (so bytes move), remapped onto the CPU; one waiting request at
    most, so a second one waiting is refused; two requests in flight through run_many."""
    folder = tiny_folders["sd"]
    hardware = forcing_hardware(pipemap.inspect(folder), "balanced_low_memory")
    return Service.load(Options(folder, hardware=hardware, strategy="balanced_low_memory", headroom=0.0,
                                max_queue=1, timeout=120.0, max_n=2, workers=2))


@pytest.fixture(scope="module")
def url(service):
    with Background(service) as address:
        yield address


@pytest.fixture(scope="module")
def client(url):
    with httpx.Client(base_url=url, timeout=120) as session:
        yield session


def ask(client, **fields) -> httpx.Response:
    return client.post(GENERATIONS, json={"size": "32x32", "num_inference_steps": STEPS, **fields})


def pngs(response) -> list[np.ndarray]:
    assert response.status_code == 200, response.text
    return [np.array(Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))).convert("RGB"))
            for d in response.json()["data"]]


def direct(pipe, seed: int, **call) -> list[np.ndarray]:
    """The same call made on the pipeline directly, without the server."""
    images = pipe(generator=torch.Generator("cpu").manual_seed(seed), output_type="pil", width=32, height=32,
                  num_inference_steps=STEPS, **call).images
    return [np.array(image) for image in images]


def counted(client) -> dict[str, float]:
    """``/metrics`` as ``{sample with labels: value}``."""
    text = client.get("/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(r"^(\w+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def code(client, status: int) -> float:
    return counted(client).get(f'pipemap_requests_total{{code="{status}"}}', 0.0)


@contextlib.contextmanager
def stalled(module):
    """``module``'s forward waits until the block exits: ``entered`` is set once a call is inside."""
    entered, release = threading.Event(), threading.Event()

    def wait(*_):
        entered.set()
        release.wait(60)

    handle = module.register_forward_pre_hook(wait)
    try:
        yield entered
    finally:
        release.set()
        handle.remove()


def in_background(function, *args, **kwargs):
    """Run ``function`` on a thread; the returned callable joins it and gives its result."""
    result = {}
    thread = threading.Thread(target=lambda: result.update(value=function(*args, **kwargs)), daemon=True)
    thread.start()

    def join():
        thread.join(120)
        return result["value"]

    return join


def wait_until(predicate, seconds: float = 60):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "gave up waiting"
        time.sleep(0.02)


# ---- generation ----------------------------------------------------------------------------------------------


def test_generation_is_the_direct_call_with_the_same_seed(service, client, tiny_folders):
    before = counted(client)
    fields = dict(prompt="a tiny cat", negative_prompt="a dog", guidance_scale=6.0, seed=7, n=2)
    response = ask(client, **fields)
    images = pngs(response)
    assert response.json()["seed"] == 7 and len(images) == 2
    call = {k: v for k, v in fields.items() if k not in ("seed", "n")}
    expected = direct(service.pipe, 7, num_images_per_prompt=2, **call)
    for got, want in zip(images, expected):
        np.testing.assert_array_equal(got, want)
    # and the un-mapped diffusers pipeline agrees, give or take a rounding to 8 bits
    from diffusers import DiffusionPipeline

    plain = DiffusionPipeline.from_pretrained(tiny_folders["sd"])
    plain.set_progress_bar_config(disable=True)
    for got, want in zip(images, direct(plain, 7, num_images_per_prompt=2, **call)):
        assert np.abs(got.astype(int) - want).max() <= 1
    after = counted(client)
    assert after['pipemap_requests_total{code="200"}'] == before.get('pipemap_requests_total{code="200"}', 0) + 1
    assert after["pipemap_images_total"] == before["pipemap_images_total"] + 2
    assert after["pipemap_image_seconds_count"] == before["pipemap_image_seconds_count"] + 2
    moved = {k: v for k, v in after.items() if k.startswith("pipemap_bytes_moved_total")}
    offloaded = [p.component for p in service.plan.components if p.mode == "offload"]
    assert offloaded and all(moved[f'pipemap_bytes_moved_total{{component="{c}",direction="host_to_device"}}'] > 0
                             for c in offloaded)


def test_a_prompt_too_long_is_truncated_with_a_warning(service, client):
    prompt = "a very long prompt about a tiny cat " * 10  # 360 characters: 360 byte tokens, the encoder reads 77
    response = ask(client, prompt=prompt, seed=1)
    assert response.status_code == 200
    assert re.fullmatch(r'299 pipemap "prompt is \d+ tokens; tokenizer reads 77, the rest was dropped"',
                        response.headers["warning"])
    np.testing.assert_array_equal(pngs(response)[0], direct(service.pipe, 1, prompt=prompt)[0])


def test_plan_health_and_routes(service, client):
    plan = client.get("/v1/plan").json()
    assert pipemap.Plan.from_dict(plan) == service.plan
    assert set(plan["runs_on"].values()) == {"cpu"}  # the planned GPU is not on this machine
    assert client.get("/health").json() == {"status": "ok", "queue_depth": 0, "running": 0}
    assert client.get("/nowhere").status_code == 404
    assert client.get(GENERATIONS).status_code == 405


# ---- bad requests ----------------------------------------------------------------------------------------------

BAD = {
    "size not a multiple": ({"prompt": "a cat", "size": "38x32"}, "size", "multiples of 8, e.g. '40x32'"),
    "size not WxH": ({"prompt": "a cat", "size": "large"}, "size", "not WIDTHxHEIGHT"),
    "n too large": ({"prompt": "a cat", "n": 3}, "n", "at most 2 images"),
    "n below 1": ({"prompt": "a cat", "n": 0}, "n", "greater than or equal to 1"),
    "unknown field": ({"prompt": "a cat", "quality": "hd"}, "quality", "unknown field 'quality'"),
    "no prompt": ({"n": 1}, "prompt", "Field required"),
    "prompt not text": ({"prompt": 3}, "prompt", "valid string"),
    "url format": ({"prompt": "a cat", "response_format": "url"}, "response_format", "'b64_json'"),
    "steps below 1": ({"prompt": "a cat", "num_inference_steps": 0}, "num_inference_steps", "greater than"),
    "seed negative": ({"prompt": "a cat", "seed": -1}, "seed", "greater than"),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_request_names_its_field(client, kind):
    fields, param, words = BAD[kind]
    before = code(client, 400)
    response = client.post(GENERATIONS, json=fields)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert words in error["message"]
    assert code(client, 400) == before + 1


def test_a_body_that_is_not_json(client):
    response = client.post(GENERATIONS, content=b"{prompt: cat", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"


# ---- a full queue, a timeout, a failure: each answered, and the server goes on -----------------------------------


def test_a_full_queue_answers_429_with_retry_after(service, client):
    before = code(client, 429)
    with stalled(service.pipe.unet) as entered:
        running = in_background(ask, client, prompt="first", seed=1)
        assert entered.wait(60)
        waiting = in_background(ask, client, prompt="second", seed=2)
        wait_until(lambda: service.worker.depth == 1)
        refused = ask(client, prompt="third", seed=3)
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "queue_full"
        assert counted(client)["pipemap_queue_depth"] == 1 and counted(client)["pipemap_running"] == 1
    for response, seed, prompt in ((running(), 1, "first"), (waiting(), 2, "second")):
        np.testing.assert_array_equal(pngs(response)[0], direct(service.pipe, seed, prompt=prompt)[0])
    assert code(client, 429) == before + 1


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


# ---- the command line: serve, then SIGTERM while a request runs -------------------------------------------------


@pytest.mark.slow
def test_pipemap_serve_finishes_running_work_on_sigterm_and_refuses_new(tiny_folders, tmp_path):
    with socket.socket() as probe:  # a port free now; the server binds it a few seconds later
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - the child writes it until it exits
    server = subprocess.Popen([sys.executable, "-m", "pipemap", "serve", tiny_folders["sd"], "--port", str(port)],
                              env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as session:
            wait_until(lambda: _up(session) or server.poll() is not None, 240)
            assert server.poll() is None, (tmp_path / "serve.log").read_text()
            running = in_background(ask, session, prompt="a slow cat", seed=3, num_inference_steps=30)
            wait_until(lambda: session.get("/health").json()["running"] == 1)
            server.send_signal(signal.SIGTERM)
            assert pngs(running())  # the request running when the signal came is answered
            assert server.wait(60) in (0, -signal.SIGTERM)
            with pytest.raises(httpx.ConnectError):
                session.get("/health")
    finally:
        server.kill()
        server.wait()
        log.close()


def _up(session) -> bool:
    try:
        return session.get("/health").status_code == 200
    except httpx.TransportError:
        return False


def test_a_name_not_in_the_cache_says_so():
    # HF_HUB_OFFLINE is set for every test, and no test downloads: a published name resolves to nothing
    with pytest.raises(pipemap.NotAPipelineError, match="'black-forest-labs/FLUX.1-dev' is not in the Hugging Face"):
        resolve_folder("flux.1-dev")
