"""``pipemap serve``: an HTTP image service on a mapped pipeline (``pip install -e '.[serve]'`` in the checkout).

``POST /v1/images/generations`` (OpenAI's images format), ``GET /health``, ``GET /v1/plan``, ``GET /metrics``.
The app only validates, queues and encodes; a worker thread runs the queued calls on the pipeline. The same app
runs as a Ray Serve deployment (``pipemap.serve.deployment``, ``pip install -e '.[ray]'``).

>>> from pipemap.serve import Options, Service, create_app                                  # doctest: +SKIP
>>> service = Service.load(Options("path/to/sdxl", hardware="2x24GiB,cpu=64GiB"))            # doctest: +SKIP
>>> pipemap.serve.run(service, host="127.0.0.1", port=8000)                                  # doctest: +SKIP
"""

from __future__ import annotations

try:
    import starlette  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as missing:  # pragma: no cover - depends on the install
    raise ImportError(f"pipemap serve needs {missing.name}: pip install -e '.[serve]' in pipemap's "
                      "checkout") from missing

from ..errors import DrainingError, QueueFullError, RequestError, WorkDropped
from .app import ROUTES, create_app
from .connections import ConnectionLimits
from .requests import GenerationRequest, Limits
from .server import Background, run
from .service import Options, Service, resolve_folder
from .worker import run_sequential

__all__ = ["ROUTES", "Background", "ConnectionLimits", "DrainingError", "GenerationRequest", "Limits", "Options",
           "QueueFullError", "RequestError", "Service", "WorkDropped", "create_app", "resolve_folder", "run",
           "run_sequential"]
