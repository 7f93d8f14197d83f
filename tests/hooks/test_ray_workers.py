"""``PIPEMAP_WORKERS=ray`` (``hooks/ray_workers.py``): the worker processes as Ray actors in one placement group, on a
local Ray with CPU resources only; the driver logic is ``workers.py``'s. Slow: each test starts actors."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest
import torch

import pipemap
from helpers import processes_gone, with_copy
from pipemap import tiny
from pipemap.errors import RayPlacementError, WorkerCallError, WorkerDiedError
from pipemap.hooks.launch import TIMEOUT_ENV
from pipemap.hooks.worker import Source, caller_state
from pipemap.hooks.workers import ENV, Workers

ray = pytest.importorskip("ray", reason="the Ray worker tests need ray: pip install -e '.[ray]'")
from ray.util.placement_group import placement_group_table  # noqa: E402

from pipemap.hooks.ray_workers import Channel  # noqa: E402

CPU = torch.device("cpu")
ON_CPU = {"cuda:0": "cpu", "cuda:1": "cpu"}


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray of 3 logical CPUs (loopback): room for two workers' bundles, not for three."""
    ray.init(address="local", num_cpus=3, num_gpus=0, include_dashboard=False, _node_ip_address="127.0.0.1",
             object_store_memory=100 * 2**20, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture
def on_ray(local_ray, monkeypatch):
    monkeypatch.setenv(ENV, "ray")
    monkeypatch.setenv(TIMEOUT_ENV, "60")


def _removed(group, seconds: float = 10) -> bool:
    """Whether Ray records ``group`` as removed within ``seconds`` (it does so a moment after the call)."""
    deadline = time.monotonic() + seconds
    while placement_group_table(group)["state"] != "REMOVED":
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.slow
def test_workers_as_ray_actors_compute_in_one_strict_pack_group_and_leave_nothing_at_close(on_ray):
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    workers = Workers("m", CPU, (CPU, CPU))
    try:
        workers.sync(module, Source.of(module))  # built in code: its two tensors sent to each actor
        assert workers.sent == [2, 2] and workers.running
        group = workers.launcher.group
        table = placement_group_table(group)
        assert (table["strategy"], table["state"]) == ("STRICT_PACK", "CREATED")
        assert list(table["bundles"].values()) == [{"CPU": 1.0}, {"CPU": 1.0}]  # one bundle per worker
        pids = [ray.get(r.process.actor.pid.remote()) for r in workers.ranks]  # each an actor's own process
        assert pids == workers.pids() and len(set(pids)) == 2 and os.getpid() not in pids
        x, y = torch.randn(4, 3), torch.randn(5, 3)
        with torch.no_grad():
            got = workers.receive(workers.send([((x,), {}), ((y,), {})], caller_state()))
        torch.testing.assert_close(got, [module(x).detach(), module(y).detach()], atol=0, rtol=0)
        assert workers.served == pids
        with pytest.raises(WorkerCallError) as caught:  # the actor's error, typed, with its traceback
            workers.receive(workers.send([((torch.randn(4, 5),), {})], caller_state()))
        assert "mat1 and mat2" in caught.value.remote_traceback and not workers.running
        assert _removed(group) and processes_gone(pids, 30)  # stopped, and their group removed
    finally:
        workers.close()


@pytest.mark.slow
def test_a_ray_worker_killed_between_calls_is_replaced_and_one_killed_mid_call_raises_in_bounded_time(on_ray):
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    workers = Workers("m", CPU, (CPU,))
    x = torch.randn(4, 3)
    try:
        workers.sync(module, Source.of(module))
        (first,) = workers.pids()
        os.kill(first, signal.SIGKILL)
        assert processes_gone([first], 30)
        assert not workers.running  # the next sync starts a new actor
        workers.sync(module, Source.of(module))
        (second,) = workers.pids()
        assert second != first
        with torch.no_grad():
            torch.testing.assert_close(workers.receive(workers.send([((x,), {})], caller_state()))[0],
                                       module(x), atol=0, rtol=0)
        call = workers.send([((x,), {})], caller_state())
        os.kill(second, signal.SIGKILL)  # during a call: its output never comes
        started = time.monotonic()
        with pytest.raises(WorkerDiedError) as caught:
            workers.receive(call)
        assert time.monotonic() - started < 60 and caught.value.pid == second and not workers.running
    finally:
        workers.close()


@pytest.mark.slow
def test_a_group_ray_cannot_place_is_a_typed_error_with_the_bundles_and_what_is_free(on_ray, monkeypatch):
    monkeypatch.setenv(TIMEOUT_ENV, "2")
    workers = Workers("unet", CPU, (CPU, CPU, CPU, CPU))  # four bundles of a CPU each; the local Ray has three
    with pytest.raises(RayPlacementError) as caught:
        workers.sync(torch.nn.Linear(3, 2), Source.of(torch.nn.Linear(3, 2)))
    assert caught.value.bundles == [{"CPU": 1.0}] * 4 and caught.value.timeout_s == 2.0
    assert caught.value.available.get("CPU", 0) <= 3 and not workers.ranks and workers.launcher is None
    assert "PIPEMAP_WORKERS=process" in str(caught.value)
    deadline = time.monotonic() + 10  # the group was removed (Ray records that a moment later)
    while any(t["state"] == "PENDING" for t in placement_group_table().values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(t["state"] != "PENDING" for t in placement_group_table().values())


def test_the_channel_takes_only_a_connection_that_sends_its_token():
    listener = socket.create_server(("127.0.0.1", 0))
    channel = Channel(listener, b"t" * 32)
    stranger = socket.create_connection(listener.getsockname()[:2])
    stranger.sendall(b"\x00\x00\x00\x05hello")  # a framed message, not the token: closed unread
    assert not channel.poll(1.0) and channel.connection is None
    with pytest.raises(OSError, match="not connected"):
        channel.send(("call",))
    import multiprocessing.connection

    ours = socket.create_connection(listener.getsockname()[:2])
    worker = multiprocessing.connection.Connection(ours.detach())
    worker.send_bytes(b"t" * 32)
    worker.send(("ready", {"pid": 1}))
    assert channel.poll(1.0) and channel.recv() == ("ready", {"pid": 1})
    channel.send(("stop",))
    assert worker.recv() == ("stop",)
    worker.close()
    stranger.close()
    channel.close()


@pytest.mark.slow
def test_the_tiny_flux_sequence_split_on_a_ray_actor_equals_plain(on_ray):
    pipe = tiny.build("flux")
    pipe.set_progress_bar_config(disable=True)
    call = dict(tiny.default_call(pipe, "flux", output_type="pt"))
    plain = torch.as_tensor(pipe(**dict(call, generator=torch.Generator().manual_seed(0))).images)
    pipemap.dispatch(pipe, with_copy(pipe, "sequence").remap(ON_CPU))
    hook = pipe.transformer._hf_hook
    (pid,) = hook.pids()
    got = torch.as_tensor(pipe(**dict(call, generator=torch.Generator().manual_seed(0))).images)
    torch.testing.assert_close(got, plain, atol=1e-4, rtol=0)
    assert hook.ranks.served == [pid] * call["num_inference_steps"] and pid != os.getpid()
    assert type(hook.ranks.ranks[0].process).__name__ == "Actor"
    pipemap.reset(pipe)
    assert processes_gone([pid], 30)


@pytest.mark.slow
def test_qwen_image_s_second_guidance_branch_on_a_ray_actor_equals_plain(on_ray):
    import families
    from families import fresh, output

    pipe, call = families.true_cfg("qwen_image", 3)
    plain = output(pipe(**fresh(call)))
    pipemap.dispatch(pipe, with_copy(pipe, "guidance").remap(ON_CPU))
    hook = pipe.transformer._hf_hook
    (pid,) = hook.pids()
    torch.testing.assert_close(output(pipe(**fresh(call))), plain, atol=1e-4, rtol=0)
    assert (hook.hits, hook.misses) == (2, 0) and hook.ranks.served == [pid, pid]  # steps 2 and 3 on the actor
    assert pid != os.getpid() and type(hook.ranks.ranks[0].process).__name__ == "Actor"
    pipemap.reset(pipe)
    assert processes_gone([pid], 30)


@pytest.mark.slow
def test_wan_s_branches_each_split_over_two_ranks_on_three_ray_actors_equal_plain(on_ray):
    # a plan for four GPUs: rank 0 here and a Ray actor per other GPU, each half of the ranks a group of its own
    import families
    from families import fresh, output

    pipe, call = families.true_cfg("wan_t2v", 3)
    plain = output(pipe(**fresh(call)))
    plan = with_copy(pipe, "guidance_sequence", hardware="4x64MiB,cpu=1GiB", copies=3)
    pipemap.dispatch(pipe, plan.remap({f"cuda:{i}": "cpu" for i in range(4)}))
    hook = pipe.transformer._hf_hook
    pids = hook.pids()
    torch.testing.assert_close(output(pipe(**fresh(call))), plain, atol=1e-4, rtol=0)
    assert (hook.hits, hook.misses, hook.whole) == (2, 0, 0)
    assert [hook.ranks.served.count(p) for p in pids] == [4, 2, 2]  # the first half's rank 1; the second half
    assert {type(r.process).__name__ for r in hook.ranks.ranks} == {"Actor"} and os.getpid() not in pids
    pipemap.reset(pipe)
    assert processes_gone(pids, 30)


def test_a_worker_on_a_gpu_asks_ray_for_one_and_sees_rank_0_s_gpus(fake_cuda, monkeypatch):
    # the CUDA branch of the launcher, under the tests' fake CUDA (two GPUs): a driver holding no Ray GPUs gives each
    # GPU rank a bundle with a GPU; every rank sees rank 0's GPUs, so the plan's cuda:1 is the one rank 0 means
    from pipemap.hooks.ray_workers import _bundle, _visible

    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [])
    assert _bundle(torch.device("cuda:1")) == {"CPU": 1.0, "GPU": 1.0} and _bundle(CPU) == {"CPU": 1.0}
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [0, 1])  # a Serve replica holding its plan's GPUs: shared
    assert _bundle(torch.device("cuda:1")) == {"CPU": 1.0}
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _visible() == "0,1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")  # what Ray set for a replica given GPUs 3 and 5
    assert _visible() == "3,5"
