"""serve/connections.py over raw sockets on 127.0.0.1: idle, slow and oversized clients are bounded at the connection
(head and body timeouts, a cap on open connections that closes idle ones for new ones, a head-size limit under h11,
a lingering close after an early 413), each refusal JSON with an X-Request-Id, and the server answers at once after
each. The limits are set low here (1 s, 20 connections) so the tests are short."""

from __future__ import annotations

import json
import resource
import socket
import time

import pytest

httpx = pytest.importorskip("httpx", reason="the serve tests need httpx: pip install -e '.[test]'")
pytest.importorskip("uvicorn", reason="pipemap serve needs uvicorn: pip install -e '.[serve]'")
from pipemap.serve import Background, Service  # noqa: E402
from pipemap.serve.connections import RESERVED_FILES, ConnectionLimits  # noqa: E402
from serving import GENERATIONS, pngs  # noqa: E402

LIMITS = ConnectionLimits(head_timeout=1.0, body_timeout=1.0, keep_alive=1.0, max_connections=20)
POST = (b"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n")


@pytest.fixture(scope="module")
def edge(service):
    own = Service(service.pipe, service.plan, service.running_plan, timeout=60.0)
    with Background(own, connections=LIMITS) as url:
        yield url, int(url.rsplit(":", 1)[1])


def _exchange(port: int, data: bytes, seconds: float = 10) -> tuple[bytes, float]:
    """What the server answers to ``data`` until it closes, and how long that took."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=seconds) as client:
        client.sendall(data)
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
    return answer, time.monotonic() - start


def _error(answer: bytes, status: int) -> dict:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), answer[:200]
    assert b"x-request-id: " in head.lower() and b"content-type: application/json" in head.lower()
    return json.loads(body)["error"]


def _answers_at_once(url: str) -> None:
    start = time.monotonic()
    assert httpx.get(f"{url}/health/live", timeout=5).status_code == 200
    answer = httpx.post(f"{url}{GENERATIONS}", json={"prompt": "a cat", "num_inference_steps": 1}, timeout=30)
    assert len(pngs(answer)) == 1 and time.monotonic() - start < 10


def test_idle_connections_past_the_cap_make_room_for_new_ones(edge):
    url, port = edge
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(3 * LIMITS.max_connections)]
    try:
        _answers_at_once(url)  # the oldest idle ones were closed for these
    finally:
        for connection in idle:
            connection.close()


def test_a_connection_that_sends_nothing_is_closed_after_the_head_timeout(edge):
    answer, took = _exchange(edge[1], b"")
    assert answer == b"" and 0.9 < took < 3


@pytest.mark.parametrize("data, status, code", [
    (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: aaa", 408, "head_timeout"),  # its head never ends
    (POST + b"Content-Length: 100\r\n\r\n{", 408, "body_timeout"),  # shorter than its Content-Length
    (POST + b"Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n", 408, "body_timeout"),  # chunks never terminated
    (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (100 << 10) + b"\r\n\r\n", 431,
     "headers_too_large"),
])
def test_slow_and_oversized_heads_and_bodies_get_json_and_a_close(edge, data, status, code):
    url, port = edge
    answer, took = _exchange(port, data)
    assert _error(answer, status)["code"] == code and took < 3
    assert (b"x-should-retry: false" in answer) == (status == 431)  # a slow client may do better next time
    _answers_at_once(url)


def test_a_body_over_the_limit_is_answered_413_and_the_rest_drained(edge):
    body = b'{"prompt": "' + b"a" * (11 << 20) + b'"}'  # 11 MiB, past the 1 MiB limit
    answer, _ = _exchange(edge[1], POST + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    assert _error(answer, 413)["code"] == "body_too_large"  # read whole, not a reset while still sending


def test_the_cap_stays_below_the_file_limit():
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert ConnectionLimits().most_connections() <= min(1024, max(8, soft - RESERVED_FILES))
    assert ConnectionLimits(max_connections=10).most_connections() == min(10, max(8, soft - RESERVED_FILES))
