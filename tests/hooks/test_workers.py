"""The worker machinery (``hooks/workers.py``): its settings, the exact digest, tensors left out of a pickle and
put back, the first copy loaded from a folder; workers over a plain module (slow: it starts one). The hooks on
workers run in each mode's test file (``test_replica.py``, ``test_guidance.py``, ``test_sequence.py``,
``test_guidance_sequence.py``: their sections on worker processes)."""

from __future__ import annotations

import os
import socket
from importlib.util import find_spec

import psutil
import pytest
import torch

from pipemap.errors import PipemapError, WorkersOptionError
from pipemap.hooks.launch import TIMEOUT_ENV, timeout_s
from pipemap.hooks.payload import Meta, digest, metas, packed, unpacked
from pipemap.hooks.workers import ENV, workers_mode


def test_workers_mode_defaults_to_processes_and_refuses_other_words(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert workers_mode() == "process"
    monkeypatch.setenv(ENV, " Process ")
    assert workers_mode() == "process"
    monkeypatch.setenv(ENV, "RAY")
    assert workers_mode() == "ray"
    monkeypatch.setenv(ENV, "mpi")
    with pytest.raises(WorkersOptionError) as caught:
        workers_mode()
    assert isinstance(caught.value, PipemapError) and isinstance(caught.value, ValueError)
    assert (caught.value.variable, caught.value.value) == (ENV, "mpi")
    assert caught.value.accepted == ("process", "thread", "ray")
    monkeypatch.setenv(ENV, "ray")
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
    with pytest.raises(WorkersOptionError, match=r"needs Ray, which is not installed \(pip install") as caught:
        workers_mode()  # where Ray is not installed: said at once, not an ImportError at the first call
    assert caught.value.accepted == ("thread", "process")


def test_workers_start_from_a_forkserver_where_the_platform_has_one_or_as_asked(monkeypatch):
    from pipemap.hooks.launch import START_ENV, start_method

    monkeypatch.delenv(START_ENV, raising=False)
    assert start_method() == "forkserver"  # Linux, macOS: a server that imported torch and diffusers once
    monkeypatch.setenv(START_ENV, " Spawn ")
    assert start_method() == "spawn"
    monkeypatch.setenv(START_ENV, "fork")  # never: a fork of the caller would carry its CUDA state
    with pytest.raises(WorkersOptionError, match=START_ENV) as caught:
        start_method()
    assert caught.value.accepted == ("forkserver", "spawn")


def test_the_timeout_is_read_in_seconds_and_must_be_positive(monkeypatch):
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert timeout_s() == 120.0
    monkeypatch.setenv(TIMEOUT_ENV, "2.5")
    assert timeout_s() == 2.5
    for bad in ("0", "soon"):
        monkeypatch.setenv(TIMEOUT_ENV, bad)
        with pytest.raises(WorkersOptionError, match=TIMEOUT_ENV):
            timeout_s()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool])
def test_the_digest_is_exact_and_sees_a_swap_of_two_elements(dtype):
    torch.manual_seed(0)
    values = torch.randn(7, 5) * 10
    tensor = values > 0 if dtype == torch.bool else values.to(dtype)
    assert digest(tensor) == digest(tensor.clone()) == digest(tensor.t().contiguous().t())  # layout does not count
    swapped = tensor.clone().reshape(-1)
    i, j = next((i, j) for i in range(swapped.numel()) for j in range(i + 1, swapped.numel())
                if swapped[i] != swapped[j])
    swapped[i], swapped[j] = tensor.reshape(-1)[j], tensor.reshape(-1)[i]
    assert digest(swapped.reshape(7, 5)) != digest(tensor)  # the same bytes elsewhere
    changed = tensor.clone().reshape(-1)
    changed[i] = changed[j]  # one element changed
    assert digest(changed) != digest(tensor.reshape(-1))
    assert digest(torch.empty(0, dtype=dtype)) == digest(torch.empty(0, 3, dtype=dtype))


