"""One call's tokens split across GPUs (``hooks/sequence.py``, mode ``"sequence"``): diffusers' context-parallel
plan and Ulysses attention, the ranks threads over the GPUs exchanging through ``hooks/exchange.py``. On two stand-in
GPUs (the dry run), remapped onto the CPU (outputs within float tolerance of the plain pipeline's), and by hand.

On worker processes (the tests below the line): the tiny Flux's transformer split between this process (rank 0) and a
worker process (rank 1) over a real gloo group, diffusers' context-parallel plan and Ulysses attention exchanging
between the processes."""

from __future__ import annotations

import os
import threading
import time

import psutil
import pytest
import torch
import torch.distributed._functional_collectives as funcol

import fakecuda
import pipemap
from families import build, fresh, output
from helpers import pipeline_state, plain_pipeline, run, split_tolerance, with_copy
from pipemap import tiny
from pipemap.errors import DispatchError, PlanMismatchError
from pipemap.hooks import SequenceHook
from pipemap.hooks.context import all_gather_op, gather
from pipemap.hooks.exchange import release, thread_groups
from pipemap.hooks.launch import TIMEOUT_ENV
from pipemap.hooks.workers import ENV

ON_CPU = {f"cuda:{i}": "cpu" for i in range(4)}
TOLERANCE = split_tolerance(operation="attention")  # attention in shards sums in another order


def tiny_flux():
    pipe = tiny.build("flux")
    pipe.set_progress_bar_config(disable=True)
    return pipe, dict(tiny.default_call(pipe, "flux", output_type="pt"))


def _run(pipe, call) -> torch.Tensor:
    return torch.as_tensor(pipe(**dict(call, generator=torch.Generator().manual_seed(0))).images)


# ---- on two stand-in GPUs ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_dry_run_splits_the_tiny_flux_across_two_stand_ins_within_budget():
    pipe, _ = tiny_flux()
    plan = with_copy(pipe, "sequence")
    report = pipemap.simulate(pipe, plan, steps=2)
    assert report.ok, report.error
    assert report.weight_bytes["cuda:1"] >= plan.placement("transformer").bytes
    assert report.activation_bytes["cuda:1"] > 0 and report.peak_phase["cuda:1"].startswith("denoising")
    for device in plan.devices:
        assert report.peak_bytes[device.device] <= device.budget


# ---- remapped onto the CPU -------------------------------------------------------------------------------------


