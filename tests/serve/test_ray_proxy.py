"""Ray Serve's proxy answering its own errors as the app does: a plain-text error of Ray's, or no answer at all (Ray's
500 for a replica lost under a request), becomes JSON in OpenAI's shape with a Retry-After; the app's answers pass."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx", reason="the serve tests need httpx: pip install -e '.[test]'")
from starlette.applications import Starlette  # noqa: E402
from starlette.middleware import Middleware  # noqa: E402
from starlette.responses import JSONResponse, PlainTextResponse, Response  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from pipemap.serve.ray_proxy import RayErrorsAsJson, ShapeHeader, middlewares  # noqa: E402


async def _silent(scope, receive, send) -> None:
    """Ray's proxy when the replica under a request died: it sends nothing."""


def _proxy(answer) -> TestClient:
    async def route(request) -> Response:
        return answer

    app = Starlette(routes=[Route("/x", route)], middleware=middlewares())
    return TestClient(app)


def test_ray_s_plain_errors_are_answered_as_json_with_retry_after():
    with _proxy(PlainTextResponse("Request dropped due to backpressure", 429, {"Retry-After": "2"})) as client:
        refused = client.get("/x")
    assert (refused.status_code, refused.headers["retry-after"]) == (429, "2")
    assert refused.json()["error"]["code"] == "queue_full" and "backpressure" in refused.json()["error"]["message"]
    with _proxy(PlainTextResponse("Deployment is unavailable", 503)) as client:
        none = client.get("/x")
    assert (none.status_code, none.headers["retry-after"], none.json()["error"]["code"]) == (503, "5", "no_replica")


def test_a_replica_lost_without_an_answer_is_503_with_retry_after():
    lost = TestClient(RayErrorsAsJson(_silent)).post("/v1/images/generations", json={})  # no lifespan: a proxy's
    assert (lost.status_code, lost.headers["retry-after"], lost.json()["error"]["code"]) == (503, "5", "replica_lost")


def test_the_app_s_own_answers_pass_untouched():
    app_error = JSONResponse({"error": {"code": "pipeline_error"}}, 500)
    with _proxy(app_error) as client:
        assert client.get("/x").json() == {"error": {"code": "pipeline_error"}}
    with _proxy(PlainTextResponse("pipemap_running 0\n")) as client:  # /metrics: text, but no error
        assert client.get("/x").text == "pipemap_running 0\n"
    assert all(isinstance(m, Middleware) for m in middlewares())


def test_a_generation_s_shape_is_named_for_ray_s_router_and_its_body_handed_on_unchanged():
    seen: list = []

    async def app(scope, receive, send) -> None:
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        seen.append(([v for k, v in scope["headers"] if k.replace(b"-", b"_") == b"serve_multiplexed_model_id"],
                     body))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    cat = {"prompt": "a cat", "size": "64x64", "seed": 1}
    client = TestClient(ShapeHeader(app))  # no lifespan: a proxy's middleware sees HTTP only
    client.post("/v1/images/generations", json=cat)
    client.post("/v1/images/generations", json=cat, headers={"serve-multiplexed-model-id": "mine"})
    client.post("/v1/images/generations", content=b"{not json", headers={"content-type": "application/json"})
    client.post("/v1/images/edits", json=cat)
    named, body = seen[0]
    assert named == [b"size=64x64,prompt=0"] and json.loads(body) == cat
    assert seen[1][0] == [b"mine"]  # the client's own id stands
    assert seen[2] == ([], b"{not json")  # the app answers it
    assert seen[3][0] == []  # not a generation
