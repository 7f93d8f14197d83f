"""The serve wing (``pipemap.serve``) as a package: its public names are its modules' own, a missing extra says
which to install, and the names alone build and serve a service (the docstring's example, on the tiny pipeline)."""

from __future__ import annotations

import importlib
import sys

import pytest

import pipemap

pytest.importorskip("httpx", reason="the serve tests need httpx: pip install -e '.[test]'")
pytest.importorskip("uvicorn", reason="pipemap serve needs uvicorn: pip install -e '.[serve]'")
import pipemap.serve  # noqa: E402

HOMES = {"ROUTES": "app", "create_app": "app", "GenerationRequest": "requests", "Limits": "requests",
         "RequestError": "requests", "Background": "server", "run": "server", "Options": "service",
         "Service": "service", "resolve_folder": "service", "DrainingError": "worker", "QueueFullError": "worker",
         "WorkDropped": "worker", "run_sequential": "worker", "ConnectionLimits": "connections"}


def test_the_public_names_are_the_modules_own():
    assert sorted(pipemap.serve.__all__) == sorted(HOMES)
    for name, module in HOMES.items():
        assert getattr(pipemap.serve, name) is getattr(importlib.import_module(f"pipemap.serve.{module}"), name)


def test_the_errors_are_pipemap_errors():
    for name in ("RequestError", "DrainingError", "QueueFullError", "WorkDropped"):
        assert issubclass(getattr(pipemap.serve, name), pipemap.PipemapError), name


@pytest.mark.parametrize("missing", ["starlette", "uvicorn"])
def test_a_missing_extra_says_what_to_install(monkeypatch, missing):
    for name in [n for n in sys.modules if n == "pipemap.serve" or n.startswith("pipemap.serve.")]:
        monkeypatch.delitem(sys.modules, name)  # put back as they were when the test ends
    monkeypatch.delattr(pipemap, "serve", raising=False)
    monkeypatch.setitem(sys.modules, missing, None)  # import of it fails
    wanted = rf"pipemap serve needs {missing}: pip install -e '\.\[serve\]' in pipemap's checkout"
    with pytest.raises(ImportError, match=wanted):
        importlib.import_module("pipemap.serve")


@pytest.mark.slow  # over 2 s: out of the quick subset
def test_the_package_names_alone_load_and_serve_a_pipeline(tiny_folders):
    from starlette.testclient import TestClient

    from pipemap.serve import Options, Service, create_app

    service = Service.load(Options(tiny_folders["sd"], hardware="2x5MiB,cpu=1GiB", headroom=0.0))
    assert set(service.plan.device_map.values()) == {"cuda:0", "cuda:1"}  # run on the CPU here
    # the app's lifespan starts the worker and stops it; a local name as Host (a server on loopback refuses others)
    with TestClient(create_app(service), base_url="http://localhost") as client:
        answer = client.post("/v1/images/generations", json={"prompt": "a cat", "size": "32x32",
                                                              "num_inference_steps": 1, "seed": 3})
        assert answer.status_code == 200 and answer.json()["seed"] == 3 and len(answer.json()["data"]) == 1
        assert client.get("/health").json()["status"] == "ok"
    assert service.worker.draining  # stopped with the app