def test_the_tiny_flux_split_on_the_cpu_equals_plain_and_reset_leaves_no_trace():
    pipe, call = tiny_flux()
    plain = _run(pipe, call)
    before = pipeline_state(pipe)
    pipemap.dispatch(pipe, with_copy(pipe, "sequence").remap(ON_CPU))
    hook = pipe.transformer._hf_hook
    assert isinstance(hook, SequenceHook) and hook.runtime == "thread" and len(hook.replicas) == 1
    tokens: list[int] = []
    threads: list[str] = []

    def seen(module, args, kwargs):
        tokens.append(kwargs["hidden_states"].shape[1])
        threads.append(threading.current_thread().name)

    handles = [rank.transformer_blocks[0].register_forward_pre_hook(seen, with_kwargs=True)
               for rank in (hook.home, *hook.replicas)]
    torch.testing.assert_close(_run(pipe, call), plain, **TOLERANCE)
    latent_tokens = (32 // 8) ** 2 * 4  # 32x32 pixels, a 2x VAE, 2x2 patches packed: 64 tokens, 32 for each rank
    assert sorted(set(tokens)) == [latent_tokens // 2] and hook.whole == 0
    assert threading.main_thread().name in threads and any(t.startswith("pipemap-transformer") for t in threads)
    for handle in handles:
        handle.remove()
    pipemap.reset(pipe)
    assert pipeline_state(pipe) == before and hook.ranks is None and hook.home is None and hook.replicas == []


@pytest.mark.slow
def test_a_folder_loaded_onto_a_sequence_plan_equals_plain(tmp_path):
    folder = str(tiny.save("flux", tmp_path / "flux"))
    plain = plain_pipeline(folder)
    pipe = pipemap.load(folder, plan=with_copy(plain, "sequence").remap(ON_CPU))
    assert isinstance(pipe.transformer._hf_hook, SequenceHook)
    assert pipe.transformer.device.type == "cpu" and pipe.transformer._hf_hook.replicas[0].device.type == "cpu"
    torch.testing.assert_close(run(pipe, "flux"), run(plain, "flux"), **TOLERANCE)


def test_requests_overlapped_by_run_many_take_turns_on_the_split_transformer():
    pipe, call = tiny_flux()
    calls = [dict(call, prompt=p) for p in ("a tiny cat", "a tiny dog", "a tiny bird")]
    plain = [_run(pipe, c) for c in calls]
    pipemap.dispatch(pipe, with_copy(pipe, "sequence").remap(ON_CPU))
    results = pipemap.run_many(pipe, [dict(c, generator=torch.Generator().manual_seed(0)) for c in calls], workers=2)
    for got, want in zip(results, plain, strict=True):
        torch.testing.assert_close(torch.as_tensor(got.images), want, **TOLERANCE)
    assert pipe.transformer._hf_hook.whole == 0


def test_a_call_whose_tokens_do_not_divide_runs_whole_and_equals_plain():
    pipe, call = tiny_flux()
    call = dict(call, max_sequence_length=31)  # 31 text tokens: no even share for two GPUs
    plain = _run(pipe, call)
    pipemap.dispatch(pipe, with_copy(pipe, "sequence").remap(ON_CPU))
    torch.testing.assert_close(_run(pipe, call), plain, **TOLERANCE)
    assert pipe.transformer._hf_hook.whole == call["num_inference_steps"]


@pytest.mark.parametrize("name", ["flux_fill", "flux_kontext", "wan_t2v", "wan_i2v"])
def test_families_with_a_context_parallel_plan_split_and_equal_plain(name):
    pipe, call = build(name)
    plain = output(pipe(**fresh(call)))
    pipemap.dispatch(pipe, with_copy(pipe, "sequence").remap(ON_CPU))
    torch.testing.assert_close(output(pipe(**fresh(call))), plain, **TOLERANCE)
    assert pipe.transformer._hf_hook.whole == 0


def test_dispatch_refuses_what_cannot_split_and_leaves_the_pipeline_as_it_was():
    pipe, _ = build("qwen_image")  # 3 attention heads: no even share of them for two GPUs
    before = pipeline_state(pipe)
    with pytest.raises(DispatchError) as caught:
        pipemap.dispatch(pipe, with_copy(pipe, "sequence").remap(ON_CPU))
    assert isinstance(caught.value.cause, PlanMismatchError)
    assert "3 attention heads do not divide among 2 GPUs" in str(caught.value)
    assert pipeline_state(pipe) == before
    sd = tiny.build("sd")
    with pytest.raises(DispatchError, match="no context-parallel plan"):
        pipemap.dispatch(sd, with_copy(sd, "sequence", component="unet").remap(ON_CPU))
    ltx, _ = build("ltx")  # a context-parallel plan diffusers' own path does not run exactly
    with pytest.raises(DispatchError, match="its attention mask keeps every head"):
        pipemap.dispatch(ltx, with_copy(ltx, "sequence").remap(ON_CPU))


# ---- by hand: the threads' process group ---------------------------------------------------------------------


def _on_threads(ranks: int, work) -> list:
    results: list = [None] * ranks
    threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, work(r))) for r in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results


def test_the_thread_group_all_to_all_and_all_gather_as_torch_distributed_would():
    groups = thread_groups(3, "test")
    try:
        def work(rank):
            mine = torch.arange(6.0) + 10 * rank  # rank r sends its elements 2k, 2k+1 to rank k
            swapped = funcol.wait_tensor(funcol.all_to_all_single(mine, None, None, groups[rank]))
            return swapped, gather(torch.full((1, 2), float(rank)), 1, groups[rank])

        results = _on_threads(3, work)
    finally:
        release(groups)
    for rank, (swapped, gathered) in enumerate(results):
        want = torch.tensor([2.0 * rank + 10 * r + k for r in range(3) for k in range(2)])
        torch.testing.assert_close(swapped, want, atol=0, rtol=0)
        torch.testing.assert_close(gathered, torch.tensor([[0.0, 0.0, 1.0, 1.0, 2.0, 2.0]]), atol=0, rtol=0)


def test_a_failing_rank_releases_the_ranks_waiting_for_it():
    groups = thread_groups(2, "test")
    exchange = groups[0].exchange

    def work(rank):
        if rank == 1:
            exchange.abort()  # as a rank that raised does
            return None
        try:
            exchange.swap(0, "mine")
        except threading.BrokenBarrierError:
            return "released"

    try:
        assert _on_threads(2, work)[0] == "released"
    finally:
        release(groups)


# ---- under the fake CUDA (tests/fakecuda.py) --------------------------------------------------------------------


@pytest.mark.slow
def test_the_tiny_flux_split_over_two_fake_gpus_equals_plain_with_no_race(fake_cuda):
    import fakecuda

    pipe, call = tiny_flux()
    plain = _run(pipe, call)
    pipemap.dispatch(pipe, with_copy(pipe, "sequence"))
    hook = pipe.transformer._hf_hook
    assert isinstance(hook, SequenceHook)
    assert [str(r.device) for r in (hook.home, *hook.replicas)] == ["cuda:0", "cuda:1"]
    split = _run(pipe, call)
    assert hook.whole == 0  # both fake GPUs computed their half of the tokens, exchanging through the collectives
    torch.testing.assert_close(fakecuda.host(split), plain, **TOLERANCE)
    pipemap.reset(pipe)


