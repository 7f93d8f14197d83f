"""``pipemap serve --ray``: the app as a Ray Serve deployment on a local Ray with CPU resources only.

A request is served end to end over HTTP; a replica killed in the middle of a request gives its client an answer
(an error, or the request retried on the restarted replica), never a hang, and the deployment comes back.
"""

from __future__ import annotations

import base64
import io
import socket
import threading
import time

import numpy as np
import pytest
import torch
from PIL import Image

import pipemap

ray = pytest.importorskip("ray", reason="the Ray Serve tests need ray: pip install -e '.[ray]'")
httpx = pytest.importorskip("httpx", reason="the serve tests need httpx: pip install -e '.[test]'")
from ray import serve  # noqa: E402

from pipemap.hooks.workers import ENV  # noqa: E402
from pipemap.serve import Options  # noqa: E402
from pipemap.serve.deployment import (  # noqa: E402
    AutoscaleSpecError,
    RaySettings,
    Resources,
    application,
    autoscaling,
    gpus,
    ray_init_options,
    replica_gpus,
    worker_ranks,
)
from pipemap.serve.service import make_plan  # noqa: E402

GENERATIONS = "/v1/images/generations"


def test_a_replica_asks_for_the_gpus_its_plan_uses(tiny_folders):
    folder = tiny_folders["sdxl"]
    assert gpus(pipemap.plan(folder, hardware="cuda:0=1GiB,cpu=4GiB")) == 1
    assert gpus(pipemap.plan(folder, hardware="2x5MiB,cpu=1GiB", headroom=0.0)) == 2
    assert gpus(pipemap.plan(folder, hardware="cpu=4GiB")) == 0
    deployment = application(Options(folder, hardware="2x5MiB,cpu=1GiB", headroom=0.0), RaySettings(autoscale="1:3"))
    options = deployment._bound_deployment  # what Ray is asked for, as Ray Serve holds it
    assert options.ray_actor_options["num_gpus"] == 2
    assert options._deployment_config.autoscaling_config.min_replicas == 1
    assert options._deployment_config.autoscaling_config.max_replicas == 3


def test_a_replica_asks_for_the_host_ram_its_plan_keeps_as_ray_s_memory(tiny_folders, monkeypatch):
    folder = tiny_folders["sd"]
    on_cpu = Options(folder, hardware="cpu=4GiB")
    plan = make_plan(on_cpu)
    assert plan.host.resident > 0  # every component computed on the CPU: its weights in RAM
    assert application(on_cpu, plan=plan)._bound_deployment.ray_actor_options["memory"] == plan.host.resident
    offloaded = Options(folder, hardware="cuda:0=4MiB,cpu=1GiB", strategy="balanced_low_memory", headroom=0.0)
    plan = make_plan(offloaded)
    assert plan.host.offloaded > 0 and plan.host.resident == 0  # host copies, brought to the GPU for their calls
    # and the pinned buffers what it reads from its files passes through
    assert application(offloaded, plan=plan)._bound_deployment.ray_actor_options["memory"] == \
        plan.host.offloaded + plan.host.staging
    resident = Options(folder, hardware="2x64MiB,cpu=1GiB", headroom=0.0)
    assert "memory" not in application(resident)._bound_deployment.ray_actor_options  # all on the GPUs
    # with worker ranks on Ray, bundle 0 holds all the replica asks for (Ray Serve checks the actor fits in it)
    assert Resources(1.0, 2, 5 * 2**20).bundle() == {"CPU": 1.0, "GPU": 2.0, "memory": 5.0 * 2**20}
    assert Resources(0.5, 0, 0).bundle() == {"CPU": 0.5}


def test_with_ray_workers_a_replica_that_splits_its_denoiser_gets_a_strict_pack_bundle_per_worker(
        tiny_folders, monkeypatch):
    options = Options(tiny_folders["sd"], hardware="2x64MiB,cpu=1GiB", strategy="parallel", headroom=0.0)
    assert worker_ranks(make_plan(options)) == 1  # the unet copied onto cuda:1: one worker rank
    monkeypatch.setenv(ENV, "ray")
    bound = application(options)._bound_deployment
    # bundle 0 the replica's own (its CPU and both GPUs of its plan), then one CPU for the worker actor
    assert bound._replica_config.placement_group_bundles == [{"CPU": 1.0, "GPU": 2.0}, {"CPU": 1.0}]
    assert bound._replica_config.placement_group_strategy == "STRICT_PACK"
    assert bound.ray_actor_options["runtime_env"] == {"env_vars": {ENV: "ray"}}  # the replica runs them on Ray
    monkeypatch.setenv(ENV, "process")  # worker processes the replica starts itself: no bundles
    bound = application(options)._bound_deployment
    assert bound._replica_config.placement_group_bundles is None
    assert bound.ray_actor_options["runtime_env"] == {"env_vars": {ENV: "process"}}
    monkeypatch.setenv(ENV, "ray")
    assert application(Options(tiny_folders["sd"], hardware="cpu=4GiB"))._bound_deployment._replica_config \
        .placement_group_bundles is None  # nothing split: no workers


