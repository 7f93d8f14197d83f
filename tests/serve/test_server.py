"""serve/server.py: the app under uvicorn. ``Background`` serves it on a thread on a free loopback port and, on
exit, drains the worker and stops listening; an exit signal drains before uvicorn stops; ``pipemap serve`` finishes
the request running when SIGTERM comes and refuses new ones."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import pipemap

httpx = pytest.importorskip("httpx", reason="the serve tests need httpx: pip install -e '.[test]'")
uvicorn = pytest.importorskip("uvicorn", reason="pipemap serve needs uvicorn: pip install -e '.[serve]'")
import pipemap.serve.server as server_module  # noqa: E402
from pipemap.serve import Background, DrainingError, GenerationRequest, Service, create_app, run  # noqa: E402
from pipemap.serve.connections import ConnectionLimits, GuardedH11  # noqa: E402
from serving import ask, in_background, pngs, wait_until  # noqa: E402


@pytest.fixture
def own(service):
    """A service of its own on the module's pipeline: draining it leaves the others serving."""
    return Service(service.pipe, service.plan, service.running_plan, timeout=30.0)


def test_background_serves_on_a_free_loopback_port_then_drains_and_stops_listening(own):
    with Background(own) as url:
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url)
        assert httpx.get(f"{url}/health", timeout=30).json() == {"status": "ok", "queue_depth": 0, "running": 0}
        answer = httpx.post(f"{url}/v1/images/generations", json={"prompt": "a cat", "size": "32x32",
                                                                   "num_inference_steps": 1}, timeout=60)
        assert len(pngs(answer)) == 1  # the app's lifespan started the worker
    assert own.worker.draining
    with pytest.raises(DrainingError):
        own.submit(GenerationRequest(prompt="a cat"))
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=5)


def test_two_backgrounds_get_two_ports(service, own):
    other = Service(service.pipe, service.plan, service.running_plan)
    with Background(own) as first, Background(other) as second:
        assert first != second
        assert httpx.get(f"{second}/health", timeout=30).status_code == 200


def test_an_exit_signal_drains_the_worker_before_uvicorn_stops(own):
    server = server_module._DrainingServer(uvicorn.Config(create_app(own)), own)
    assert not own.worker.draining and not server.should_exit
    server.handle_exit(signal.SIGTERM, None)
    assert own.worker.draining and server.should_exit and not server.force_exit
    assert own.health()["status"] == "draining"


def test_a_second_exit_signal_drops_the_work_and_exits_at_once(own):
    from pipemap.serve.worker import Job

    server = server_module._DrainingServer(uvicorn.Config(create_app(own)), own)
    waiting = Job({"prompt": "a"}, 1, 1, deadline=float("inf"))
    own.worker.submit(waiting)  # its worker never started: it waits
    server.handle_exit(signal.SIGTERM, None)
    assert not server.force_exit and waiting.wanted()  # the first drains: the work taken may finish
    server.handle_exit(signal.SIGTERM, None)
    assert server.force_exit and not waiting.wanted() and own.worker.depth == 0  # the second drops it all


def test_run_serves_the_app_on_the_address_given_with_a_grace_period_past_the_timeout(own, monkeypatch):
    started = []
    monkeypatch.setattr(server_module._DrainingServer, "run", lambda self: started.append(self))
    run(own, host="0.0.0.0", port=8123, log_level="warning")
    (server,) = started
    assert (server.config.host, server.config.port) == ("0.0.0.0", 8123)
    assert server.config.timeout_graceful_shutdown == own.timeout + 5  # a request running may finish
    # requests in the app at once: the queue (16) and the requests in flight (1), twice over, and 16; uvicorn's own
    # limit, which counts idle connections and answers probes 503 in plain text, is off: connections.GuardedH11
    assert server_module.max_inside(own) == 2 * (16 + 1) + 16 and server.config.limit_concurrency is None
    assert server.config.timeout_keep_alive == 5 and server.config.h11_max_incomplete_event_size == 64 * 1024
    assert issubclass(server.config.http, GuardedH11) and server.config.http.limits == ConnectionLimits()
    assert server.config.app.state.service is own and server.service is own


def test_while_loading_the_server_is_alive_not_ready_and_generations_get_503_json_with_retry_after(service):
    import threading

    from pipemap.serve import Options
    from pipemap.serve.service import Loading

    release, loaded = threading.Event(), []

    def load() -> Service:  # a load that takes until the test releases it
        assert release.wait(60)
        return Service(service.pipe, service.plan, service.running_plan, timeout=30.0)

    loading = Loading(Options("tiny", timeout=30.0), load=load, on_ready=loaded.append)
    with Background(loading) as url, httpx.Client(base_url=url, timeout=60) as session:
        assert session.get("/health/live").status_code == 200
        ready = session.get("/health/ready")
        assert ready.status_code == 503 and ready.json()["ready"] is False and ready.json()["reason"] == "loading"
        assert session.get("/health").status_code == 503
        for refused in (ask(session, prompt="a cat"), session.get("/v1/models")):
            assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
            assert refused.json()["error"]["code"] == "loading"
        release.set()
        wait_until(lambda: session.get("/health/ready").status_code == 200)
        assert loaded == [loading.service] and pngs(ask(session, prompt="a cat", seed=1))
    assert loading.service is not None and loading.service.worker.draining


