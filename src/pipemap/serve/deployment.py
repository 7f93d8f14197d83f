"""``pipemap serve --ray``: the same app as a Ray Serve deployment, one replica per copy of the plan.

The driver plans for the machine a replica gets (``--hardware``, or this machine) to size what each replica asks
Ray for (``Resources``: the whole GPUs that plan uses, CPUs, and the host RAM it keeps as Ray's ``memory``), so
Ray places replicas only on nodes where that fits. A replica plans again for the node it lands on, unless the
user pinned ``--hardware``: its node's ``PIPEMAP_NODE_HARDWARE`` (a node's shape, as its operator states it) or the
GPUs and RAM it finds there (``GET /v1/replica`` and ``/metrics``' ``pipemap_replica`` say which node and plan).
Ray routes HTTP requests to replicas, restarts a replica that dies, and with ``autoscale`` adds or removes
replicas as their ongoing requests (queue plus running) rise above or fall below the target.

Ray answers as the app does: each replica takes more requests than the app's own queue holds, so past the queue
limit the app's 429 JSON with its Retry-After answers, not Ray's plain 503 (Ray's own limit, far past it, answers
429 with a Retry-After too); Ray's proxy gives each answer its one ``X-Request-Id``; a local Ray keeps its sockets
on loopback unless asked (``local_ray``). Ray Serve's HTTP proxy runs on the head node only by default
(``proxy_location``): nodes sharing a host would bind one port.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import threading
from dataclasses import dataclass

import ray
from prometheus_client import Info
from ray import serve
from ray.serve._private import replica as ray_replica
from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ..devices import normalize_device
from ..errors import AutoscaleSpecError
from ..hooks.ray_workers import ray_init_options
from ..hooks.workers import ENV, workers_mode
from ..plan import Plan
from . import ray_proxy
from .access import is_local
from .app import create_app
from .ray_router import ROUTER, SHAPES
from .server import PROBES
from .service import MOST_WORKERS, Options, Service, make_plan

__all__ = ["AutoscaleSpecError", "RaySettings", "Resources", "application", "deploy", "ray_init_options", "run_on_ray"]

NODE_HARDWARE = "PIPEMAP_NODE_HARDWARE"  # a node's shape, as its operator states it ('2x24GiB,cpu=64GiB')
PROXY_LOCATIONS = ("HeadOnly", "EveryNode", "Disabled")
RETRY_AFTER_S = 5  # Ray's own refusal, past the app's queue and then some: a flood, not a queue to drain


@dataclass(frozen=True)
class RaySettings:
    """How the app is laid on Ray: ``replicas`` (or ``autoscale`` ``MIN:MAX``), at most ``per_node`` of them on one
    node (None: as many as fit), the CPUs each asks for, where Ray Serve's HTTP proxies run (``HeadOnly``: the head
    node's one; ``EveryNode`` behind a load balancer) and whether a local Ray opens its ports (``public``)."""

    replicas: int = 1
    autoscale: str | None = None
    per_node: int | None = None
    num_cpus: float = 1.0
    proxy_location: str = "HeadOnly"
    public: bool = False


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


def host_bytes(plan: Plan) -> int:
    """The bytes of host RAM a replica's plan keeps: components computed on the CPU, the host copies of offloaded and
    streamed ones, the staging buffers pieces read from the disk pass through (``Plan.host``)."""
    host = plan.host
    return host.resident + host.offloaded + host.streamed + host.staging


@dataclass(frozen=True)
class Resources:
    """What one replica asks Ray for, from its plan: CPUs, whole GPUs (``replica_gpus``) and the host RAM the plan
    keeps (``host_bytes``), as Ray's logical ``memory`` resource. Ray places a replica only on a node whose free
    resources cover all three, so a node too small for the plan gets none (its process's own RAM, the Python and
    torch runtime, is not counted: Ray's ``memory`` is a reservation, not a limit)."""

    cpus: float
    gpus: int
    memory: int

    @classmethod
    def of(cls, plan: Plan, num_cpus: float, here: float | None = None) -> Resources:
        return cls(float(num_cpus), replica_gpus(plan, here), host_bytes(plan))

    def bundle(self) -> dict[str, float]:
        """As a placement group's bundle (Ray's resource names); a resource of none is left out."""
        named = {"CPU": self.cpus, "GPU": float(self.gpus), "memory": float(self.memory)}
        return {name: amount for name, amount in named.items() if amount or name == "CPU"}


