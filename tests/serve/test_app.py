"""serve/app.py, the HTTP routes, for real: uvicorn on a free loopback port, requests through httpx, the tiny pipeline
on CPU. A generation is the direct call with the same seed; the plan, health and metrics routes answer; errors come
in OpenAI's shape, and a service shutting down answers 503."""

from __future__ import annotations

import json

import numpy as np
import pytest

import pipemap

httpx = pytest.importorskip("httpx", reason="the serve tests need httpx: pip install -e '.[test]'")
pytest.importorskip("uvicorn", reason="pipemap serve needs uvicorn: pip install -e '.[serve]'")
from starlette.testclient import TestClient  # noqa: E402

from pipemap.serve import ROUTES, Service, create_app  # noqa: E402
from pipemap.serve.app import error  # noqa: E402
from serving import GENERATIONS, ask, counted, direct, pngs, samples  # noqa: E402

# ---- generation ----------------------------------------------------------------------------------------------


@pytest.mark.slow  # over 2 s: out of the quick subset
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


def test_plan_health_and_routes(service, client):
    plan = client.get("/v1/plan").json()
    assert pipemap.Plan.from_dict(plan) == service.plan
    assert set(plan["runs_on"].values()) == {"cpu"}  # the planned GPU is not on this machine
    assert client.get("/health").json() == {"status": "ok", "queue_depth": 0, "running": 0}
    missing, wrong = client.get("/nowhere"), client.get(GENERATIONS)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
    assert wrong.headers["allow"] == "POST"


# ---- the app itself ------------------------------------------------------------------------------------------


def test_every_route_is_served_with_its_method(service):
    app = create_app(service)
    served = {(method, route.path) for route in app.routes for method in route.methods if method != "HEAD"}
    assert served == {(method, path) for method, path, _ in ROUTES}
    assert {path for _, path, _ in ROUTES} >= {"/", GENERATIONS, "/health", "/v1/plan", "/metrics"}
    assert app.state.service is service


def test_metrics_route_is_prometheus_text(client):
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert {"pipemap_queue_depth", "pipemap_running", "pipemap_dropped_total"} <= set(samples(response.text))


def test_an_error_is_in_openais_shape():
    response = error(429, "the queue is full", "server_busy", code="queue_full", headers={"Retry-After": "3"})
    assert response.status_code == 429 and response.headers["retry-after"] == "3"
    assert "x-should-retry" not in response.headers  # a retry later may be taken
    assert json.loads(response.body) == {"error": {"message": "the queue is full", "type": "server_busy",
                                                   "param": None, "code": "queue_full"}}


def test_a_service_shutting_down_answers_503_and_its_health_says_so(service):
    # a service of its own on the same pipeline: draining it leaves the module's service serving
    draining = Service(service.pipe, service.plan, service.running_plan)
    draining.worker.drain()
    # no lifespan: the worker is never started; the Host a loopback server answers
    client = TestClient(create_app(draining), base_url="http://localhost")
    response = client.post(GENERATIONS, json={"prompt": "a cat", "size": "32x32"})
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "draining"
    health = client.get("/health")
    assert health.status_code == 503 and health.json() == {"status": "draining", "queue_depth": 0, "running": 0}
    assert samples(client.get("/metrics").text)['pipemap_requests_total{code="503"}'] == 1


# ---- the conventions OpenAI clients and orchestrators expect ----------------------------------------------------


@pytest.fixture(scope="module")
def named(service):
    """A service that serves the tiny SD under a name and an alias."""
    from pipemap.serve import Background

    own = Service(service.pipe, service.plan, service.running_plan, timeout=60.0, names=("tiny-sd", "sd-alias"))
    with Background(own) as url, httpx.Client(base_url=url, timeout=60) as session:
        yield own, session


def test_models_lists_the_served_name_in_openais_shape(named):
    own, session = named
    listed = session.get("/v1/models").json()
    assert listed == {"object": "list", "data": [{"id": "tiny-sd", "object": "model", "created": own.created,
                                                   "owned_by": "pipemap"}]}
    assert session.get("/v1/models/sd-alias").json()["id"] == "sd-alias"
    unknown = session.get("/v1/models/dall-e-3")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_a_model_not_served_answers_404_and_a_served_name_or_alias_is_taken(named):
    own, session = named
    refused = ask(session, prompt="a cat", model="dall-e-3", seed=1, num_inference_steps=1)
    assert refused.status_code == 404
    error = refused.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("model_not_found", "model", "invalid_request_error")
    assert "'tiny-sd', 'sd-alias'" in error["message"]
    for name in ("tiny-sd", "sd-alias", None):
        fields = {"model": name} if name else {}
        assert len(pngs(ask(session, prompt="a cat", seed=1, num_inference_steps=1, **fields))) == 1


