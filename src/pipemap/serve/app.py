"""The HTTP app (Starlette): it validates, queues and encodes; the pipeline work is the service's worker's.

Every route is one entry of ``ROUTES``: ``(method, path, handler)``, each handler ``async (service, request)
-> Response``. A new page is one more entry.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import threading
import time

import numpy as np
from PIL import Image
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from ..errors import (
    BodyTooLarge,
    ClientGone,
    DrainingError,
    ModelNotFoundError,
    QueueFullError,
    RequestError,
    WorkDropped,
)
from .access import Busy, Guard, error, too_large
from .metrics import CONTENT_TYPE
from .requests import parse
from .service import Loading, Service


async def generations(service: Service, request: Request) -> Response:
    """``POST /v1/images/generations``: one request's images as base64 PNGs; its status counted."""
    response = await _generate(service, request)
    service.metrics.answered(response.status_code)
    return response


async def _generate(service: Service, request: Request) -> Response:
    if service.broken is not None:
        return error(503, f"the device failed and the server takes no more work until it restarts: "
                     f"{service.broken}", "server_error", code="device_error")
    try:
        body = await _body(request, service.access.max_body)
    except BodyTooLarge:
        return too_large(service.access.max_body)
    except ClientDisconnect:  # it left, or its body timed out (``connections``): nobody reads an answer
        return error(499, "the client closed the connection before its body was read", "client_closed",
                     code="client_closed")
    gone = asyncio.ensure_future(_disconnect(request))  # the client's leaving, watched from here to the answer
    try:
        return await _answer(service, request, body, gone)
    finally:
        gone.cancel()


async def _answer(service: Service, request: Request, body: bytes, gone: asyncio.Future) -> Response:
    job, timeout = None, service.timeout
    try:
        asked = parse(body)
        timeout = service.timeout_of(asked)
        generation, job = await _submitted(service, asked, gone, timeout)
        output = await _outcome(service, job, gone)
    except Exception as err:  # noqa: BLE001 - each failure its answer; the server goes on
        refusal = _refusal(err, timeout)
        if refusal is not None:
            return refusal
        if job is None:  # not the pipeline's: the server's own failure, a 500 with the request's id
            raise
        return _failed(service, err)  # the pipeline failed on this request
    data = await run_in_threadpool(lambda: _data(output))
    answer = {"created": int(time.time()), "seed": generation.seed, "data": data}
    headers = {"Warning": ", ".join(f'299 pipemap "{w}"' for w in generation.warnings)} if generation.warnings else {}
    return JSONResponse(answer, headers=headers)


def _refusal(err: Exception, timeout: float) -> Response | None:
    """The answer to a request refused or dropped (``err``), or None for a failure."""
    if isinstance(err, ModelNotFoundError):
        return error(404, err.message, "invalid_request_error", err.param, err.code)
    if isinstance(err, RequestError):
        return error(400, err.message, "invalid_request_error", err.param, err.code)
    if isinstance(err, QueueFullError):
        return error(429, str(err), "server_busy", code="queue_full", headers={"Retry-After": str(err.retry_after)})
    if isinstance(err, DrainingError):
        return error(503, str(err), "server_shutting_down", code="draining", headers={"Retry-After": "1"})
    if isinstance(err, ClientGone):
        return error(499, "the client closed the connection; its work was dropped", "client_closed",
                     code="client_closed")
    if isinstance(err, (TimeoutError, asyncio.TimeoutError, WorkDropped)):
        return error(504, f"the request took more than its timeout of {timeout:g} s; its work was dropped: ask "
                     "for fewer steps or images, or retry later", "timeout", code="timeout")
    return None