def actor_options(resources: Resources) -> dict:
    """A replica's ``ray_actor_options``: its resources, and how its split denoiser runs its other ranks (the
    driver's ``PIPEMAP_WORKERS``, which a replica on another node would not see)."""
    options: dict = {"num_gpus": resources.gpus, "num_cpus": resources.cpus}
    if resources.memory:
        options["memory"] = resources.memory
    if ENV in os.environ:
        options["runtime_env"] = {"env_vars": {ENV: os.environ[ENV]}}
    return options


def worker_bundles(plan: Plan, resources: Resources) -> dict:
    """With ``PIPEMAP_WORKERS=ray``, a replica whose plan splits its denoiser is deployed in a placement group of
    its own (``STRICT_PACK``: one node): bundle 0 the replica's (its CPUs, every GPU of its plan and its host RAM),
    then a CPU for each worker rank (``hooks/ray_workers.py``: the worker actors take those bundles and share the
    replica's GPUs). Ray Serve makes one such group per replica. One node is inside one GPU domain whatever the
    cluster (Ray's ``ray.io/gpu-domain`` topology packs a group spanning nodes; a replica's ranks share rank 0's
    ``CUDA_VISIBLE_DEVICES``, so they never span nodes)."""
    ranks = worker_ranks(plan)
    if workers_mode() != "ray" or not ranks:
        return {}
    return {"placement_group_bundles": [resources.bundle(), *[{"CPU": 1.0}] * ranks],
            "placement_group_strategy": "STRICT_PACK"}


def autoscaling(text: str, max_ongoing: int) -> dict:
    """Ray Serve's ``autoscaling_config`` for ``MIN:MAX``: scale so each replica has about one batch in flight
    beyond the one it runs, out of the ``max_ongoing`` it takes."""
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text or "")
    if match is None or int(match[1]) > int(match[2]) or int(match[2]) < 1:
        raise AutoscaleSpecError(text)
    return {"min_replicas": int(match[1]), "max_replicas": int(match[2]),
            "target_ongoing_requests": max(1, min(2, max_ongoing)), "upscale_delay_s": 5, "downscale_delay_s": 60}


def deployment_options(options: Options, settings: RaySettings, plan: Plan, gpus_here: float | None = None) -> dict:
    """``serve.deployment``'s arguments for ``options`` on ``plan`` (as a Ray Serve config file's ``deployments:``
    entry has them): each replica's resources from ``plan`` (``Resources``), its limits, its grace, its count or
    scaling."""
    resources = Resources.of(plan, settings.num_cpus, gpus_here)
    # the app's own limit: its queue and the requests it runs. Ray sends a replica more than that (and the probes'
    # share), so past the queue the app's 429 JSON answers with its Retry-After, never Ray's refusal. Ray's router
    # counts as queued every request not yet assigned, a burst's too (with a limit of 1, two requests at once to
    # idle replicas get Ray's refusal): its limit is a replica's, and it refuses with 429 and a Retry-After too
    takes = options.max_queue + (options.workers or MOST_WORKERS)
    scaling = ({"autoscaling_config": autoscaling(settings.autoscale, takes)} if settings.autoscale
               else {"num_replicas": settings.replicas})
    spread = {"max_replicas_per_node": settings.per_node} if settings.per_node else {}
    # a replica going away gets as long as a request may take (Ray's default grace is 20 s, then it is killed)
    return {"name": "pipemap", "max_ongoing_requests": takes + PROBES, "max_queued_requests": takes + PROBES,
            "backpressure_config": {"status_code": 429, "retry_after_s": RETRY_AFTER_S},
            "graceful_shutdown_timeout_s": options.timeout + 5, "health_check_period_s": 2,
            "health_check_timeout_s": 30, "ray_actor_options": actor_options(resources),
            "request_router_config": {"request_router_class": ROUTER,
                                      "request_router_kwargs": {"busy_at": options.workers or 1}},
            **scaling, **spread, **worker_bundles(plan, resources)}