def test_openais_unused_fields_are_taken_and_named_in_a_warning(named):
    own, session = named
    fields = dict(quality="hd", style="vivid", background="transparent", output_format="webp")
    response = ask(session, prompt="a cat", seed=1, num_inference_steps=1, **fields)
    assert len(pngs(response)) == 1
    assert response.headers["warning"] == ", ".join(f'299 pipemap "{name} is ignored: this server has no such '
                                                    'option"' for name in fields)


def test_liveness_and_readiness(named):
    own, session = named
    assert session.get("/health/live").json() == {"status": "alive"}
    assert session.get("/health/ready").json() == {"ready": True, "reason": None, "queue_depth": 0, "running": 0}


def _asked_failing_once(service, session, error: Exception):
    """One request whose VAE decode raises ``error`` (a pre-hook, removed after)."""
    failures = [error]

    def fail_once(*_):
        if failures:
            raise failures.pop()

    handle = service.pipe.vae.decoder.register_forward_pre_hook(fail_once)
    try:
        return ask(session, prompt="a cat", seed=1, num_inference_steps=1)
    finally:
        handle.remove()


def test_a_sticky_device_error_makes_the_service_unready_and_refuse_work(service):
    from pipemap.serve import Background

    own = Service(service.pipe, service.plan, service.running_plan, timeout=60.0)
    sticky = RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be "
                          "asynchronously reported")
    with Background(own) as url, httpx.Client(base_url=url, timeout=60) as session:
        failed = _asked_failing_once(service, session, sticky)
        assert failed.status_code == 500 and failed.json()["error"]["code"] == "device_error"
        ready = session.get("/health/ready")
        assert ready.status_code == 503 and ready.json()["ready"] is False
        assert "illegal memory access" in ready.json()["reason"]
        assert session.get("/health/live").status_code == 200  # alive: the orchestrator restarts it on readiness
        after = ask(session, prompt="a cat", seed=1, num_inference_steps=1)
        assert after.status_code == 503 and after.json()["error"]["code"] == "device_error"
        health = session.get("/health")  # an orchestrator probing /health restarts it too
        assert health.status_code == 503 and health.json()["status"] == "device_error"


def test_a_plain_pipeline_error_leaves_the_service_ready(service):
    from pipemap.serve import Background

    own = Service(service.pipe, service.plan, service.running_plan, timeout=60.0)
    with Background(own) as url, httpx.Client(base_url=url, timeout=60) as session:
        failed = _asked_failing_once(service, session, RuntimeError("injected: shapes do not match"))
        assert failed.json()["error"]["code"] == "pipeline_error"
        assert session.get("/health/ready").status_code == 200 and own.broken is None


@pytest.fixture(scope="module")
def wan_folder(tmp_path_factory):
    from families import build

    pipe, _ = build("wan_t2v")
    folder = tmp_path_factory.mktemp("wan")
    pipe.save_pretrained(folder)
    return str(folder)


@pytest.mark.slow
def test_a_video_pipeline_answers_each_video_as_a_lossless_animated_webp_of_its_frames(wan_folder):
    import base64
    import io

    import torch
    from PIL import Image

    from pipemap.serve import Background, Options
    from pipemap.serve.app import VIDEO_FPS

    service = Service.load(Options(wan_folder, timeout=300.0))
    with Background(service) as url, httpx.Client(base_url=url, timeout=300) as session:
        answer = session.post(GENERATIONS, json={"prompt": "a cat", "size": "16x16", "num_frames": 5,
                                                 "num_inference_steps": 2, "seed": 3})
    assert answer.status_code == 200, answer.text
    (video,) = answer.json()["data"]
    assert (video["mime_type"], video["frames"], video["fps"]) == ("image/webp", 5, VIDEO_FPS)
    webp = Image.open(io.BytesIO(base64.b64decode(video["b64_json"])))
    assert webp.format == "WEBP" and webp.n_frames == 5
    got = []
    for index in range(webp.n_frames):
        webp.seek(index)
        got.append(np.array(webp.convert("RGB")))
    want = service.pipe(prompt="a cat", width=16, height=16, num_frames=5, num_inference_steps=2,
                        generator=torch.Generator("cpu").manual_seed(3), output_type="pil").frames[0]
    assert len(want) == 5 and all(np.array_equal(g, np.array(w)) for g, w in zip(got, want))  # lossless
