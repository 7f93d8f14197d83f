"""Who may call the server, and what it reads: the checks every request passes before a route sees it.

- ``X-Request-Id``: the client's (when it is a short token) or a new one, on every answer.
- A server bound to a loopback address answers only requests whose ``Host`` (and ``Origin``, when a browser sends
  one) name a local host: a web page cannot reach it by DNS rebinding, nor post to it from another site.
- With an API key, ``/v1/`` routes want ``Authorization: Bearer <key>`` (401 otherwise, in OpenAI's shape); health,
  metrics and the home page stay open, as probes and scrapers call them without one.
- A POST body is JSON (415 otherwise: a form or ``text/plain`` post, which a browser sends cross-site without
  asking, is refused) and at most ``max_body`` bytes (413).

Every refusal is JSON in OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
import uuid
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:/+=-]{1,128}$")
_LENGTH = re.compile(r"^[0-9]{1,19}$")


# answers the same request would get again: OpenAI's client (and Stainless-made ones) retry 408, 409, 429 and 5xx by
# default, twice, unless the answer says ``x-should-retry: false`` (a 504 here is past the request's own timeout)
NO_RETRY = frozenset({400, 401, 403, 404, 405, 413, 415, 422, 431, 504})


def retry_headers(status: int) -> dict[str, str]:
    """``{"x-should-retry": "false"}`` for an answer a retry cannot change (``NO_RETRY``), else nothing."""
    return {"x-should-retry": "false"} if status in NO_RETRY else {}


def error(status: int, message: str, kind: str, param: str | None = None, code: str | None = None,
          headers: dict | None = None) -> JSONResponse:
    """An error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers={**retry_headers(status), **(headers or {})})


def is_local(host: str) -> bool:
    """Whether a bind address or host name is this machine only (loopback)."""
    name = host.strip("[]").lower()
    if name in LOCAL_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Access:
    """``api_key``: what ``/v1/`` routes want as a bearer token (None: no key); ``local``: check ``Host`` and
    ``Origin`` against local names (the server is bound to loopback); ``max_body``: bytes a POST body may have."""

    api_key: str | None = None
    local: bool = True
    max_body: int = 1 << 20  # 1 MiB: a 4000-character prompt is 16 KiB of JSON at most

    def refusal(self, method: str, path: str, headers: Headers) -> JSONResponse | None:
        """The answer for a request these rules refuse, or None when it may go on to its route."""
        if self.local:
            refused = _foreign(headers)
            if refused is not None:
                return refused
        if self.api_key is not None and path.startswith("/v1/") and not self._authorized(headers):
            return error(401, "a valid API key is needed: send the header 'Authorization: Bearer <key>' with the "
                         "key the server was started with (--api-key or PIPEMAP_API_KEY)", "invalid_request_error",
                         code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if method == "POST":
            return self._body_refusal(headers)
        return None

    def _authorized(self, headers: Headers) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        key = (self.api_key or "").encode()
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key)

    def _body_refusal(self, headers: Headers) -> JSONResponse | None:
        media = headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json":
            return error(415, f"the body must be JSON with 'Content-Type: application/json', not {media or 'none'!r}",
                         "invalid_request_error", code="unsupported_media_type")
        length = headers.get("content-length", "")
        # ASCII digits, at most 19 (``str.isdigit`` takes "²", which ``int`` refuses); the server's parser checks the
        # rest, and a body longer than its Content-Length is cut at the limit as it is read (``app._body``)
        if _LENGTH.match(length) and int(length) > self.max_body:
            return too_large(self.max_body)
        return None


def too_large(limit: int) -> JSONResponse:
    return error(413, f"the body is over this server's limit of {limit} bytes: send a shorter prompt",
                 "invalid_request_error", code="body_too_large")


def _foreign(headers: Headers) -> JSONResponse | None:
    host = urlsplit(f"//{headers.get('host', '')}").hostname or ""
    if not is_local(host):
        return error(403, f"the Host {host!r} is not this machine: a server bound to loopback answers only "
                     "localhost, 127.0.0.1 and [::1] (bind to another --host to serve other names)",
                     "invalid_request_error", code="forbidden_host")
    origin = headers.get("origin")
    if origin is not None and not is_local(urlsplit(origin).hostname or ""):
        return error(403, f"requests from the web origin {origin!r} are refused: a server bound to loopback "
                     "answers only pages served from this machine", "invalid_request_error", code="forbidden_origin")
    return None


def request_id(headers: Headers) -> str:
    """The client's ``X-Request-Id`` when it is a short token, else a new one."""
    given = headers.get("x-request-id", "")
    return given if _REQUEST_ID.match(given) else uuid.uuid4().hex


class Guard:
    """ASGI middleware: ``Access``'s checks on each HTTP request, and its ``X-Request-Id`` on every answer.
    ``refused(path, status)`` hears of each request turned away (the app's counters)."""

    def __init__(self, app, access: Access, refused=None):
        self.app, self.access = app, access
        self.refused = refused or (lambda path, status: None)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        rid = request_id(headers)
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                   (b"x-request-id", rid.encode("latin-1"))]}
            await send(message)

        refusal = self.access.refusal(scope["method"], scope["path"], headers)
        if refusal is not None:
            self.refused(scope["path"], refusal.status_code)
            await refusal(scope, receive, send_with_id)
            return
        await self.app(scope, receive, send_with_id)


class Busy:
    """ASGI middleware: at most ``limit`` HTTP requests in the app at once; past it, 503 in OpenAI's shape with a
    Retry-After. uvicorn's own ``limit_concurrency``, which answers in plain text and counts idle connections, is off
    (``server.limits``); connections are bounded below the app (``connections.GuardedH11``). Probes and scrapes
    (``/health*``, ``/metrics``) are never refused here."""

    def __init__(self, app, limit: int):
        self.app, self.limit, self.inside = app, limit, 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"].startswith(("/health", "/metrics")):
            await self.app(scope, receive, send)
            return
        if self.inside >= self.limit:  # one event loop: no lock needed between the check and the count
            refusal = error(503, f"the server holds {self.inside} requests, its most at once: retry in a few "
                            "seconds", "server_busy", code="too_many_requests", headers={"Retry-After": "5"})
            await refusal(scope, receive, send)
            return
        self.inside += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.inside -= 1
