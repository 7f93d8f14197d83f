"""``pipemap serve --ray``: the same app as a Ray Serve deployment, one replica per copy of the plan.

The plan is made once, on the driver, for the machine a replica gets (``--hardware``, or this machine); each
replica asks Ray for the whole GPUs that plan uses (``num_gpus``) and loads the pipeline onto it. Ray routes HTTP
requests to replicas, restarts a replica that dies, and with ``autoscale`` adds or removes replicas as their
ongoing requests (queue plus running) rise above or fall below the target.
"""

from __future__ import annotations

import os
import re
import signal
import threading

import ray
from ray import serve

from ..devices import normalize_device
from ..errors import AutoscaleSpecError
from ..hooks.ray_workers import ray_init_options
from ..hooks.workers import ENV, workers_mode
from ..plan import Plan
from .app import create_app
from .service import Options, Service, default_workers, make_plan


def gpus(plan: Plan) -> int:
    """The whole GPUs a replica needs: every distinct accelerator the plan places a component, a shard or a copy of
    its denoiser on."""
    used = {p.device for p in plan.components} | {p.execution_device for p in plan.components}
    used |= {device for p in plan.components for _, device, _ in p.shards}
    used |= {device for p in plan.components for device in p.replicas}
    return sum(1 for device in used if normalize_device(device) not in ("cpu", "disk"))


def worker_ranks(plan: Plan) -> int:
    """How many worker ranks a replica's split denoiser starts: one per copy of it on another device."""
    return max((len(p.replicas) for p in plan.components), default=0)


def replica_gpus(plan: Plan, here: float | None = None) -> int:
    """The GPUs a replica asks Ray for: its plan's (``gpus``); none where the Ray is this machine's own (``here``:
    the GPUs a local Ray has) and it has fewer. The replica then runs the plan's GPUs on the CPU, as ``pipemap
    serve`` without Ray does (``api.runnable``), instead of waiting for ever for GPUs no node will have. A cluster's
    (``here`` None) may add nodes with them: its replicas ask and wait."""
    need = gpus(plan)
    return 0 if here is not None and here < need else need


def actor_options(num_cpus: float, num_gpus: int) -> dict:
    """A replica's ``ray_actor_options``: its GPUs and CPUs, and how its split denoiser runs its other ranks (the
    driver's ``PIPEMAP_WORKERS``, which a replica on another node would not see)."""
    options: dict = {"num_gpus": num_gpus, "num_cpus": num_cpus}
    if ENV in os.environ:
        options["runtime_env"] = {"env_vars": {ENV: os.environ[ENV]}}
    return options


def worker_bundles(plan: Plan, num_cpus: float, num_gpus: int) -> dict:
    """With ``PIPEMAP_WORKERS=ray``, a replica whose plan splits its denoiser is deployed in a placement group of
    its own (``STRICT_PACK``: one node): bundle 0 the replica's (its CPUs and every GPU of its plan), then a CPU for
    each worker rank (``hooks/ray_workers.py``: the worker actors take those bundles and share the replica's GPUs)."""
    ranks = worker_ranks(plan)
    if workers_mode() != "ray" or not ranks:
        return {}
    own = {"CPU": float(num_cpus), **({"GPU": float(num_gpus)} if num_gpus else {})}
    return {"placement_group_bundles": [own, *[{"CPU": 1.0}] * ranks], "placement_group_strategy": "STRICT_PACK"}


def autoscaling(text: str, max_ongoing: int) -> dict:
    """Ray Serve's ``autoscaling_config`` for ``MIN:MAX``: scale so each replica has about one batch in flight
    beyond the one it runs, out of the ``max_ongoing`` it takes."""
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text or "")
    if match is None or int(match[1]) > int(match[2]) or int(match[2]) < 1:
        raise AutoscaleSpecError(text)
    return {"min_replicas": int(match[1]), "max_replicas": int(match[2]),
            "target_ongoing_requests": max(1, min(2, max_ongoing)), "upscale_delay_s": 5, "downscale_delay_s": 60}