def test_the_digest_is_a_hash_two_sums_were_blind_to_a_swap_65521_apart_and_to_balanced_changes():
    # WP12 (../shared/context/worker-repros/digest_collision.py): the digest was two integer sums, the second
    # weighted by position mod 65521; both tensors below kept both sums, so sync kept a worker's stale copy
    n = 2 * 65521 + 8
    base = torch.zeros(n, dtype=torch.int32)
    base[3], base[3 + 65521] = 7, 11
    swapped = base.clone()
    swapped[3], swapped[3 + 65521] = 11, 7
    balanced = base.clone()
    balanced[5] += 4
    balanced[5 + 65521] -= 4
    assert len({digest(base), digest(swapped), digest(balanced)}) == 3


def test_a_structure_travels_without_its_tensors_which_are_sent_or_kept_by_name():
    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU())
    extra = torch.arange(4.0)
    data, sent = packed({"module": module, "extra": extra, "n": 3}, keep={id(module[0].weight): "0.weight"})
    assert len(data) < 2000 and [t.shape for t in sent] == [torch.Size([2]), torch.Size([4])]  # bias and extra
    assert metas(sent) == [Meta((2,), torch.float32), Meta((4,), torch.float32)]
    mine = torch.nn.Parameter(torch.ones(2, 3), requires_grad=False)  # the receiver's own weight, kept by name
    back = unpacked(data, [t.clone() for t in sent], {"0.weight": mine})
    assert back["n"] == 3 and back["module"][0].weight is mine
    torch.testing.assert_close(back["module"][0].bias, module[0].bias.detach(), atol=0, rtol=0)
    assert isinstance(back["module"][0].bias, torch.nn.Parameter) and not back["module"][0].bias.requires_grad
    torch.testing.assert_close(back["extra"], extra, atol=0, rtol=0)


def test_a_worker_loads_from_the_folder_a_model_came_from_and_nothing_for_one_built_in_code(tmp_path):
    from diffusers import AutoencoderKL

    from pipemap.hooks.worker import Source

    built = AutoencoderKL(block_out_channels=(8,), norm_num_groups=8, latent_channels=2)
    size = sum(p.numel() * 4 for p in built.parameters()) + sum(b.numel() * 4 for b in built.buffers())
    assert Source.of(built) == Source("diffusers.models.autoencoders.autoencoder_kl", "AutoencoderKL", None,
                                      torch.float32, size)  # its bytes: what its load reads (the load's bound)
    built.save_pretrained(tmp_path / "vae")
    loaded = AutoencoderKL.from_pretrained(tmp_path / "vae", torch_dtype=torch.float16)
    source = Source.of(loaded)
    assert (source.folder, source.dtype) == (str(tmp_path / "vae"), torch.float16)
    again = source.load(torch.device("cpu"))  # what the worker does first
    assert again is not None and not again.training
    digests = [{n: digest(t) for n, t in m.state_dict().items()} for m in (again, loaded)]
    assert digests[0] == digests[1]


@pytest.mark.slow
def test_workers_on_a_plain_module_compute_and_a_failing_call_raises_with_the_worker_s_traceback():
    from pipemap.errors import WorkerCallError
    from pipemap.hooks.worker import Source, caller_state
    from pipemap.hooks.workers import Workers

    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    cpu = torch.device("cpu")
    workers = Workers("m", cpu, (cpu,))
    try:
        workers.sync(module, Source.of(module))  # built in code: no folder, its two tensors sent
        assert workers.sent == [2] and workers.running
        x = torch.randn(4, 3)
        with torch.no_grad():
            (out,) = workers.receive(workers.send([((x,), {})], caller_state()))
            torch.testing.assert_close(out, module(x), atol=0, rtol=0)
        assert workers.served == workers.pids() and workers.pids()[0] != os.getpid()
        with pytest.raises(WorkerCallError) as caught:  # a call the module refuses: its error, typed, comes back
            workers.receive(workers.send([((torch.randn(4, 5),), {})], caller_state()))
        assert "mat1 and mat2" in caught.value.remote_traceback and caught.value.phase == "call"
        assert not workers.running  # stopped: the next sync starts new ones
    finally:
        workers.close()


