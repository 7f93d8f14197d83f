"""Ray Serve's HTTP proxy answering as the app does: its own error answers, plain text, become JSON in OpenAI's shape.

Ray's proxy answers some requests itself, in plain text: a replica that died under a request (its node lost, or a
restart) is Ray's 500, no replica to route to its 503, its own queue full its 429, its request timeout its 408. This
middleware, loaded into the proxy by Ray's ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` (``pipemap serve --ray``
sets it for a local Ray; a cluster's head node is started with it), answers those as the app answers: a lost replica
or none is 503 with a Retry-After (the client retries, another replica answers), a timeout 504. The app's own answers
are JSON and pass untouched.

A second middleware, ``ShapeHeader``, names each generation request's shape for Ray's router (``ray_router``), so
requests of one shape go to the replicas that have measured it.
"""

from __future__ import annotations

import json

from starlette.datastructures import Headers, MutableHeaders
from starlette.middleware import Middleware

from .ray_router import shape_key

ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "pipemap.serve.ray_proxy:middlewares"
RETRY_AFTER_S = 5  # a replica lost is replaced in seconds (more where its pipeline loads again)

# Ray's status: (ours, code, what it means, error type)
_ANSWERS = {
    500: (503, "replica_lost", "the replica running the request went away (its node was lost, or it restarted): "
          "retry, another replica answers", "server_busy"),
    503: (503, "no_replica", "no replica can take the request now (they are starting or being replaced): retry "
          "in a few seconds", "server_busy"),
    429: (429, "queue_full", "every replica's queue is full: retry later", "server_busy"),
    408: (504, "timeout", "the request waited past the server's timeout for a replica: retry later", "timeout"),
}


def middlewares() -> list[Middleware]:
    """What Ray's proxy calls (``CALLBACK``): its middlewares."""
    return [Middleware(ShapeHeader), Middleware(RayErrorsAsJson)]  # Ray wraps in this order: the last outermost


SHAPE_HEADER = b"serve_multiplexed_model_id"  # what Ray's proxy reads a request's multiplexed model id from
SHAPED_PATH = "/images/generations"
MOST_READ = 256 * 1024  # bytes: a generation's JSON is a prompt and a few numbers; a larger body is left unread


class ShapeHeader:
    """ASGI middleware of Ray Serve's proxy: a ``POST .../images/generations`` JSON body is read here and its shape
    (``ray_router.shape_key``) sent on as Ray's ``serve_multiplexed_model_id`` header; the body is then handed on
    unchanged. A request that names a model id itself, or whose body is no JSON or past ``MOST_READ``, passes as
    it came."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if not _shaped(scope):
            await self.app(scope, receive, send)
            return
        read: list[dict] = []
        size, more = 0, True
        while more and size <= MOST_READ:
            message = await receive()
            read.append(message)
            size += len(message.get("body", b""))
            more = message["type"] == "http.request" and message.get("more_body", False)
        key = None if more else _key(b"".join(m.get("body", b"") for m in read))
        if key is not None:
            scope = {**scope, "headers": [*scope["headers"], (SHAPE_HEADER, key.encode())]}

        async def again() -> dict:
            return read.pop(0) if read else await receive()

        await self.app(scope, again, send)


def _shaped(scope) -> bool:
    """Whether a request is a generation whose shape this proxy should name."""
    if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].endswith(SHAPED_PATH):
        return False
    headers = Headers(scope=scope)
    named = any(key.lower().replace("-", "_") == SHAPE_HEADER.decode() for key in headers)
    return not named and headers.get("content-type", "").startswith("application/json")


def _key(body: bytes) -> str | None:
    try:
        return shape_key(json.loads(body))
    except ValueError:  # not JSON (UnicodeDecodeError is one too): the app answers it
        return None


class RayErrorsAsJson:
    """ASGI middleware of Ray Serve's proxy: a plain-text error answer of Ray's own is sent as JSON in OpenAI's
    shape (``_ANSWERS``), its ``X-Request-Id`` kept."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held: list[dict] = []
        started = False

        async def answer(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            if message["type"] == "http.response.start" and _rays(message):
                held.append(message)
            elif held and message["type"] == "http.response.body":
                if not message.get("more_body", False):  # Ray's text is one message
                    await _as_json(send, held[0], message.get("body", b""))
            else:
                await send(message)

        try:
            await self.app(scope, receive, answer)
        except Exception as error:  # noqa: BLE001 - answered below, as Ray's 500 would be
            if started:
                raise
            await _as_json(send, {"status": 500, "headers": []}, repr(error).encode())
            return
        if not started:  # Ray's 500 (a replica lost under the request) sends nothing: the server's plain 500 would
            await _as_json(send, {"status": 500, "headers": []}, b"the replica failed without an answer")


def _rays(start: dict) -> bool:
    """Whether an answer is one of Ray's own errors: plain text, a status Ray answers with."""
    headers = MutableHeaders(scope={"type": "http", "headers": list(start.get("headers", []))})
    return start["status"] in _ANSWERS and headers.get("content-type", "").startswith("text/plain")


async def _as_json(send, start: dict, text: bytes) -> None:
    status, code, meaning, kind = _ANSWERS[start["status"]]
    said = text.decode("utf-8", "replace")[:300]
    body = json.dumps({"error": {"message": f"{meaning} (Ray: {said})", "type": kind, "param": None,
                                 "code": code}}).encode()
    old = MutableHeaders(scope={"type": "http", "headers": list(start.get("headers", []))})
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(b"x-request-id", old["x-request-id"].encode())] if "x-request-id" in old else []
    if status in (503, 429):
        headers.append((b"retry-after", old.get("retry-after", str(RETRY_AFTER_S)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
