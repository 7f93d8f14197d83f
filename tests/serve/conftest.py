"""Fixtures the serve test files share: the tiny SD pipeline served for real (uvicorn on a free loopback port) and an
httpx client on it. Each is module-scoped, so every test file gets its own service, queue and counters. The test files
skip themselves where httpx or the serve extra is missing; these import them only when used."""

from __future__ import annotations

import pytest

import pipemap
from serving import ROOM, roomy_hardware


@pytest.fixture(scope="module")
def service(tiny_folders):
    """The tiny SD pipeline on a plan that offloads (so bytes move), remapped onto the CPU; one waiting request at
    most, so a second one waiting is refused; two requests in flight through run_many. The GPU has ``ROOM`` bytes
    beyond the budget the plan fills, kept as headroom: the memory ledger admits requests' activations there."""
    from pipemap.serve import Options, Service

    folder = tiny_folders["sd"]
    hardware = roomy_hardware(pipemap.inspect(folder))
    return Service.load(Options(folder, hardware=hardware, strategy="balanced_low_memory", headroom=ROOM,
                                admit_as_planned=True, max_queue=1, timeout=120.0, max_n=2, workers=2))


@pytest.fixture(scope="module")
def url(service):
    from pipemap.serve import Background

    with Background(service) as address:
        yield address


@pytest.fixture(scope="module")
def client(url):
    import httpx

    with httpx.Client(base_url=url, timeout=120) as session:
        yield session
