"""serve/service.py: the service behind the app, with no HTTP. ``Service.load`` plans the folder for the hardware
asked for and runs the plan on this machine's devices; ``submit`` checks a request and queues its job with its seed
and deadline; the plan, health and home page as the routes show them; ``Options`` and ``resolve_folder`` say what to
load."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import pipemap
from helpers import inventory
from helpers import plan as make_plan

pytest.importorskip("uvicorn", reason="pipemap serve needs uvicorn: pip install -e '.[serve]'")
from pipemap.serve import GenerationRequest, Options, RequestError, Service, resolve_folder  # noqa: E402
from pipemap.serve.service import default_workers  # noqa: E402


def test_a_name_not_in_the_cache_says_so():
    # HF_HUB_OFFLINE is set for every test, and no test downloads: a published name resolves to nothing
    with pytest.raises(pipemap.NotAPipelineError, match="'black-forest-labs/FLUX.1-dev' is not in the Hugging Face"):
        resolve_folder("flux.1-dev")


def test_a_folder_resolves_to_itself(tiny_folders):
    assert resolve_folder(tiny_folders["sd"]) == Path(tiny_folders["sd"])


def test_options_make_the_request_every_verb_takes(tiny_folders):
    options = Options(tiny_folders["sdxl"], hardware="2x5MiB,cpu=1GiB", strategy="sequential", dtype="float16",
                      headroom=0.0)
    request = options.request()
    assert request.source == tiny_folders["sdxl"] and request.strategy == "sequential"
    assert request.hardware == pipemap.Hardware.parse("2x5MiB,cpu=1GiB")
    assert str(request.dtype) == "torch.float16" and request.headroom == 0.0
    with pytest.raises(pipemap.UnknownStrategyError):
        Options(tiny_folders["sd"], strategy="fastest").request()  # checked as every verb checks it


def test_requests_in_flight_default_to_one_per_device_that_computes():
    two = make_plan(inventory(("unet", 3), ("vae", 2)), "cuda:0=4,cuda:1=4,cpu=100", strategy="balanced")
    assert set(two.device_map.values()) == {"cuda:0", "cuda:1"} and default_workers(two) == 2
    one = make_plan(inventory(("unet", 3), ("vae", 2)), "cpu=100")
    assert default_workers(one) == 1


def test_load_plans_for_the_hardware_asked_and_runs_on_this_machine(service):
    # the fixture asks for a GPU this machine lacks: the plan keeps it, the pipeline runs on the CPU
    assert "cuda:0" in {d.device for d in service.plan.devices}
    assert set(service.running_plan.device_map.values()) == {"cpu"}
    assert service.plan_json()["runs_on"] == service.running_plan.device_map
    assert pipemap.Plan.from_dict(service.plan_json()) == service.plan
    assert service.workers == 2 and service.limits.max_n == 2 and service.timeout == 120.0


def test_a_plan_that_runs_as_made_shows_no_runs_on(service):
    local = Service(service.pipe, service.running_plan)
    assert "runs_on" not in local.plan_json() and local.workers == 1  # everything on the CPU: one in flight


def test_submit_checks_the_request_and_queues_its_job_with_seed_and_deadline(service):
    queue = Service(service.pipe, service.plan, service.running_plan, timeout=30.0)  # its worker never started
    generation, job = queue.submit(GenerationRequest(prompt="a cat", size="32x32", seed=7, n=2))
    assert generation.seed == job.seed == 7 and job.images == 2 and job.call == generation.call
    assert generation.call["width"] == generation.call["height"] == 32
    assert 29 < job.deadline - time.monotonic() <= 30
    assert queue.worker.depth == 1 and queue.health() == {"status": "ok", "queue_depth": 1, "running": 0}
    _, unseeded = queue.submit(GenerationRequest(prompt="a dog"))
    assert 0 <= unseeded.seed < 2**31  # a random seed, told to the client in the answer
    with pytest.raises(RequestError):
        queue.submit(GenerationRequest(prompt="a cat", n=5))  # over max_n, 4 by default
    assert queue.worker.depth == 2  # nothing queued for a refused request


def test_health_says_draining_once_the_worker_drains(service):
    draining = Service(service.pipe, service.plan, service.running_plan)
    draining.worker.drain()
    assert draining.health() == {"status": "draining", "queue_depth": 0, "running": 0}


def test_a_request_failing_with_a_sticky_device_error_breaks_the_service_and_a_plain_error_does_not(service):
    # the worker answers a job by its future; a sticky CUDA error (every later call fails too) is noticed there,
    # whoever asked (the app, Ray, a caller of Service): health says so, so an orchestrator restarts the process
    own = Service(service.pipe, service.plan, service.running_plan, timeout=30.0)  # its worker never started
    _, plain = own.submit(GenerationRequest(prompt="a cat", size="32x32"))
    plain.future.set_exception(RuntimeError("shapes do not match"))
    assert own.broken is None and own.health()["status"] == "ok" and own.readiness() is None
    _, sticky = own.submit(GenerationRequest(prompt="a cat", size="32x32"))
    sticky.future.set_exception(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert own.health()["status"] == "device_error" and "illegal memory access" in own.readiness()


def test_the_home_page_is_drawn_once_from_the_plan(service):
    page = service.home_page()
    assert page is service.home_page()  # made once, served many times
    assert "<svg" in page and type(service.pipe).__name__ in page
    assert all(f'data-device="{d.device}"' in page for d in service.plan.devices)
