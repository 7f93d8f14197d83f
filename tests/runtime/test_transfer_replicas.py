"""The copy check covers every GPU a plan copies between, denoiser replicas included: ``plan_devices`` names them,
``dispatch`` checks them (on fake GPUs, tests/fakecuda.py, the check itself runs), and ``load`` refuses a plan whose
replica GPU this machine lacks."""

from __future__ import annotations

import importlib

import pytest
import torch

import pipemap
from pipemap.dispatch.loading import check_plan_fits
from pipemap.errors import UnknownDeviceError
from pipemap.runtime import transfer

# SDXL on four large GPUs, "parallel": copies of the UNet on cuda:1..3, nothing else on cuda:3
SDXL_PARALLEL = ("stable-diffusion-xl-base-1.0", "4x80GiB,cpu=64GiB")


@pytest.fixture(scope="module")
def parallel_plan():
    plan = pipemap.plan(SDXL_PARALLEL[0], hardware=SDXL_PARALLEL[1], strategy="parallel")
    assert plan.placement("unet").replicas == ("cuda:1", "cuda:2", "cuda:3")
    assert "cuda:3" not in {p.device for p in plan.components}
    return plan


def test_plan_devices_names_the_replica_gpus(parallel_plan):
    assert set(transfer.plan_devices(parallel_plan)) == {"cuda:0", "cuda:1", "cuda:2", "cuda:3"}


@pytest.mark.slow  # over 2 s: out of the quick subset
def test_dispatch_checks_the_pairs_of_every_replica_gpu(fake_cuda, parallel_plan, monkeypatch):
    fake_cuda.gpus = 4
    dispatch = importlib.import_module("pipemap.dispatch.placing")  # where dispatch makes its hooks
    checked = []
    real = transfer.check_transfers
    monkeypatch.setattr(transfer, "check_transfers", lambda devices, copy=None, **kw: checked.append(
        list(devices)) or real(devices, copy, **kw))
    seen = []

    def stop(pipe, plan):
        seen.append(True)
        raise KeyboardInterrupt  # after the check, before placing anything: the models here are stand-ins

    monkeypatch.setattr(dispatch, "hook_maker", stop)
    pipe = type("Pipe", (), {})()
    pipe.components = {name: torch.nn.Linear(1, 1) for name in parallel_plan.device_map}
    with pytest.raises(KeyboardInterrupt):
        pipemap.dispatch(pipe, parallel_plan)
    assert checked == [["cuda:0", "cuda:1", "cuda:2", "cuda:3"]] and seen
    report = real(["cuda:0", "cuda:3"])  # the check itself, copies between fake GPUs
    assert report.pairs == {("cuda:0", "cuda:3"): "ok", ("cuda:3", "cuda:0"): "ok"}


def test_load_refuses_a_plan_whose_replica_gpu_is_missing(fake_cuda, parallel_plan):
    fake_cuda.gpus = 3
    inventory = pipemap.inspect(SDXL_PARALLEL[0])
    with pytest.raises(UnknownDeviceError, match="cuda:3"):
        check_plan_fits(parallel_plan, inventory)
    fake_cuda.gpus = 4
    check_plan_fits(parallel_plan, inventory)


def test_a_plan_depends_only_on_its_request_and_the_exchange_through_host_memory_is_dispatch_s_report():
    plan = pipemap.plan("wan2.1-t2v-14b", hardware="4x80GiB,cpu=256GiB", strategy="parallel")
    transfer.stage_pair("cuda:2", "cuda:3")  # as the copy check stages a corrupting pair at dispatch
    try:
        staged = pipemap.plan("wan2.1-t2v-14b", hardware="4x80GiB,cpu=256GiB", strategy="parallel")
        line = transfer.exchange_line("transformer", ["cuda:0", "cuda:1", "cuda:2", "cuda:3"])
        elsewhere = transfer.exchange_line("transformer", ["cuda:0", "cuda:1"])  # copies that avoid that pair
    finally:
        transfer.unstage_pair("cuda:2", "cuda:3")
    assert staged == plan and staged.notes == plan.notes  # what this process found earlier is no part of a plan
    assert line is not None and line.startswith(
        "transformer's copies on cuda:0, cuda:1, cuda:2, cuda:3 exchange through host memory")
    assert "direct copies cuda:2 -> cuda:3 corrupting" in line and elsewhere is None
