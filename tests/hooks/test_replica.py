"""Denoiser replicas (``hooks/replica.py``, strategy ``"parallel"``): each call's batch cut across copies of the
denoiser, run on threads, joined in order; on the CPU (GPU plans remapped), by hand, and in the dry run.

On worker processes (the tests below the line): a plan for two GPUs remapped onto the CPU keeps one rank per planned
GPU, the second a real process over gloo; each starts workers (a forked interpreter: a second), so most are slow."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
from diffusers import DiffusionPipeline

import pipemap
from helpers import assert_split_close
from pipemap import tiny
from pipemap.errors import WorkerDiedError
from pipemap.hooks import ReplicaHook, hook_component, unhook_component
from pipemap.hooks.calls import join_batch, replica, split_batch
from pipemap.hooks.workers import ENV
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


# ---- on worker processes
TWO_GPUS = "2x8MiB,cpu=1GiB"  # tiny sd: unet 3.0 MiB, vae 2.5; sdxl: unet 3.2: each GPU holds a copy of the unet
BOUND_S = 120  # the bound on any wait for a dead worker
SOURCE = os.path.dirname(os.path.dirname(pipemap.__file__))  # this checkout's pipemap, for a child interpreter


@pytest.fixture
def on_workers(monkeypatch):
    monkeypatch.setenv(ENV, "process")


def _calls(pipe, kind: str) -> list[dict]:
    call = tiny.default_call(pipe, kind)
    return [call, dict(call, num_images_per_prompt=2), dict(call, guidance_scale=1.0)]  # the last: a batch of 1


def _images(pipe, call: dict) -> torch.Tensor:
    return torch.as_tensor(pipe(**dict(call, generator=torch.Generator().manual_seed(0))).images)


def _dispatched(pipe) -> ReplicaHook:
    plan = pipemap.plan(pipe, hardware=TWO_GPUS, strategy="parallel", headroom=0.0)
    assert plan.placement("unet").mode == "replicated" and plan.placement("unet").replicas == ("cuda:1",)
    pipemap.dispatch(pipe, plan.remap(ON_CPU))
    hook = pipe.unet._hf_hook
    assert isinstance(hook, ReplicaHook) and hook.runtime == "process" and hook.replicas == []  # none in this process
    return hook


def plan_bytes(pipe) -> int:
    plan = pipemap.plan(pipe, hardware=TWO_GPUS, strategy="parallel", headroom=0.0)
    return plan.placement("unet").bytes


def _workers_alive(pids: list[int]) -> list[int]:
    return [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


def _worker_children() -> list[psutil.Process]:
    """This process's children less multiprocessing's resource tracker and forkserver (one each per interpreter)."""
    return [p for p in psutil.Process().children(recursive=True)
            if not any(k in " ".join(p.cmdline()) for k in ("resource_tracker", "forkserver"))
            and p.status() != psutil.STATUS_ZOMBIE]



def _two_loads(folder):
    """The pipeline in ``folder`` loaded twice (plain and to be placed), progress bars off."""
    loads = DiffusionPipeline.from_pretrained(folder), DiffusionPipeline.from_pretrained(folder)
    for each in loads:
        each.set_progress_bar_config(disable=True)
    return loads

@pytest.mark.slow
def test_a_folder_s_unet_on_a_worker_equals_plain_diffusers_follows_a_change_and_stops_at_reset(on_workers, tmp_path):
    folder = tiny.save("sd", tmp_path / "sd", variant_fp16=False)
    plain, pipe = _two_loads(folder)
    calls = _calls(plain, "sd")
    wanted = [_images(plain, call) for call in calls]
    hook = _dispatched(pipe)
    workers = hook.ranks
    assert workers is not None and workers.sent == [0]  # the worker loaded every tensor from the folder itself
    (pid,) = hook.pids()
    assert pid != os.getpid() and pid in [p.pid for p in psutil.Process().children(recursive=True)]
    steps = calls[0]["num_inference_steps"]
    for call, want, worker_calls in zip(calls, wanted, [steps, steps, 0], strict=True):
        workers.served.clear()
        torch.testing.assert_close(_images(pipe, call), want, atol=1e-4, rtol=0)
        assert workers.served == [pid] * worker_calls  # the second half of each batch computed in the worker

    # a change after placing (load_state_dict into one weight) reaches the worker: only that tensor is sent
    weight = plain.unet.conv_in.weight
    changed = {"conv_in.weight": weight.detach() * 0.5}
    for each in (plain, pipe):
        each.unet.load_state_dict(changed, strict=False)
    torch.testing.assert_close(_images(pipe, calls[0]), _images(plain, calls[0]), atol=1e-4, rtol=0)
    assert pipe.unet._hf_hook.ranks is workers and workers.sent == [1] and hook.pids() == []  # old hook detached
    assert pipe.unet._hf_hook.pids() == [pid]  # the same worker, brought in line

    pipemap.reset(pipe)
    deadline = time.monotonic() + 10
    while _workers_alive([pid]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _workers_alive([pid]) == [] and _worker_children() == []


@pytest.mark.slow
def test_a_replaced_unet_stops_the_old_ones_workers_and_runs_on_its_own(on_workers):
    import copy

    pipe = tiny.build("sd")
    pipe.set_progress_bar_config(disable=True)
    call = _calls(pipe, "sd")[0]
    other = copy.deepcopy(pipe.unet)  # before dispatch: a placed pipeline's models refuse deepcopy
    with torch.no_grad():
        other.conv_in.weight.mul_(0.5)
    hook = _dispatched(pipe)
    _images(pipe, call)
    (old,) = hook.pids()
    previous = pipe.unet  # kept, as a user keeps a model to swap back later: its workers must stop all the same
    pipemap.replace_component(pipe, "unet", other)
    deadline = time.monotonic() + 10
    while _workers_alive([old]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _workers_alive([old]) == [] and previous.device.type == "cpu"  # stopped now, not when it is collected
    got = _images(pipe, call)
    new = pipe.unet._hf_hook
    assert isinstance(new, ReplicaHook) and new.runtime == "process" and new.pids() and new.pids() != [old]
    pipemap.reset(pipe)
    plain = tiny.build("sd")
    plain.set_progress_bar_config(disable=True)
    plain.unet = other
    torch.testing.assert_close(got, _images(plain, call), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_a_worker_killed_between_calls_is_replaced_and_one_killed_during_a_call_raises_in_bounded_time(on_workers):
    pipe = tiny.build("sdxl")  # built in code: no folder, every tensor sent to the worker
    pipe.set_progress_bar_config(disable=True)
    call = tiny.default_call(pipe, "sdxl")
    want = _images(pipe, call)
    hook = _dispatched(pipe)
    assert hook.ranks is not None and hook.ranks.sent == [len(pipe.unet.state_dict())]
    torch.testing.assert_close(_images(pipe, call), want, atol=1e-4, rtol=0)

    (first,) = hook.pids()
    os.kill(first, signal.SIGKILL)  # between calls: the next call starts a new worker and gives the same image
    hook.ranks.ranks[0].process.join(timeout=10)
    torch.testing.assert_close(_images(pipe, call), want, atol=1e-4, rtol=0)
    (second,) = hook.pids()
    assert second != first and hook.ranks.served[-1] == second

    def kill_once(module, args):  # the home half runs here, the worker's half was sent: kill the worker now
        handle.remove()
        os.kill(second, signal.SIGKILL)

    handle = pipe.unet.conv_in.register_forward_pre_hook(kill_once)
    started = time.monotonic()
    with pytest.raises(WorkerDiedError) as caught:
        _images(pipe, call)
    assert time.monotonic() - started < BOUND_S
    assert (caught.value.component, caught.value.pid, caught.value.phase) == ("unet", second, "call")
    assert caught.value.exitcode == -signal.SIGKILL and hook.pids() == []  # the workers were stopped
    torch.testing.assert_close(_images(pipe, call), want, atol=1e-4, rtol=0)  # the next call starts a new one
    (third,) = hook.pids()

    del pipe, hook, caught  # a pipeline collected takes its workers with it (the error's frames held it)
    gc.collect()
    deadline = time.monotonic() + 10
    while _workers_alive([third]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _workers_alive([third]) == []


_CALLER = """
import os, sys, time
os.environ["PIPEMAP_WORKERS"] = "process"
import pipemap
from pipemap import tiny
pipe = tiny.build("sd")
plan = pipemap.plan(pipe, hardware="2x8MiB,cpu=1GiB", strategy="parallel", headroom=0.0)
pipemap.dispatch(pipe, plan.remap({"cuda:0": "cpu", "cuda:1": "cpu"}))
print("workers", *pipe.unet._hf_hook.pids(), flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_workers_exit_when_the_caller_s_process_dies():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": SOURCE}
    caller = subprocess.Popen([sys.executable, "-c", _CALLER], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True, env=env)
    try:
        line = caller.stdout.readline() if caller.stdout else ""
        assert line.startswith("workers "), line
        (pid,) = [int(p) for p in line.split()[1:]]
        assert _workers_alive([pid]) == [pid]
    finally:
        caller.kill()  # no atexit, no finalizer: the worker must see its parent gone by itself
        caller.wait(timeout=30)
    deadline = time.monotonic() + 10
    while _workers_alive([pid]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _workers_alive([pid]) == []


@pytest.mark.slow
def test_a_pair_the_copy_check_staged_runs_its_replica_workers_staged_and_equal_to_plain(on_workers, tmp_path):
    from pipemap.hooks.groups import P2P_ENV
    from pipemap.runtime import transfer

    folder = tiny.save("sd", tmp_path / "sd", variant_fp16=False)
    plain, pipe = _two_loads(folder)
    call = tiny.default_call(plain, "sd")
    want = _images(plain, call)
    planned = plan_bytes(pipe)
    transfer.stage_pair("cpu", "cpu")  # the verdict for the ranks' pair once remapped (both planned GPUs are cpu)
    try:
        hook = _dispatched(pipe)
        torch.testing.assert_close(_images(pipe, call), want, atol=1e-4, rtol=0)
        workers = hook.ranks
        assert workers is not None and workers.staged and workers.served  # a staged worker computed
        assert [h["staged"] for h in workers.hellos] == [True] and workers.hellos[0][P2P_ENV] == "1"
        assert "through host memory" in workers.describe()
        # what the worker holds on its device (cuda:1 in the plan) is the plan's figure for the unet's copy there
        assert workers.held() == [planned]
    finally:
        pipemap.reset(pipe)
        transfer.clear_staged()