def test_a_call_names_the_tensors_the_worker_holds_from_the_last_call_and_sends_the_rest():
    from pipemap.hooks.payload import Inputs, received_inputs

    inputs, held = Inputs(), {}
    embeds, latents = torch.randn(2, 3), torch.randn(2, 4)
    data, sent, names = inputs.packed(((latents,), {"encoder_hidden_states": embeds}))
    assert len(sent) == 2 and len(names) == 2
    (args, kwargs), held = received_inputs(data, [t.clone() for t in sent], names, held)
    step = torch.randn(2, 4)  # the next step: new latents, the same embeddings
    data, sent, names = inputs.packed(((step,), {"encoder_hidden_states": embeds}))
    assert [t.shape for t in sent] == [torch.Size([2, 4])]  # the embeddings are named, not sent
    (args, kwargs), held = received_inputs(data, [t.clone() for t in sent], names, held)
    torch.testing.assert_close(args[0], step, atol=0, rtol=0)
    torch.testing.assert_close(kwargs["encoder_hidden_states"], embeds, atol=0, rtol=0)
    embeds.mul_(2)  # written in place: its version moved, so it is sent again (the latents, unchanged, are not)
    data, sent, names = inputs.packed(((step,), {"encoder_hidden_states": embeds}))
    assert [t.shape for t in sent] == [torch.Size([2, 3])]
    (args, kwargs), held = received_inputs(data, [t.clone() for t in sent], names, held)
    torch.testing.assert_close(kwargs["encoder_hidden_states"], embeds, atol=0, rtol=0)
    with torch.inference_mode():  # an inference tensor keeps no version: always sent
        frozen = torch.randn(2, 3)
    inputs.packed(((step,), {"encoder_hidden_states": frozen}))
    assert [t.shape for t in inputs.packed(((step,), {"encoder_hidden_states": frozen}))[1]] == [torch.Size([2, 3])]


@pytest.mark.slow
def test_a_pair_the_copy_check_staged_starts_its_workers_staged_and_they_still_compute(monkeypatch):
    from pipemap.hooks.groups import P2P_ENV
    from pipemap.hooks.launch import start_method
    from pipemap.hooks.worker import SETUP_ENV, Source, caller_state
    from pipemap.hooks.workers import Workers
    from pipemap.runtime import transfer

    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    cpu = torch.device("cpu")
    workers = Workers("m", cpu, (cpu,))
    transfer.stage_pair("cpu", "cpu")  # the verdict the copy check records for a corrupting pair (rank 0 -> rank 1)
    try:
        workers.sync(module, Source.of(module))
        assert workers.staged and workers.hellos[0]["staged"] and workers.hellos[0][P2P_ENV] == "1"
        assert P2P_ENV not in os.environ  # rank 0 set it only while its communicator started
        assert "through host memory" in workers.describe() and "copy check" in workers.describe()
        x = torch.randn(4, 3)
        with torch.no_grad():
            (out,) = workers.receive(workers.send([((x,), {})], caller_state()))
        torch.testing.assert_close(out, module(x), atol=0, rtol=0)
    finally:
        workers.close()
        transfer.clear_staged()
    # set after the forkserver started (the first workers above): each worker still runs in the caller's environment
    # of its start, as a spawned one does
    monkeypatch.setenv(SETUP_ENV, "os:getpid")
    unstaged = Workers("m", cpu, (cpu,))
    try:
        unstaged.sync(module, Source.of(module))
        assert not unstaged.staged and unstaged.hellos[0] == {
            "pid": unstaged.pids()[0], "host": socket.gethostname(), "staged": False, "gloo": False,
            P2P_ENV: os.environ.get(P2P_ENV), "setup": ["os:getpid"]}
        forked = start_method() == "forkserver"  # by the server, not by this process
        assert (psutil.Process(unstaged.pids()[0]).ppid() != os.getpid()) == forked
        assert unstaged.describe() == "'m': ranks on cpu, cpu, exchanging directly"
    finally:
        unstaged.close()


