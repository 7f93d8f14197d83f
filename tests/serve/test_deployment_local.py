"""``pipemap serve --ray`` as a user runs it, with no ``RAY_ADDRESS``: a new local Ray whose every socket listens on
loopback (``--ray-public`` opens them), answering with one ``X-Request-Id``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("ray", reason="the Ray Serve tests need ray: pip install -e '.[ray]'")
httpx = pytest.importorskip("httpx", reason="the serve tests need httpx: pip install -e '.[test]'")
psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.slow


@pytest.fixture
def served(tiny_folders):
    """``pipemap serve --ray`` in a process of its own; its URL, and its process tree; stopped
    with SIGTERM, what is left of its tree then killed."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    command = [sys.executable, "-m", "pipemap", "serve", tiny_folders["sd"], "--ray", "--hardware", "cpu=4GiB",
               "--port", str(port), "--max-queue", "1", "--workers", "1"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(process.stdout or ()), daemon=True).start()
    tree = psutil.Process(process.pid)
    try:
        deadline = time.monotonic() + 240
        while not any("serving on Ray" in line for line in lines):
            assert process.poll() is None and time.monotonic() < deadline, "".join(lines[-40:])
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}", tree
    finally:
        children = tree.children(recursive=True)
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
        for child in children:
            if child.is_running():
                child.kill()


def test_a_local_ray_listens_on_loopback_only_and_answers_with_one_request_id(served):
    url, tree = served
    with httpx.Client(base_url=url, timeout=120) as client:
        response = client.post("/v1/images/generations", headers={"X-Request-Id": "one-id"},
                               json={"prompt": "a", "size": "32x32", "num_inference_steps": 1})
    assert response.status_code == 200, response.text
    assert response.headers.get_list("x-request-id") == ["one-id"]
    pids = {p.pid: p.name() for p in [tree, *tree.children(recursive=True)]}
    listening = [(c.laddr.ip, pids[c.pid]) for c in psutil.net_connections("inet")
                 if c.status == psutil.CONN_LISTEN and c.pid in pids]
    assert len(listening) > 5 and all(ip.removeprefix("::ffff:") in ("127.0.0.1", "::1") for ip, _ in listening), \
        listening
