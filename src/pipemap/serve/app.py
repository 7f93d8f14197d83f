"""The HTTP app (Starlette): it validates, queues and encodes; the pipeline work is the service's worker's.

Every route is one entry of ``ROUTES``: ``(method, path, handler)``, each handler ``async (service, request)
-> Response``. A new page is one more entry.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import time

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from .metrics import CONTENT_TYPE
from .requests import RequestError, parse
from .service import Service
from .worker import DrainingError, QueueFullError, WorkDropped


def error(status: int, message: str, kind: str, param: str | None = None, code: str | None = None,
          headers: dict | None = None) -> JSONResponse:
    """An error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


async def generations(service: Service, request: Request) -> Response:
    """``POST /v1/images/generations``: one request's images as base64 PNGs; its status counted."""
    response = await _generate(service, request)
    service.metrics.answered(response.status_code)
    return response


async def _generate(service: Service, request: Request) -> Response:
    try:  # off the event loop: a new call shape is measured by a dry run first
        generation, job = await run_in_threadpool(service.submit, parse(await request.body()))
    except RequestError as err:
        return error(400, err.message, "invalid_request_error", err.param, err.code)
    except QueueFullError as err:
        return error(429, str(err), "server_busy", code="queue_full", headers={"Retry-After": str(err.retry_after)})
    except DrainingError as err:
        return error(503, str(err), "server_shutting_down", code="draining", headers={"Retry-After": "1"})
    try:
        output = await asyncio.wait_for(asyncio.wrap_future(job.future), max(0.0, job.deadline - time.monotonic()))
    except asyncio.CancelledError:  # the client went away: nobody wants the work
        service.worker.cancel(job)
        raise
    except (TimeoutError, asyncio.TimeoutError, WorkDropped):
        service.worker.cancel(job)
        return error(504, f"the request took more than the server's timeout of {service.timeout:g} s; its work "
                     "was dropped: ask for fewer steps or images, or retry later", "timeout", code="timeout")
    except Exception as err:  # noqa: BLE001 - the pipeline failed on this request; the server goes on
        if type(err).__name__ == "OutOfMemoryError":  # torch's, after the retry a move to the host allowed
            return error(503, f"out of memory on the GPU, after moving weights to the host and retrying: {err}",
                         "server_busy", code="out_of_memory", headers={"Retry-After": "5"})
        return error(500, f"the pipeline failed: {type(err).__name__}: {err}", "server_error", code="pipeline_error")
    images = await run_in_threadpool(lambda: [_png(image) for image in output.images])
    body = {"created": int(time.time()), "seed": generation.seed, "data": [{"b64_json": i} for i in images]}
    headers = {"Warning": ", ".join(f'299 pipemap "{w}"' for w in generation.warnings)} if generation.warnings else {}
    return JSONResponse(body, headers=headers)


def _png(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


async def health(service: Service, request: Request) -> Response:
    """``GET /health``: 200 while taking work, 503 while shutting down; queue depth and requests running."""
    state = service.health()
    return JSONResponse(state, status_code=200 if state["status"] == "ok" else 503)


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
    ("GET", "/v1/plan", plan),
    ("GET", "/metrics", metrics),
]


def create_app(service: Service) -> Starlette:
    """The ASGI app serving ``service``: its worker starts with the app and finishes its work when the app stops.

    >>> service = Service.load(Options("path/to/sdxl", hardware="2x24GiB"))                  # doctest: +SKIP
    >>> uvicorn.run(create_app(service), host="127.0.0.1", port=8000)                        # doctest: +SKIP
    """

    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.start()
        yield
        await run_in_threadpool(service.stop)

    routes = [Route(path, _bound(handler, service), methods=[method]) for method, path, handler in ROUTES]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.service = service
    return app


def _bound(handler, service: Service):
    async def endpoint(request: Request) -> Response:
        return await handler(service, request)

    endpoint.__name__ = handler.__name__
    return endpoint
