"""Guidance branches at once, each split by its tokens, on worker processes (``hooks/guidance_sequence_workers.py``):
a plan for four GPUs remapped onto the CPU keeps one rank per planned GPU, this process and three workers, each half
a gloo group of its own; outputs equal the plain pipeline's. Slow: each test starts three workers."""

from __future__ import annotations

import copy
import os
import signal
import time

import pytest
import torch

import families
import pipemap
from families import fresh, output
from helpers import processes_gone, split_tolerance, with_copy
from pipemap.hooks.guidance_sequence import GuidanceSequenceHook
from pipemap.hooks.launch import TIMEOUT_ENV
from pipemap.hooks.workers import ENV

ON_CPU = {f"cuda:{i}": "cpu" for i in range(4)}
STEPS = 3
TOLERANCE = split_tolerance(operation="attention")  # attention in shards sums in another order


def _wan(monkeypatch, timeout_s: int):
    """The tiny Wan with true CFG, its plain output, and its plan for four GPUs; worker processes asked for."""
    monkeypatch.delenv(ENV, raising=False)  # as a user runs it: ranks="auto", worker processes
    monkeypatch.setenv(TIMEOUT_ENV, str(timeout_s))
    pipe, call = families.true_cfg("wan_t2v", STEPS)
    plain = output(pipe(**fresh(call)))
    return pipe, call, plain, with_copy(pipe, "guidance_sequence", hardware="4x64MiB,cpu=1GiB", copies=3)


@pytest.mark.slow
def test_wan_s_halves_run_on_three_workers_at_once_equal_plain_and_a_dead_worker_is_replaced(monkeypatch):
    pipe, call, plain, plan = _wan(monkeypatch, 60)
    twin = copy.deepcopy(pipe)  # the plain pipeline a change after placing is made to as well
    extra = {k: v for k, v in fresh(call).items() if k not in ("generator", "num_inference_steps")}
    dry = pipemap.simulate(pipe, plan, steps=2, advice=False, **extra)
    pipemap.dispatch(pipe, plan.remap(ON_CPU))
    hook = pipe.transformer._hf_hook
    assert isinstance(hook, GuidanceSequenceHook) and hook.runtime == "process"
    assert hook.replicas == [] and hook.ranks is not None
    # what each worker holds is what the dry run's stand-in for its GPU held: the plan's figure and Wan's rotary
    # tables (buffers no file holds)
    held = hook.ranks.held()
    assert held == [dry.weights_held(f"cuda:{i}") for i in (1, 2, 3)] and min(held) >= plan.placement(
        "transformer").bytes
    first, second, third = pids = hook.pids()
    assert len(set(pids)) == 3 and os.getpid() not in pids
    # while rank 0 computes a later step's first branch, that step's second is on the second half: both outstanding
    outstanding: list[int] = []
    handle = hook.home.register_forward_pre_hook(lambda m, a: outstanding.append(len(hook.ranks.outstanding)))
    torch.testing.assert_close(output(pipe(**fresh(call))), plain, **TOLERANCE)
    handle.remove()
    assert (hook.hits, hook.misses, hook.whole) == (STEPS - 1, 0, 0)
    assert outstanding == [1, 1] + [2] * (STEPS - 1)
    # rank 1 answered every first-half call (both calls of step 1, the first of each later one); ranks 2 and 3
    # each later step's second call
    served = hook.ranks.served
    assert [served.count(p) for p in pids] == [STEPS + 1, STEPS - 1, STEPS - 1]

    # a change after placing (load_state_dict into one weight) reaches every worker: only that tensor is sent, and
    # the halves are made anew over the same workers
    changed = {"proj_out.weight": twin.transformer.proj_out.weight.detach() * 0.5}
    for each in (twin, pipe):
        each.transformer.load_state_dict(changed, strict=False)
    torch.testing.assert_close(output(pipe(**fresh(call))), output(twin(**fresh(call))), **TOLERANCE)
    hook = pipe.transformer._hf_hook
    assert hook.pids() == pids and hook.ranks.sent == [1, 1, 1] and (hook.hits, hook.whole) == (STEPS - 1, 0)
    plain = output(twin(**fresh(call)))

    os.kill(third, signal.SIGKILL)  # between calls: the next call starts new workers
    assert processes_gone([third])
    torch.testing.assert_close(output(pipe(**fresh(call))), plain, **TOLERANCE)
    renewed = hook.pids()
    assert len(renewed) == 3 and not set(renewed) & {first, second, third}
    assert processes_gone([first, second])
    pipemap.reset(pipe)
    assert processes_gone(renewed) and not hasattr(pipe.transformer, "_hf_hook")


@pytest.mark.slow
def test_a_worker_killed_during_a_call_costs_a_miss_within_the_timeout_never_a_hang(monkeypatch):
    pipe, call, plain, plan = _wan(monkeypatch, 30)
    pipemap.dispatch(pipe, plan.remap(ON_CPU))
    hook = pipe.transformer._hf_hook
    victim = hook.pids()[2]  # the second half's rank 1

    def kill_once(module, args):  # a later step's first branch runs here while its second runs on the other half
        if hook.hits + hook.misses == 1:
            handle.remove()
            os.kill(victim, signal.SIGKILL)

    handle = hook.home.register_forward_pre_hook(kill_once)
    started = time.monotonic()
    # the second half's call fails (its rank 1 gone): a miss, the branch runs here, on new workers
    torch.testing.assert_close(output(pipe(**fresh(call))), plain, **TOLERANCE)
    assert hook.misses >= 1
    assert time.monotonic() - started < 90 and processes_gone([victim])
    torch.testing.assert_close(output(pipe(**fresh(call))), plain, **TOLERANCE)  # new workers
    pipemap.reset(pipe)