async def _submitted(service: Service, asked, gone: asyncio.Future, timeout: float):
    """The request checked and queued, off the event loop (a new call shape is measured by a dry run first), as the
    request's own work: when its client leaves or its time runs out first, its dry run stops at its next operation
    (``admission.still_wanted``) and nothing is queued; ``ClientGone`` or a timeout raised at once."""
    dropped, deadline = threading.Event(), time.monotonic() + timeout
    work = asyncio.ensure_future(run_in_threadpool(service.submit, asked, dropped, deadline))
    try:
        await asyncio.wait({work, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is stopping this handler
        dropped.set()
        raise
    if work.done():
        return work.result()
    dropped.set()  # the dry run stops; a job queued meanwhile is the same ``dropped``: never run
    work.add_done_callback(_read)
    if gone.done():
        raise ClientGone()
    raise TimeoutError()


def _read(future: asyncio.Future) -> None:
    """Reads an abandoned future's outcome (a dry run dropped), so asyncio does not log it as never retrieved."""
    future.cancelled() or future.exception()


async def _body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge()
        chunks.append(chunk)
    return b"".join(chunks)


async def _outcome(service: Service, job, gone: asyncio.Future):
    """The job's output, as soon as its own work ends; the job dropped (and ``ClientGone`` or a timeout raised) when
    its client hangs up (``gone``) or its time runs out first: a waiting job leaves the queue, a running one stops at
    its next denoising step."""
    answer = asyncio.ensure_future(asyncio.wrap_future(job.future))
    try:
        done, _ = await asyncio.wait({answer, gone}, timeout=max(0.0, job.deadline - time.monotonic()),
                                     return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is stopping this handler: nobody wants the work
        service.worker.cancel(job)
        raise
    if answer in done:
        return answer.result()
    service.worker.cancel(job)
    answer.cancel()
    if gone in done:
        raise ClientGone()
    raise TimeoutError()


async def _disconnect(request: Request) -> None:
    """Returns when the client disconnects: once the body is read, the server's next message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _failed(service: Service, err: Exception) -> Response:
    if type(err).__name__ == "OutOfMemoryError":  # torch's, after the retry a move to the host allowed
        return error(503, f"out of memory on the GPU, after moving weights to the host and retrying: {err}",
                     "server_busy", code="out_of_memory", headers={"Retry-After": "5"})
    if service.notice(err):
        return error(500, f"the device failed: {err}; the server takes no more work until it restarts",
                     "server_error", code="device_error")
    return error(500, f"the pipeline failed: {type(err).__name__}: {err}", "server_error", code="pipeline_error")


def _data(output) -> list[dict]:
    """The answer's ``data``: a PNG per image, or from a video pipeline (an output with ``frames``) one animated WebP
    per video, lossless, with its mime type, frame count and frame rate (browsers and PIL play it; OpenAI's images
    API has no video, so this follows its shape: one ``b64_json`` item per result)."""
    frames = getattr(output, "frames", None)
    if frames is None:
        return [{"b64_json": _encoded(image, format="PNG")} for image in output.images]
    return [{"b64_json": _encoded(video[0], format="WEBP", save_all=True, append_images=list(video[1:]),
                                  lossless=True, duration=round(1000 / VIDEO_FPS), loop=0),
             "mime_type": "image/webp", "frames": len(video), "fps": VIDEO_FPS} for video in map(_pictures, frames)]


VIDEO_FPS = 16  # what diffusers' Wan examples export at (`export_to_video(output, "output.mp4", fps=16)`)


def _pictures(video) -> list:
    """A video's frames as PIL images: as given (``output_type="pil"``, which the worker asks for), or from an array
    of ``frames x height x width x channels`` in [0, 1] (a pipeline that ignores it)."""
    if isinstance(video, (list, tuple)) and all(hasattr(frame, "save") for frame in video):
        return list(video)
    array = np.asarray(video, dtype=np.float32)
    return [Image.fromarray((frame.clip(0, 1) * 255).round().astype(np.uint8)) for frame in array]


def _encoded(image, **save) -> str:
    buffer = io.BytesIO()
    image.save(buffer, **save)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


async def health(service: Service, request: Request) -> Response:
    """``GET /health``: 200 while taking work, 503 while shutting down or after a sticky device error; queue depth
    and requests running."""
    state = service.health()
    return JSONResponse(state, status_code=200 if state["status"] == "ok" else 503)


async def live(service: Service, request: Request) -> Response:
    """``GET /health/live``: 200 while the process answers at all (a liveness probe restarts it otherwise)."""
    return JSONResponse({"status": "alive"})


async def ready(service: Service, request: Request) -> Response:
    """``GET /health/ready``: 200 while the service takes work; 503 with the reason while it drains or after a
    sticky device error (a readiness probe sends traffic elsewhere)."""
    reason = service.readiness()
    return JSONResponse({"ready": reason is None, "reason": reason, "queue_depth": service.worker.depth,
                         "running": service.worker.running}, status_code=200 if reason is None else 503)


async def models(service: Service, request: Request) -> Response:
    """``GET /v1/models``: the served model in OpenAI's list shape (its aliases are taken as ``model`` too)."""
    return JSONResponse({"object": "list", "data": [_model(service, service.names[0])]})


async def model(service: Service, request: Request) -> Response:
    """``GET /v1/models/{model}``: one served name, or 404 model_not_found."""
    name = request.path_params["model"]
    if name not in service.names:
        return error(404, f"the model {name!r} is not served here: GET /v1/models lists what is",
                     "invalid_request_error", "model", "model_not_found")
    return JSONResponse(_model(service, name))


def _model(service: Service, name: str) -> dict:
    return {"id": name, "object": "model", "created": service.created, "owned_by": "pipemap"}


async def plan(service: Service, request: Request) -> Response:
    """``GET /v1/plan``: the plan the pipeline was loaded onto, as JSON."""
    return JSONResponse(service.plan_json())


async def metrics(service: Service, request: Request) -> Response:
    """``GET /metrics``: Prometheus text."""
    return Response(service.metrics.text(), media_type=CONTENT_TYPE)


async def home(service: Service, request: Request) -> Response:
    """``GET /``: the plan's picture, live figures from ``/metrics`` and a prompt box (``home.home_page``)."""
    return HTMLResponse(service.home_page())


ROUTES = [
    ("GET", "/", home),
    ("POST", "/v1/images/generations", generations),
    ("GET", "/health", health),
    ("GET", "/health/live", live),
    ("GET", "/health/ready", ready),
    ("GET", "/v1/models", models),
    ("GET", "/v1/models/{model:path}", model),
    ("GET", "/v1/plan", plan),
    ("GET", "/metrics", metrics),
]


def create_app(service: Service | Loading, max_inside: int | None = None) -> Starlette:
    """The ASGI app serving ``service``: its worker starts with the app and finishes its work when the app stops. A
    ``Loading`` service starts loading with the app, which answers meanwhile (not ready: ``_not_loaded``).
    ``max_inside``: requests in the app at once, past which it answers 503 (``access.Busy``); None: no limit.

    >>> service = Service.load(Options("path/to/sdxl", hardware="2x24GiB"))                  # doctest: +SKIP
    >>> uvicorn.run(create_app(service), host="127.0.0.1", port=8000)                        # doctest: +SKIP
    """

    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.start()
        yield
        await run_in_threadpool(service.stop)

    routes = [Route(path, _bound(handler, service), methods=[method]) for method, path, handler in ROUTES]
    handlers = {HTTPException: _http_error, Exception: _server_error}
    busy = [Middleware(Busy, limit=max_inside)] if max_inside is not None else []
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers,
                    middleware=[*busy, Middleware(Guard, access=service.access, refused=_refused(service))])
    app.state.service = service
    return app


async def _http_error(request: Request, exc: Exception) -> Response:
    """404 and 405 (and any other HTTPException) as JSON in OpenAI's shape, as every other error."""
    assert isinstance(exc, HTTPException)
    kinds = {404: ("not_found", "no such route: the routes are " + ", ".join(f"{m} {p}" for m, p, _ in ROUTES)),
             405: ("method_not_allowed", f"{request.method} is not allowed on {request.url.path}")}
    code, message = kinds.get(exc.status_code, ("http_error", str(exc.detail)))
    return error(exc.status_code, message, "invalid_request_error", code=code, headers=dict(exc.headers or {}))


async def _server_error(request: Request, exc: Exception) -> Response:
    """A failure no route answered: 500 in OpenAI's shape. Starlette answers it outside every middleware, so the
    request's id (``access.Guard`` keeps it in the scope's state) is set here."""
    rid = request.scope.get("state", {}).get("request_id")
    return error(500, f"the server failed: {type(exc).__name__}: {str(exc)[:300]}", "server_error",
                 code="server_error", headers={"X-Request-Id": rid} if rid else None)


def _refused(service: Service | Loading):
    def count(path: str, status: int) -> None:  # a generation turned away before its route is still answered
        loaded = _loaded(service)
        if path == "/v1/images/generations" and loaded is not None:
            loaded.metrics.answered(status)

    return count


def _loaded(service: Service | Loading) -> Service | None:
    return service.service if isinstance(service, Loading) else service


def _bound(handler, service: Service | Loading):
    async def endpoint(request: Request) -> Response:
        loaded = _loaded(service)
        if loaded is None:
            assert isinstance(service, Loading)
            return _not_loaded(handler, service)
        return await handler(loaded, request)

    endpoint.__name__ = handler.__name__
    return endpoint


def _not_loaded(handler, loading: Loading) -> Response:
    """The answer of a route while the pipeline loads: alive, not ready; every other route 503 with a Retry-After
    (JSON in OpenAI's shape, as every error)."""
    reason = loading.reason()
    if handler is live:
        return JSONResponse({"status": "alive"})
    if handler is ready:
        return JSONResponse({"ready": False, "reason": reason, "queue_depth": 0, "running": 0}, status_code=503)
    if handler is health:
        return JSONResponse({"status": reason, "queue_depth": 0, "running": 0}, status_code=503)
    return error(503, f"the server is not ready ({reason}): retry in a few seconds; GET /health/ready says when "
                 "it is", "server_busy", code="loading", headers={"Retry-After": str(loading.RETRY_AFTER)})