def test_ranks_sharing_a_gpu_run_on_gloo_through_the_host_as_nccl_takes_one_rank_per_gpu():
    from pipemap.hooks.groups import shared_gpu, wire

    cuda0, cuda1, cpu = torch.device("cuda:0"), torch.device("cuda:1"), torch.device("cpu")
    assert shared_gpu((cuda0, cuda0)) and shared_gpu((torch.device("cuda"), cuda0))
    assert shared_gpu((cuda0, cuda1, cuda1))
    assert not shared_gpu((cuda0, cuda1)) and not shared_gpu((cpu, cpu)) and not shared_gpu((cuda0, cpu))
    assert wire(cuda0, True) == cpu and wire(cuda0, False) == cuda0 and wire(cpu, False) == cpu


def test_the_transport_of_a_staged_gpu_pair_is_decided_once_per_process(monkeypatch):
    # WP5: NCCL reads NCCL_P2P_DISABLE once per process, at its first communicator (no GPU needed: the decision only)
    from pipemap.hooks import groups

    monkeypatch.delenv(groups.P2P_ENV, raising=False)
    monkeypatch.setattr(groups, "_NCCL_MADE", [])
    monkeypatch.setattr(groups.dist, "is_nccl_available", lambda: False)  # a CPU build (the fake CUDA): gloo
    assert groups.nccl_transport(staged=False, cuda=True) == "gloo"
    assert groups.nccl_transport(staged=True, cuda=False) == "direct"
    monkeypatch.setattr(groups.dist, "is_nccl_available", lambda: True)
    assert groups.nccl_transport(staged=False, cuda=True) == "direct"
    assert groups.nccl_transport(staged=True, cuda=False) == "direct"  # gloo goes through the host anyway
    assert groups.nccl_transport(staged=True, cuda=True) == "p2p_off"  # the process's first group: off for all
    assert os.environ[groups.P2P_ENV] == "1"
    monkeypatch.delenv(groups.P2P_ENV)
    monkeypatch.setattr(groups, "_NCCL_MADE", [True])  # a communicator already runs with peer-to-peer on
    assert groups.nccl_transport(staged=True, cuda=True) == "gloo" and groups.P2P_ENV not in os.environ


@pytest.mark.slow
def test_a_replica_worker_of_a_process_under_the_fake_cuda_runs_its_cuda_branch_and_equals_plain(fake_cuda,
                                                                                                  tiny_folders):
    # issue 48: the fake runs inside the workers (PIPEMAP_WORKER_SETUP), so their CUDA branches run in CI: a plan for
    # two GPUs NOT remapped, the worker's copy loaded from the folder onto its fake cuda:1, its allocator's peak
    # reported, gloo where this torch has no NCCL (the fake has none)
    from diffusers import DiffusionPipeline

    import fakecuda
    import pipemap
    from pipemap import tiny
    from pipemap.hooks.worker import SETUP_ENV

    plain, pipe = (DiffusionPipeline.from_pretrained(tiny_folders["sd"]) for _ in range(2))
    for each in (plain, pipe):
        each.set_progress_bar_config(disable=True)
    call = dict(tiny.default_call(plain, "sd"), num_images_per_prompt=2, output_type="pt")  # a batch of 4: 2 + 2
    want = plain(**dict(call, generator=torch.Generator().manual_seed(0))).images
    plan = pipemap.plan(pipe, hardware="2x8MiB,cpu=1GiB", strategy="parallel", headroom=0.0)  # unet 3.0 MiB
    assert plan.placement("unet").mode == "replicated" and plan.placement("unet").replicas == ("cuda:1",)
    pipemap.dispatch(pipe, plan, ranks="process")
    try:
        got = pipe(**dict(call, generator=torch.Generator().manual_seed(0))).images
        workers = pipe.unet._hf_hook.ranks
        assert os.environ[SETUP_ENV] == fakecuda.SETUP and workers.hellos[0]["setup"] == [fakecuda.SETUP]
        assert workers.pids()[0] != os.getpid() and workers.sent == [0]  # its copy read from the folder by itself
        assert workers.transport == "gloo" and workers.hellos[0]["gloo"]  # not NCCL: the fake has none
        assert workers.describe() == "'unet': ranks on cuda:0, cuda:1, exchanging over gloo: this torch has no NCCL"
        assert workers.peaks()["cuda:1"] >= plan.placement("unet").bytes  # its copy sat on its fake GPU
        torch.testing.assert_close(fakecuda.host(got), want, atol=1e-4, rtol=0)
    finally:
        pipemap.reset(pipe)