def test_a_local_ray_without_the_plan_s_gpus_runs_them_on_the_cpu_as_serve_does_without_ray(tiny_folders,
                                                                                           monkeypatch):
    # a local Ray is this machine: a replica asking for GPUs it lacks would wait for ever (Ray's autoscaler: "No
    # available node types can fulfill resource request {'GPU': 2.0}"); it asks for none and runs them on the CPU
    options = Options(tiny_folders["sd"], hardware="2x64MiB,cpu=1GiB", strategy="parallel", headroom=0.0)
    plan = make_plan(options)
    assert (replica_gpus(plan, here=0.0), replica_gpus(plan, here=1.0), replica_gpus(plan, here=2.0)) == (0, 0, 2)
    assert replica_gpus(plan, here=None) == 2  # a cluster's replicas ask, and wait for a node that has them
    monkeypatch.setenv(ENV, "ray")
    bound = application(options, gpus_here=0.0, plan=plan)._bound_deployment
    assert bound.ray_actor_options["num_gpus"] == 0
    assert bound._replica_config.placement_group_bundles == [{"CPU": 1.0}, {"CPU": 1.0}]


def test_the_queue_limit_and_the_grace_follow_the_options(tiny_folders):
    deployment = application(Options(tiny_folders["sd"], hardware="cpu=4GiB", max_queue=2, timeout=300.0))
    config = deployment._bound_deployment._deployment_config
    # the app's limit is 2 waiting and 8 running at most: Ray takes more, so the app's 429 JSON answers past it
    assert config.max_ongoing_requests == config.max_queued_requests == 2 + 8 + 16
    assert (config.backpressure_config.status_code, config.backpressure_config.retry_after_s) == (429, 5)
    assert config.graceful_shutdown_timeout_s == 305.0  # not Ray's 20 s: a request running may finish


def test_a_local_ray_keeps_its_ports_on_loopback_unless_asked():
    assert ray_init_options(None, public=False) == {"address": None, "ignore_reinit_error": True,
                                                    "_node_ip_address": "127.0.0.1", "dashboard_host": "127.0.0.1"}
    assert ray_init_options(None, public=True) == {"address": None, "ignore_reinit_error": True}
    assert ray_init_options("ray://head:10001", public=False) == {"address": "ray://head:10001",
                                                                  "ignore_reinit_error": True}


@pytest.mark.parametrize("text", ["3", "3:1", "0:0", "a:b"])
def test_autoscale_needs_min_max(text):
    with pytest.raises(AutoscaleSpecError, match="MIN:MAX"):
        autoscaling(text, 17)


@pytest.fixture(scope="module")
def ray_url(tiny_folders):
    """A local Ray (CPUs only, loopback) running the tiny SD deployment, one replica."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False, _node_ip_address="127.0.0.1",
             object_store_memory=100 * 2**20, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # the slow request below asks for 400 steps, past the default cap of 200
        serve.run(application(Options(tiny_folders["sd"], hardware="cpu=4GiB", timeout=60.0, max_steps=1000)),
                  name="pipemap", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def image(response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.array(Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"]))))


@pytest.mark.slow
def test_ray_serve_generates_and_survives_a_replica_killed_mid_request(ray_url, tiny_folders):
    from diffusers import DiffusionPipeline

    body = {"prompt": "a tiny cat", "size": "32x32", "num_inference_steps": 2, "seed": 5}
    with httpx.Client(base_url=ray_url, timeout=90) as client:
        got = image(client.post(GENERATIONS, json=body))
        plain = DiffusionPipeline.from_pretrained(tiny_folders["sd"])
        plain.set_progress_bar_config(disable=True)
        want = plain("a tiny cat", width=32, height=32, num_inference_steps=2, output_type="np",
                     generator=torch.Generator("cpu").manual_seed(5)).images[0]
        assert np.abs(got.astype(int) - (want * 255).round()).max() <= 1
        assert client.get("/v1/plan").json()["components"]["unet"]["device"] == "cpu"

        answer = {}
        slow = {**body, "num_inference_steps": 400}
        request = threading.Thread(target=lambda: answer.update(r=_post(client, slow)), daemon=True)
        request.start()
        _wait(lambda: client.get("/health").json()["running"] == 1, 60)
        ray.kill(_replica(), no_restart=True)  # Serve's controller, not Ray, replaces it
        request.join(90)
        assert not request.is_alive(), "the client of a killed replica hung"
        # an error (the replica died under it: Ray Serve 2.60 answers 500) or an answer (retried on the restarted
        # replica): never a hang
        assert isinstance(answer["r"], Exception) or answer["r"].status_code in (200, 500, 502, 503)
        _wait(lambda: _healthy(client), 90)
        np.testing.assert_array_equal(image(client.post(GENERATIONS, json=body)), got)


def _post(client, body):
    try:
        return client.post(GENERATIONS, json=body)
    except httpx.TransportError as error:
        return error


def _replica():
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith("SERVE_REPLICA::")]
    assert len(names) == 1, names
    return ray.get_actor(names[0], namespace="serve")


def _healthy(client) -> bool:
    try:
        return client.get("/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def _wait(predicate, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "gave up waiting"
        time.sleep(0.1)
