"""Running the app under uvicorn: in the foreground (``pipemap serve``), or on a thread (tests, benchmarks).

On SIGTERM or Ctrl-C the service drains first (new requests get 503, on connections still open), then uvicorn
stops listening, waits for the requests in flight to be answered, and the worker finishes what it took.
"""

from __future__ import annotations

import socket
import threading

import uvicorn

from .app import create_app
from .connections import ConnectionLimits, protocol_for
from .service import MOST_WORKERS, Loading, Service


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service: Service | Loading):
        super().__init__(config)
        self.service = service

    def handle_exit(self, sig, frame) -> None:
        """The first SIGTERM or Ctrl-C drains: new work refused, the work taken answered within the graceful
        shutdown's bound (the timeout and 5 s), then dropped. A second exits at once: every job dropped (a running
        one stops at its next step), no more waiting for connections, and the requests' handlers cancelled as the
        loop ends (their dry runs stop at their next operation)."""
        if self.should_exit:
            self.service.drop()
            self.force_exit = True
            return
        self.service.drain()
        super().handle_exit(sig, frame)


PROBES = 16  # requests kept for probes and scrapes beside those the app holds (``access.Busy``)


def limits(service: Service | Loading, connections: ConnectionLimits | None = None) -> dict:
    """uvicorn's settings for ``service``: the h11 protocol with the connection limits (``connections.GuardedH11``:
    head and body timeouts, the cap on open connections, the head's size, the lingering close), the keep-alive idle
    time, and the grace a shutdown gives the requests in flight (the worker drops what is left after it). uvicorn's
    own ``limit_concurrency`` is off: it counts idle connections, and answers every request past it, probes too, in
    plain text; the app's ``Busy`` bounds the requests inside."""
    connections = connections or ConnectionLimits()
    return {"http": protocol_for(connections), "limit_concurrency": None, "timeout_keep_alive": connections.keep_alive,
            "h11_max_incomplete_event_size": connections.max_head,
            "timeout_graceful_shutdown": service.timeout + 5}


def max_inside(service: Service | Loading) -> int:
    """Requests in the app at once (``access.Busy``, which answers JSON past it): the queue and the work running,
    twice over (clients being refused hold a place while they are), and 16 more."""
    if isinstance(service, Loading):  # the worker count follows from the plan, not made yet: the most it can be
        queue, workers = service.options.max_queue, service.options.workers or MOST_WORKERS
    else:
        queue, workers = service.worker.max_queue, service.workers
    return 2 * (queue + workers) + 16


def run(service: Service | Loading, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
        connections: ConnectionLimits | None = None) -> None:
    """Serve ``service`` on ``host:port`` until SIGTERM or Ctrl-C, each connection held to ``connections``; a
    ``Loading`` one that fails to load stops the server (its error in ``service.failed``)."""
    # uvicorn annotates timeout_graceful_shutdown int, but takes any number of seconds (asyncio.timeout)
    config = uvicorn.Config(create_app(service, max_inside(service)), host=host, port=port, log_level=log_level,
                            **limits(service, connections))
    server = _DrainingServer(config, service)
    if isinstance(service, Loading):
        told = service.on_failed

        def failed(error: BaseException) -> None:
            told(error)
            server.should_exit = True

        service.on_failed = failed
    server.run()


class Background:
    """The app served on a thread, on a free port of ``host``: ``with Background(service) as url: ...``.

    >>> with Background(service) as url:                                                      # doctest: +SKIP
    ...     httpx.post(f"{url}/v1/images/generations", json={"prompt": "a cat", "size": "32x32"})
    """

    def __init__(self, service: Service | Loading, host: str = "127.0.0.1",
                 connections: ConnectionLimits | None = None):
        self.service = service
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.bind((host, 0))  # the port is ours from here on: no race with other processes for it
        self.url = f"http://{host}:{self.socket.getsockname()[1]}"
        settings = {**limits(service, connections), "timeout_graceful_shutdown": 5}
        config = uvicorn.Config(create_app(service, max_inside(service)), log_level="warning", **settings)
        self.server = _DrainingServer(config, service)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started and self.thread.is_alive():
            threading.Event().wait(0.02)
        if not self.server.started:
            raise RuntimeError(f"the server on {self.url} did not start; its log above says why")
        return self.url

    def __exit__(self, *exc) -> None:
        self.service.drain()
        self.server.should_exit = True
        self.thread.join(30)
        self.socket.close()