def test_a_load_that_fails_stops_the_server_with_its_error(monkeypatch):
    from pipemap.serve import Options
    from pipemap.serve.service import Loading

    def load() -> Service:
        raise pipemap.NotAPipelineError("nowhere", "it is not a folder")

    loading = Loading(Options("nowhere"), load=load)
    started = []
    monkeypatch.setattr(server_module._DrainingServer, "run", lambda self: started.append(self))
    run(loading, port=0, log_level="warning")
    (server,) = started
    assert server_module.max_inside(loading) == 2 * (16 + 8) + 16  # the most workers a plan may get: none made yet
    loading.start()
    loading._thread.join(10)
    assert isinstance(loading.failed, pipemap.NotAPipelineError) and server.should_exit
    assert "failed to load: NotAPipelineError" in loading.reason()


def test_past_the_apps_limit_requests_get_503_json_and_probes_still_answer(service):
    # the app takes 2 * (1 waiting + 1 running) + 16 requests at once; each of these holds one by sending its head
    # and never its body (within the body timeout); the next gets JSON
    own = Service(service.pipe, service.plan, service.running_plan, timeout=30.0, max_queue=1, workers=1)
    with Background(own) as url, httpx.Client(base_url=url, timeout=60) as session:
        port = int(url.rsplit(":", 1)[1])
        held = []
        for _ in range(server_module.max_inside(own)):
            raw = socket.create_connection(("127.0.0.1", port), timeout=30)
            raw.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                        b"application/json\r\nContent-Length: 100\r\n\r\n{")
            held.append(raw)
        try:
            wait_until(lambda: ask(session, prompt="a cat").status_code == 503)
            refused = ask(session, prompt="a cat")
            assert refused.json()["error"]["code"] == "too_many_requests" and refused.headers["retry-after"] == "5"
            assert session.get("/health/ready").status_code == 200 and session.get("/metrics").status_code == 200
        finally:
            for raw in held:
                raw.close()
        wait_until(lambda: ask(session, prompt="a cat", seed=1).status_code == 200)


# ---- the command line: serve, then SIGTERM while a request runs -------------------------------------------------


@pytest.mark.slow
def test_pipemap_serve_finishes_running_work_on_sigterm_and_refuses_new(tiny_folders, tmp_path):
    with _serving(tiny_folders["sd"], tmp_path) as (server, port), \
            httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as session:
        wait_until(lambda: _up(session) or server.poll() is not None, 240)
        assert server.poll() is None, (tmp_path / "serve.log").read_text()
        running = in_background(ask, session, prompt="a slow cat", seed=3, num_inference_steps=30)
        wait_until(lambda: session.get("/health").json()["running"] == 1)
        server.send_signal(signal.SIGTERM)
        assert pngs(running())  # the request running when the signal came is answered
        assert server.wait(60) in (0, -signal.SIGTERM)
        with pytest.raises(httpx.ConnectError):
            session.get("/health")


@contextlib.contextmanager
def _serving(folder: str, tmp_path):
    """``pipemap serve folder`` as a process of its own on a free port of 127.0.0.1 (its log in tmp_path), killed at
    the end; yields the process and the port."""
    with socket.socket() as probe:  # a port free now; the server binds it a few seconds later
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with open(tmp_path / "serve.log", "w") as log:  # the child writes it until it exits
        server = subprocess.Popen([sys.executable, "-m", "pipemap", "serve", folder, "--port", str(port)], env=env,
                                  stdout=log, stderr=subprocess.STDOUT)
        try:
            yield server, port
        finally:
            server.kill()
            server.wait()


def _up(session) -> bool:
    try:
        return session.get("/health").status_code == 200
    except httpx.TransportError:
        return False


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.slow  # a server process of its own, 10 s or more to start on 2 cores
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the server's CPU time in /proc")
def test_a_client_leaving_a_big_new_shapes_dry_run_leaves_the_server_idle_and_sigterm_exits_soon(tiny_folders,
                                                                                               tmp_path):
    with _serving(tiny_folders["sd"], tmp_path) as (server, port), \
            httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as session:
        wait_until(lambda: _up(session) or server.poll() is not None, 240)
        assert server.poll() is None, (tmp_path / "serve.log").read_text()
        body = b'{"prompt": "a cat", "size": "1000x1000"}'  # a new shape: its dry run takes many seconds
        with socket.create_connection(("127.0.0.1", port)) as leaving:
            leaving.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                            b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            start = _cpu_seconds(server.pid)
            wait_until(lambda: _cpu_seconds(server.pid) - start > 0.5, 30)  # its dry run is under way
        threading.Event().wait(2)  # the client left: within 2 s its dry run has stopped
        before = _cpu_seconds(server.pid)
        threading.Event().wait(1)
        assert _cpu_seconds(server.pid) - before < 0.3  # idle
        answered = time.monotonic()
        assert session.get("/health/live").status_code == 200 and time.monotonic() - answered < 1
        server.send_signal(signal.SIGTERM)
        stopping = time.monotonic()
        server.wait(10)
        assert time.monotonic() - stopping < 5
