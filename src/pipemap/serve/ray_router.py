"""Ray Serve's request router for ``pipemap serve --ray``: a request goes to a replica that has measured its shape.

A replica dry-runs each new request shape once, to know the activations it needs (``Service._check_room``); Ray's
own router spreads requests at random, so on a cluster every replica would dry-run every shape. Here:

- a request carries its shape (``shape_key``: what of it sets the activations) as Ray Serve's multiplexed model
  id, which Ray's proxy reads from the ``serve_multiplexed_model_id`` header; ``ray_proxy.ShapeHeader``, loaded
  into the proxy, sets that header from the request's JSON (a client that sets it itself keeps its own);
- a replica reports the shapes it has answered (``serve.multiplexed``, ``deployment.PipemapReplica.measured``):
  Ray pushes them to every router, as it does a multiplexed model's replicas;
- ``ShapeRouter`` sends a shaped request to a replica that has measured the shape and has a worker free (fewer
  ongoing requests than it runs at once, ``busy_at``); else to another with a worker free (it measures the shape
  too: a dry run rather than a wait); else, as Ray's power-of-two-choices router does, to the less busy of two
  replicas picked at random. A shape nobody has measured goes to a free replica; the one that answers it is then
  preferred. Ray's own multiplexing would send every request of a shape to its one replica as long as
  that replica takes more (its ``max_ongoing_requests``, past the app's queue): a replica's queue filling while
  others idle.

Requests with no shape (probes, ``/metrics``, an edit's upload) are routed as Ray routes them.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica

from ..runtime.admission import TEXT_BUCKET

ROUTER = "pipemap.serve.ray_router:ShapeRouter"
SHAPES = 64  # shapes a replica reports at most (the least recently used go first): as many as it scales from

# request fields that set a call's activations, as ``admission.call_shape`` keys the call made from them
_SIZED = ("model", "size", "n", "num_frames")
_TEXTS = ("prompt", "negative_prompt")


def shape_key(body: Any) -> str | None:
    """What of a ``POST /v1/images/generations`` JSON body sets its activations, as a short text: the model, size,
    images and frames, steps up to 2, guidance above 1 or not, prompts' lengths by ``TEXT_BUCKET`` characters;
    not the seed or the prompt's words. None for a body that is no JSON object (the app refuses it).

    >>> shape_key({"prompt": "a cat", "size": "512x512", "seed": 3})
    'size=512x512,prompt=0'
    """
    if not isinstance(body, Mapping):
        return None
    parts = [f"{name}={body[name]}" for name in _SIZED if body.get(name) is not None]
    steps, guidance = body.get("num_inference_steps"), body.get("guidance_scale")
    if isinstance(steps, int):
        parts.append(f"steps={min(steps, 2)}")
    if isinstance(guidance, (int, float)):
        parts.append(f"guided={guidance > 1}")
    parts += [f"{name}={len(body[name]) // TEXT_BUCKET}" for name in _TEXTS if isinstance(body.get(name), str)]
    return ",".join(parts) or None


def ranks(replicas: Sequence[Any], shape: str, ongoing: Callable[[Any], int | None], busy_at: int) -> list[list]:
    """``replicas`` in the order a request of ``shape`` tries them: those that have measured it (their
    ``multiplexed_model_ids``) with a worker free (fewer than ``busy_at`` requests: ``ongoing``, a replica's count as
    Ray last heard it, unknown counting as none), then two others with a worker free, then two of all (Ray's
    router takes the least busy of each rank that has room, and waits past the last). Empty ranks are left out."""
    free = [r for r in replicas if (ongoing(r) or 0) < busy_at]
    measured = [r for r in free if shape in r.multiplexed_model_ids]
    others = [r for r in free if shape not in r.multiplexed_model_ids]
    tried = (measured, random.sample(others, min(2, len(others))), random.sample(list(replicas), min(2, len(replicas))))
    return [list(rank) for rank in tried if rank]


class ShapeRouter(PowerOfTwoChoicesRequestRouter):
    """Ray Serve's router with a request's shape first (see the module's docstring); deployed by
    ``request_router_config`` with ``busy_at`` (a replica's workers) in its ``request_router_kwargs``."""

    busy_at = 1

    def initialize_state(self, busy_at: int = 1, **kwargs) -> None:
        super().initialize_state(**kwargs)
        self.busy_at = max(1, int(busy_at))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        shape = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if not shape or pending_request is None:
            return await super().choose_replicas(candidate_replicas, pending_request)
        pending_request.routing_context.should_backoff = True  # past every rank, Ray waits before it asks again
        return ranks(candidate_replicas, shape, self._ongoing, self.busy_at)

    def _ongoing(self, replica: RunningReplica) -> int | None:
        return self.replica_queue_len_cache.get(replica.replica_id)
