"""One call's tokens split across worker processes (``hooks/sequence_workers.py``): the tiny Flux's transformer
split between this process (rank 0) and a worker process (rank 1) over a real gloo group, diffusers' own
context-parallel plan and Ulysses attention exchanging between the processes. Slow: it starts a worker."""

from __future__ import annotations

import os
import time

import psutil
import pytest
import torch

import pipemap
from helpers import split_tolerance, with_copy
from pipemap import tiny
from pipemap.hooks.launch import TIMEOUT_ENV
from pipemap.hooks.sequence import SequenceHook
from pipemap.hooks.workers import ENV

ON_CPU = {"cuda:0": "cpu", "cuda:1": "cpu"}
TOLERANCE = split_tolerance(operation="attention")  # attention in shards sums in another order


def _run(pipe, call) -> torch.Tensor:
    return torch.as_tensor(pipe(**dict(call, generator=torch.Generator().manual_seed(0))).images)


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
    pipemap.dispatch(pipe, plan.remap(ON_CPU))
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
