"""Denoiser replicas (``hooks/replica.py``, strategy ``"parallel"``): each call's batch cut across copies of the
denoiser, run on threads, joined in order; on the CPU (GPU plans remapped), by hand, and in the dry run."""

from __future__ import annotations

import threading

import pytest
import torch

import pipemap
from helpers import assert_split_close
from pipemap import tiny
from pipemap.hooks import ReplicaHook, hook_component, unhook_component
from pipemap.hooks.calls import join_batch, replica, split_batch
from pipemap.plan import Placement

ON_CPU = {"cuda:0": "cpu", "cuda:1": "cpu"}
# tiny sd: unet 3.0 MiB, vae 2.5, text encoder 0.2; sdxl: unet 3.2, vae 2.5, text encoders 0.2 each. At 8 MiB a GPU
# holds a copy of the unet and the vae: every GPU gets a copy.
PARALLEL_GPUS = {2: "2x8MiB,cpu=1GiB", 3: "3x8MiB,cpu=1GiB"}


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "gpus"), [("sd", 2), ("sdxl", 3)])
def test_parallel_dry_run_puts_a_copy_on_each_stand_in_within_budget(kind, gpus):
    pipe = tiny.build(kind)
    plan = pipemap.plan(pipe, hardware=PARALLEL_GPUS[gpus], strategy="parallel", headroom=0.0)
    unet = plan.placement("unet")
    assert unet.mode == "replicated" and (unet.device, *unet.replicas) == tuple(f"cuda:{i}" for i in range(gpus))
    assert plan.execution_device == unet.device and "unet replicated on" in plan.notes[-1]
    report = pipemap.simulate(pipe, plan, num_images_per_prompt=gpus - 1)  # guidance: a batch of 2 x images
    assert report.ok, report.error
    for device in plan.devices:
        if device.device == "cpu":
            continue
        assert report.weight_bytes[device.device] == pytest.approx(device.used, rel=0.01)  # its copy landed there
        assert report.activation_bytes[device.device] > 0  # and computed its part of the batch there
        assert report.peak_bytes[device.device] <= device.budget


def _thread_names(module: torch.nn.Module, names: list[str]):
    return module.register_forward_pre_hook(lambda m, a: names.append(threading.current_thread().name))


@pytest.mark.slow  # over 2 s: out of the quick subset
@pytest.mark.parametrize("kind", ["sd", "sdxl"])
def test_parallel_on_the_cpu_equals_plain_diffusers(kind):
    pipe = tiny.build(kind)
    pipe.set_progress_bar_config(disable=True)
    calls = [tiny.default_call(pipe, kind), dict(tiny.default_call(pipe, kind), num_images_per_prompt=2),
             dict(tiny.default_call(pipe, kind), guidance_scale=1.0)]  # no guidance: a batch of 1, no copy runs
    plain = [pipe(**call).images for call in calls]
    plan = pipemap.plan(pipe, hardware=PARALLEL_GPUS[2], strategy="parallel", headroom=0.0)
    pipemap.dispatch(pipe, plan.remap(ON_CPU))
    hook = pipe.unet._hf_hook
    assert isinstance(hook, pipemap.hooks.ReplicaHook) and len(hook.replicas) == 1
    home, copies = [], []
    handles = [_thread_names(pipe.unet, home), _thread_names(hook.replicas[0], copies)]
    steps = calls[0]["num_inference_steps"]
    for call, want, copy_calls in zip(calls, plain, [steps, steps, 0], strict=True):
        copies.clear()
        call["generator"] = torch.Generator().manual_seed(0)
        assert_split_close(torch.as_tensor(pipe(**call).images), torch.as_tensor(want), "pipeline")
        assert len(copies) == copy_calls
    for handle in handles:
        handle.remove()
    assert set(home) == {threading.main_thread().name}
    assert {name.rsplit("_", 1)[0] for name in copies} <= {"pipemap-unet"}  # the copy ran on its own thread
    pipemap.reset(pipe)
    assert hook.replicas == [] and not hasattr(pipe.unet, "_hf_hook")


# ---- by hand: cutting a batch, copies, the hook on a small module ------------------------------------------------


def test_split_batch_cuts_every_tensor_of_the_batch_and_passes_the_rest_whole():
    latents, timestep, other = torch.arange(8.0).reshape(4, 2), torch.tensor(5.0), torch.ones(3, 1)
    parts = split_batch((latents,), {"t": timestep, "context": torch.ones(4, 7), "other": other, "flag": True}, 3)
    assert [(a[0].shape[0], k["context"].shape[0]) for a, k in parts] == [(2, 2), (1, 1), (1, 1)]
    assert all(k["t"] is timestep and k["other"] is other and k["flag"] is True for _, k in parts)
    torch.testing.assert_close(torch.cat([a[0] for a, _ in parts]), latents, atol=0, rtol=0)
    assert len(split_batch((torch.ones(2, 2),), {}, 5)) == 2  # no more parts than the batch has rows
    one = ((torch.ones(1, 2),), {})
    assert split_batch(*one, 4) == [one]  # a batch of one: the call as it was


def test_join_batch_concatenates_in_order_and_keeps_the_rest():
    joined = join_batch([({"sample": torch.ones(2, 1)}, 3), ({"sample": torch.zeros(1, 1)}, 3)])
    torch.testing.assert_close(joined[0]["sample"], torch.tensor([[1.0], [1.0], [0.0]]), atol=0, rtol=0)
    assert joined[1] == 3


def test_a_replica_on_the_same_device_shares_the_weights_and_elsewhere_copies_them():
    module = torch.nn.Linear(2, 2)
    same = replica(module, torch.device("cpu"))
    assert same is not module and same.weight is module.weight
    away = replica(module, torch.device("meta"))
    assert away.weight.device.type == "meta" and module.weight.device.type == "cpu"
    assert isinstance(away.weight, torch.nn.Parameter) and not away.weight.requires_grad


def test_the_hook_cuts_each_call_across_its_copies_and_joins_in_order():
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    x = torch.randn(5, 3)
    expected = module(x)
    hook = ReplicaHook.for_placement(Placement("m", "cpu", 32, "replicated", replicas=("cpu", "cpu")), "cpu", None)
    hook_component(module, hook)
    rows, threads = [], []

    def seen(copy, args):
        rows.append(args[0].shape[0])
        threads.append(threading.current_thread().name)

    handles = [copy.register_forward_pre_hook(seen) for copy in hook.replicas]
    with torch.no_grad():
        assert_split_close(module(x), expected)  # 5 rows whole, 2 + 2 + 1 in parts: other kernels, other rounding
    assert sorted(rows) == [1, 2] and all(name.startswith("pipemap-m") for name in threads)  # 2 + 2 + 1 rows
    for handle in handles:
        handle.remove()
    unhook_component(module)
    assert hook.replicas == [] and not hasattr(module, "_hf_hook")