def node_options(options: Options) -> tuple[Options, str]:
    """The options a replica plans with where it lands, and where their hardware comes from: the user's
    ``--hardware`` (``pinned``), else its node's ``PIPEMAP_NODE_HARDWARE`` (``node``), else what the replica finds
    there, its GPUs (those Ray gave it: ``CUDA_VISIBLE_DEVICES``) and RAM (``detected``)."""
    if options.hardware is not None:
        return options, "pinned"
    stated = os.environ.get(NODE_HARDWARE, "").strip()
    if stated:
        return dataclasses.replace(options, hardware=stated), "node"
    return options, "detected"


def landing(plan: Plan, source: str, hardware: str | None) -> dict:
    """What ``GET /v1/replica`` says of a replica: its node, and the plan it made for it."""
    context = ray.get_runtime_context()
    return {"node_id": context.get_node_id(), "node_ip": ray.util.get_node_ip_address(),
            "hardware": hardware or "detected", "hardware_from": source, "strategy": plan.strategy,
            "device_map": plan.device_map}


class RayAnswers:
    """ASGI middleware of a replica's app: Ray's proxy gives every answer an ``X-Request-Id`` (the client's, or its
    own, which the app reads as the client's), so the app's copy is dropped and one is sent; every answer names the
    node that made it (``X-Pipemap-Node``). A request answered 200 whose shape Ray's router knows (its multiplexed
    model id, ``ray_router``) has been measured here: ``measured`` is told, before the answer goes."""

    def __init__(self, app, node: str, measured=None):
        self.app, self.node, self.measured = app, node, measured

    async def __call__(self, scope, receive, send) -> None:
        async def send_one(message) -> None:
            if message["type"] == "http.response.start":
                shape = serve.get_multiplexed_model_id() if message["status"] == 200 else ""
                if shape and self.measured is not None:
                    await self.measured(shape)
                message = {**message, "headers": list(message.get("headers", []))}
                headers = MutableHeaders(scope=message)
                del headers["x-request-id"]
                headers["x-pipemap-node"] = self.node
            await send(message)

        await self.app(scope, receive, send_one if scope["type"] == "http" else send)


class _BindOn:
    """Ray Serve's ``add_port_to_grpc_server`` with the wildcard address a replica's own gRPC server asks for
    (``[::]:0``) replaced by ``host``."""

    def __init__(self, add, host: str):
        self.add, self.host = add, host

    def __call__(self, server, address: str):
        return self.add(server, f"{self.host}:0" if address == "[::]:0" else address)


def keep_replica_grpc_on_loopback() -> None:
    """A replica on a node whose address is loopback (a local Ray that is not ``--ray-public``) binds its
    inter-deployment gRPC server there too: Ray Serve binds it to every interface, with no setting to say otherwise
    (Ray 2.60's ``replica.py``); peers reach it at the node's address, so nothing else changes."""
    node = ray.util.get_node_ip_address()
    if is_local(node) and hasattr(ray_replica, "add_port_to_grpc_server"):
        add = ray_replica.add_port_to_grpc_server
        ray_replica.add_port_to_grpc_server = _BindOn(getattr(add, "add", add), node)


