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
