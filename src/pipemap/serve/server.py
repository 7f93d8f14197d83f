"""Running the app under uvicorn: in the foreground (``pipemap serve``), or on a thread (tests, benchmarks).

On SIGTERM or Ctrl-C the service drains first (new requests get 503, on connections still open), then uvicorn
stops listening, waits for the requests in flight to be answered, and the worker finishes what it took.
"""

from __future__ import annotations

import socket
import threading

import uvicorn

from .app import create_app
from .service import MOST_WORKERS, Loading, Service


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service: Service | Loading):
        super().__init__(config)
        self.service = service

    def handle_exit(self, sig, frame) -> None:
        self.service.drain()
        super().handle_exit(sig, frame)


PROBES = 16  # of uvicorn's connections, those kept for probes and scrapes: the app's own limit is that much lower


def limits(service: Service | Loading) -> dict:
    """uvicorn's own limits for ``service``: connections at once (the queue, the work running, and as many again
    for probes, scrapes and clients being refused; past them uvicorn answers 503 at once, holding no file
    descriptor for long), seconds an idle keep-alive connection is held, the bytes of an incomplete request head,
    and the grace a shutdown gives the requests in flight (the worker drops what is left after it)."""
    if isinstance(service, Loading):  # the worker count follows from the plan, not made yet: the most it can be
        queue, workers = service.options.max_queue, service.options.workers or MOST_WORKERS
    else:
        queue, workers = service.worker.max_queue, service.workers
    return {"limit_concurrency": 2 * (queue + workers) + PROBES + 16, "timeout_keep_alive": 5,
            "h11_max_incomplete_event_size": 64 * 1024, "timeout_graceful_shutdown": service.timeout + 5}


def max_inside(service: Service | Loading) -> int:
    """Requests in the app at once (``access.Busy``, which answers JSON past it): uvicorn's limit less ``PROBES``."""
    return limits(service)["limit_concurrency"] - PROBES


def run(service: Service | Loading, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve ``service`` on ``host:port`` until SIGTERM or Ctrl-C; a ``Loading`` one that fails to load stops the
    server (its error in ``service.failed``)."""
    # uvicorn annotates timeout_graceful_shutdown int, but takes any number of seconds (asyncio.timeout)
    config = uvicorn.Config(create_app(service, max_inside(service)), host=host, port=port, log_level=log_level,
                            **limits(service))
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

    def __init__(self, service: Service | Loading, host: str = "127.0.0.1"):
        self.service = service
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.bind((host, 0))  # the port is ours from here on: no race with other processes for it
        self.url = f"http://{host}:{self.socket.getsockname()[1]}"
        config = uvicorn.Config(create_app(service, max_inside(service)), log_level="warning", **{**limits(service),
                                                                             "timeout_graceful_shutdown": 5})
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