@serve.ingress()
class PipemapReplica:
    """One replica: plans for its node (``node_options``; the driver's ``plan`` where the user pinned the hardware),
    loads the pipeline onto the plan and serves the pipemap app."""

    def __init__(self, options: Options, plan: dict | None = None):
        keep_replica_grpc_on_loopback()  # before Ray Serve starts it, once this constructor returns
        mine, source = node_options(options)
        # cuda:N in a plan are this replica's GPUs: Ray sets CUDA_VISIBLE_DEVICES to those it was given
        made = Plan.from_dict(plan) if plan is not None and source == "pinned" else make_plan(mine)
        self.service = Service.load(mine, made)
        self.landing = landing(made, source, mine.hardware)
        Info("pipemap_replica", "The node this replica runs on and the plan it made there",
             registry=self.service.metrics.registry).info(
            {key: str(self.landing[key]) for key in ("node_id", "node_ip", "hardware_from", "strategy")})
        self.service.start()

    def __serve_build_asgi_app__(self):
        app = create_app(self.service)
        app.router.routes.append(Route("/v1/replica", self._where, methods=["GET"]))
        app.add_middleware(RayAnswers, node=self.landing["node_id"], measured=self.measured)
        return app

    @serve.multiplexed(max_num_models_per_replica=SHAPES)
    async def measured(self, shape: str) -> str:
        """A request shape this replica has measured (``RayAnswers`` calls it): Ray Serve's multiplexing, used to
        tell every router the shapes it knows (``ray_router.ShapeRouter``); loading one costs nothing here."""
        return shape

    async def _where(self, request: Request) -> JSONResponse:
        return JSONResponse(self.landing)

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose device failed for good (``Service.notice``) is restarted."""
        if self.service.broken is not None:
            raise RuntimeError(f"pipemap: the device failed: {self.service.broken}")

    def __del__(self):
        service = getattr(self, "service", None)
        if service is not None:  # Ray Serve has already waited for the replica's requests in flight
            service.worker.drain()


def application(options: Options, settings: RaySettings = RaySettings(), gpus_here: float | None = None,
                plan: Plan | None = None):
    """The Ray Serve application for ``options``: the plan made here sizes what each replica asks for (no GPUs
    where ``gpus_here``, a local Ray's GPUs, are too few: ``replica_gpus``); ``plan``: the one made for ``options``.

    >>> settings = RaySettings(autoscale="1:4")                                                # doctest: +SKIP
    >>> serve.run(application(Options("path/to/sdxl", hardware="2x24GiB"), settings))         # doctest: +SKIP
    """
    plan = plan or make_plan(options)
    deployment = serve.deployment(PipemapReplica, **deployment_options(options, settings, plan, gpus_here))
    pinned = plan.to_dict() if options.hardware is not None else None  # else each replica plans for its node
    # ray annotates the decorator form's return, but given the class it returns the Deployment
    return deployment.bind(options, pinned)  # type: ignore[attr-defined, unused-ignore]


LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": every process Ray starts takes 127.0.0.1 for its address


def init_options(address: str | None, public: bool) -> dict:
    """``ray.init``'s arguments: a cluster's address as given; else a new local Ray (never one another process left
    behind in Ray's temp folder), on loopback unless ``public``."""
    return {**ray_init_options(address, public), **({"address": "local"} if address is None else {})}


def http_options(options: Options, host: str, port: int) -> dict:
    """Ray Serve's proxy: where it listens, and how long a request may wait for a replica and run (then 504)."""
    return {"host": host, "port": port, "request_timeout_s": options.timeout + 5}


def deploy(options: Options, settings: RaySettings, host: str, port: int) -> str:
    """Deploy the app on the Ray cluster ``RAY_ADDRESS`` names (joined unless this process already is) or a new
    local one; return its URL. A local Ray binds its own ports (GCS, raylet, agents, workers) to 127.0.0.1 unless
    ``settings.public``: they run any code sent to them."""
    address = os.environ.get("RAY_ADDRESS")
    if address is None and not settings.public:
        # read by each process the local Ray starts: without it Ray's agents bind this machine's address, and its
        # gRPC servers every interface, whatever node address it is given
        os.environ[LOOPBACK_ENV] = "0"
    if address is None:  # Ray's proxy answers its own errors as the app does (a cluster's head is started so)
        os.environ.setdefault(ray_proxy.ENV, ray_proxy.CALLBACK)
    ray.init(**init_options(address, settings.public))
    here = ray.cluster_resources().get("GPU", 0.0) if address is None else None  # a local Ray: this machine
    plan = make_plan(options)
    if replica_gpus(plan, here) < gpus(plan):
        print(f"pipemap: this machine has {here:g} GPUs, fewer than the plan's: each replica runs them on the CPU "
              "(plan for this machine, or leave --hardware out, to use what it has)", flush=True)
    serve.start(proxy_location=settings.proxy_location, http_options=http_options(options, host, port))
    serve.run(application(options, settings, gpus_here=here, plan=plan), name="pipemap", route_prefix="/")
    return f"http://{host}:{port}"


def run_on_ray(options: Options, settings: RaySettings, host: str, port: int) -> int:
    """``pipemap serve --ray``: ``deploy``, and keep serving until Ctrl-C or SIGTERM."""
    url = deploy(options, settings, host, port)
    print(f"pipemap: serving on Ray at {url} (POST /v1/images/generations)", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.delete("pipemap")  # replicas finish the requests they hold before they go
    return 0
