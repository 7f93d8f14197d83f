"""A request's new call shape is measured by a dry run as the request's own work: bounded by its timeout, stopped when
its client leaves (``admission.still_wanted``, between the dry run's operations), and a size refused by arithmetic
never dry-run. Over real HTTP on the module's service, whose tiny SD dry-runs a 400x400 call in seconds."""

from __future__ import annotations

import json
import socket
import time

import pytest

httpx = pytest.importorskip("httpx", reason="the serve tests need httpx: pip install -e '.[test]'")
pytest.importorskip("uvicorn", reason="pipemap serve needs uvicorn: pip install -e '.[serve]'")
from pipemap.runtime.admission import call_shape  # noqa: E402
from serving import GENERATIONS, pngs, wait_until  # noqa: E402


def _shape(service, side: int) -> tuple:
    return call_shape({"prompt": "a cat", "num_images_per_prompt": 1, "width": side, "height": side})


def _dry_runs_end(service, seconds: float = 3) -> None:
    wait_until(lambda: not service.sizes._pending, seconds)


def test_a_timeout_of_one_second_on_a_new_shape_answers_504_within_two_and_stops_its_dry_run(service, client):
    start = time.monotonic()
    response = client.post(GENERATIONS, json={"prompt": "a cat", "size": "400x400", "timeout": 1})
    assert response.status_code == 504 and time.monotonic() - start < 2, response.text
    assert response.json()["error"]["code"] == "timeout" and response.headers["x-should-retry"] == "false"
    _dry_runs_end(service)  # stopped at its next operation, not run to its end
    assert _shape(service, 400) not in service.sizes._figures and not service.sizes.unmeasured


@pytest.mark.slow  # two dry runs, 4 s on 2 cores
def test_a_client_leaving_during_its_dry_run_frees_the_server(service, client, url):
    small = {"prompt": "a cat", "num_inference_steps": 1, "seed": 2}
    assert len(pngs(client.post(GENERATIONS, json=small))) == 1  # its shape measured
    body = json.dumps({"prompt": "a cat", "size": "480x480"}).encode()
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as leaving:
        leaving.sendall(b"POST " + GENERATIONS.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                        b"application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        wait_until(lambda: _shape(service, 480) in service.sizes._pending, 10)
    _dry_runs_end(service, 2)  # the client left: its dry run stops within 2 s
    assert _shape(service, 480) not in service.sizes._figures
    start = time.monotonic()
    assert len(pngs(client.post(GENERATIONS, json=small))) == 1
    assert time.monotonic() - start < 2  # at once: nothing of the leaver's is left running


def test_a_size_too_large_by_arithmetic_is_refused_without_a_dry_run(service, client):
    # 2048x2048 decoded as 16-bit floats is 24 MiB, past the 8 MiB the plan leaves beside its weights
    response = client.post(GENERATIONS, json={"prompt": "a cat", "size": "2048x2048"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "insufficient_memory"
    assert "decoded images alone" in response.json()["error"]["message"]
    assert _shape(service, 2048) not in service.sizes._figures and not service.sizes._pending