@serve.ingress()
class PipemapReplica:
    """One replica: loads the pipeline onto the plan made on the driver and serves the pipemap app."""

    def __init__(self, options: Options, plan: dict):
        # cuda:N in the plan are this replica's GPUs: Ray sets CUDA_VISIBLE_DEVICES to those it was given
        self.service = Service.load(options, Plan.from_dict(plan))
        self.service.start()

    def __serve_build_asgi_app__(self):
        return create_app(self.service)

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose device failed for good (``Service.notice``) is restarted."""
        if self.service.broken is not None:
            raise RuntimeError(f"pipemap: the device failed: {self.service.broken}")

    def __del__(self):
        service = getattr(self, "service", None)
        if service is not None:  # Ray Serve has already waited for the replica's requests in flight
            service.worker.drain()


def application(options: Options, replicas: int = 1, autoscale: str | None = None, num_cpus: float = 1.0,
                gpus_here: float | None = None, plan: Plan | None = None):
    """The Ray Serve application for ``options``: the plan made here, each replica asking for its GPUs (none where
    ``gpus_here``, a local Ray's GPUs, are too few: ``replica_gpus``); ``plan``: the one made for ``options``.

    >>> serve.run(application(Options("path/to/sdxl", hardware="2x24GiB"), autoscale="1:4"))   # doctest: +SKIP
    """
    plan = plan or make_plan(options)
    num_gpus = replica_gpus(plan, gpus_here)
    # a request waits in Ray's router rather than being refused by a replica whose own queue is full
    max_ongoing = options.max_queue + (options.workers or default_workers(plan))
    scaling = {"autoscaling_config": autoscaling(autoscale, max_ongoing)} if autoscale else {"num_replicas": replicas}
    # the queue limit holds in Ray's router too (past it: 503 at once), and a replica going away gets as long as a
    # request may take (Ray's default grace is 20 s, then it is killed)
    deployment = serve.deployment(PipemapReplica, name="pipemap", max_ongoing_requests=max_ongoing,
                                  max_queued_requests=options.max_queue,
                                  graceful_shutdown_timeout_s=options.timeout + 5,
                                  ray_actor_options=actor_options(num_cpus, num_gpus),
                                  health_check_period_s=2, health_check_timeout_s=30, **scaling,
                                  **worker_bundles(plan, num_cpus, num_gpus))
    # ray annotates the decorator form's return, but given the class it returns the Deployment
    return deployment.bind(options, plan.to_dict())  # type: ignore[attr-defined, unused-ignore]


def run_on_ray(options: Options, host: str, port: int, replicas: int = 1, autoscale: str | None = None,
               public: bool = False) -> int:
    """``pipemap serve --ray``: deploy on the Ray cluster ``ray.init`` finds (``RAY_ADDRESS``) or a local one, and
    keep serving until Ctrl-C or SIGTERM. A local one binds its own ports (GCS, object store, dashboard) to
    127.0.0.1 unless ``public``: they run any code sent to them."""
    address = os.environ.get("RAY_ADDRESS")
    ray.init(**ray_init_options(address, public))
    here = ray.cluster_resources().get("GPU", 0.0) if address is None else None  # a local Ray: this machine
    plan = make_plan(options)
    app = application(options, replicas, autoscale, gpus_here=here, plan=plan)
    if replica_gpus(plan, here) < gpus(plan):
        print(f"pipemap: this machine has {here:g} GPUs, fewer than the plan's: each replica runs them on the CPU "
              "(plan for this machine, or leave --hardware out, to use what it has)", flush=True)
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name="pipemap", route_prefix="/")
    print(f"pipemap: serving on Ray at http://{host}:{port} (POST /v1/images/generations)", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.delete("pipemap")  # replicas finish the requests they hold before they go
    return 0