def test_a_worker_that_cannot_take_its_gpu_says_why_and_what_to_do_before_it_says_it_lives():
    # this CPU build's CUDA refuses ``set_device`` as a forked worker's CUDA does when the forkserver initialised
    # CUDA before the fork: rank 0 gets the worker's own error, typed, with the way out (a fresh start)
    from pipemap.errors import WorkerCallError
    from pipemap.hooks.worker import Source
    from pipemap.hooks.workers import Workers

    module = torch.nn.Linear(3, 2)
    workers = Workers("m", torch.device("cpu"), (torch.device("cuda:1"),))
    try:
        with pytest.raises(WorkerCallError) as caught:
            workers.sync(module, Source.of(module))
    finally:
        workers.close()
    assert caught.value.phase == "start" and "set_device" in caught.value.remote_traceback
    assert "PIPEMAP_WORKER_START=spawn" in caught.value.remote_traceback
    assert not workers.running


@pytest.mark.parametrize("before", [None, "0"])
def test_a_worker_s_start_checks_cuda_by_nvml_and_leaves_the_caller_s_environment_as_it_was(monkeypatch, before):
    # the forkserver starts with the first worker and inherits the environment of that moment: torch's NVML check
    # then answers ``torch.cuda.is_available()`` in a module it imports without initialising CUDA before its forks
    from pipemap.hooks.launch import NVML_ENV, _nvml_check

    if before is None:
        monkeypatch.delenv(NVML_ENV, raising=False)
    else:
        monkeypatch.setenv(NVML_ENV, before)
    with _nvml_check():
        assert os.environ[NVML_ENV] == "1"
    assert os.environ.get(NVML_ENV) == before


def test_a_call_s_small_tensors_of_one_dtype_travel_as_one_message_a_large_one_alone():
    from pipemap.hooks.groups import BATCH_BYTES, messages

    f32, i64 = torch.float32, torch.int64
    big = (BATCH_BYTES // 4 + 1,)  # one float32 more than a message holds
    metas = [((1, 64, 16), f32), ((1,), f32), ((0,), f32), ((2,), i64), ((3,), i64), (big, f32), ((4,), f32)]
    assert messages(metas) == [[0, 1], [3, 4], [5], [6]]  # the empty one in none


def test_tensors_batched_into_one_message_arrive_whole_and_in_order_over_gloo():
    import threading

    from pipemap.hooks.groups import forget, joined, listener, receive_tensors, send_tensors
    from pipemap.hooks.payload import Meta

    sent = [torch.randn(1, 64, 16), torch.tensor([0.5]), torch.arange(6).reshape(2, 3), torch.empty(0),
            torch.randn(5)]
    server = listener("127.0.0.1")
    port = server.getsockname()[1]
    store = torch.distributed.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False,
                                       master_listen_fd=server.detach())
    cpu, got, groups = torch.device("cpu"), [], []

    def other() -> None:
        peer = torch.distributed.TCPStore("127.0.0.1", port, 2, is_master=False)
        group = joined(peer, 1, 2, cpu, 30, "test-batched-1", True, "127.0.0.1")  # a name each: one registry
        groups.append(group)
        got.extend(receive_tensors(group, [Meta(tuple(t.shape), t.dtype) for t in sent], 0, cpu))

    receiver = threading.Thread(target=other)
    receiver.start()
    group = joined(store, 0, 2, cpu, 30, "test-batched-0", True, "127.0.0.1")
    for work, _tensor in send_tensors(group, sent, 1, cpu):
        work.wait()
    receiver.join(30)
    for each in (group, *groups):
        forget(each)
    assert len(got) == len(sent)
    for a, b in zip(got, sent):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