def test_the_all_gather_is_torchs_under_either_name():
    import types

    def old(*args):  # torch 2.11's name, the only one it has
        return "old"

    def new(*args):
        return "new"

    assert all_gather_op(types.SimpleNamespace(all_gather_tensor=old))() == "old"
    assert all_gather_op(types.SimpleNamespace(all_gather_tensor=old, all_gather_single=new))() == "new"


def test_a_gloo_group_over_ranks_sharing_a_gpu_gathers_through_the_host(fake_cuda):
    import datetime
    import socket

    import torch.distributed as dist

    from pipemap.hooks.groups import _group, forget

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=datetime.timedelta(seconds=30))
    group = _group(store, 0, 1, torch.device("cuda:0"), 30.0, "pipemap-test-gloo-gather", gloo=True)
    try:
        assert group.name() == "gloo"
        x = torch.arange(6.0).reshape(1, 6).to("cuda:0")
        joined = gather(x, 1, group)
        assert joined.device == torch.device("cuda:0")
        torch.testing.assert_close(fakecuda.host(joined), torch.arange(6.0).reshape(1, 6), atol=0, rtol=0)
    finally:
        forget(group)


# ---- on worker processes
WORKERS_ON_CPU = {"cuda:0": "cpu", "cuda:1": "cpu"}
TOLERANCE = split_tolerance(operation="attention")  # attention in shards sums in another order




@pytest.mark.slow
def test_the_tiny_flux_split_with_a_worker_process_equals_plain_and_runs_whole_where_tokens_do_not_divide(
        monkeypatch):
    monkeypatch.setenv(ENV, "process")
    monkeypatch.setenv(TIMEOUT_ENV, "60")
    pipe = tiny.build("flux")
    pipe.set_progress_bar_config(disable=True)
    call = dict(tiny.default_call(pipe, "flux", output_type="pt"))
    odd = dict(call, max_sequence_length=31)  # 31 text tokens: no even share for two ranks
    plain, plain_odd = _run(pipe, call), _run(pipe, odd)
    plan = with_copy(pipe, "sequence")
    dry = pipemap.simulate(pipe, plan, advice=False, **{k: v for k, v in call.items() if k != "generator"})
    pipemap.dispatch(pipe, plan.remap(WORKERS_ON_CPU))
    hook = pipe.transformer._hf_hook
    assert isinstance(hook, SequenceHook) and hook.runtime == "process"
    assert hook.ranks is not None and hook.home is not None
    # what the worker holds on its device is what the dry run's stand-in for cuda:1 held, and the plan's figure
    assert hook.ranks.held() == [dry.weights_held("cuda:1")] == [plan.placement("transformer").bytes]
    (pid,) = hook.pids()
    assert pid != os.getpid()
    tokens: list[int] = []
    handle = hook.home.transformer_blocks[0].register_forward_pre_hook(
        lambda m, a, k: tokens.append(k["hidden_states"].shape[1]), with_kwargs=True)
    torch.testing.assert_close(_run(pipe, call), plain, **TOLERANCE)
    latent_tokens = (32 // 8) ** 2 * 4  # 64 latent tokens: 32 for each rank
    assert set(tokens) == {latent_tokens // 2} and hook.whole == 0
    assert hook.ranks.served == [pid] * call["num_inference_steps"]  # the worker ran its share of every call
    handle.remove()
    torch.testing.assert_close(_run(pipe, odd), plain_odd, **TOLERANCE)
    assert hook.whole == odd["num_inference_steps"] and hook.pids() == [pid]  # ran whole here, the worker kept
    pipemap.reset(pipe)
    assert not hasattr(pipe.transformer, "_hf_hook")
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the worker outlived reset"
        time.sleep(0.05)


@pytest.mark.slow
def test_the_tiny_flux_split_with_a_worker_process_on_two_fake_gpus_equals_plain_with_no_race(fake_cuda):
    # the worker runs the fake too (PIPEMAP_WORKER_SETUP): both ranks' CUDA branches, the exchange over gloo through
    # the host (the fake has no NCCL), rank 0's copies and reads checked for order
    pipe, call = tiny_flux()
    plain = _run(pipe, call)
    pipemap.dispatch(pipe, with_copy(pipe, "sequence"), ranks="process")
    try:
        hook = pipe.transformer._hf_hook
        split = _run(pipe, call)
        workers = hook.ranks
        assert hook.runtime == "process" and workers.pids()[0] != os.getpid() and workers.transport == "gloo"
        assert hook.whole == 0  # both fake GPUs computed their half of the tokens
        torch.testing.assert_close(fakecuda.host(split), plain, **TOLERANCE)
    finally:
        pipemap.reset(pipe)
