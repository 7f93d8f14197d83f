"""Guidance branches at once in a worker process (``hooks/guidance_workers.py``): the second branch of each step
started ahead on a worker process, remapped onto the CPU; outputs equal the plain pipeline's. Slow: each test starts
a worker (a spawned interpreter importing torch and diffusers)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

import families
import pipemap
from families import fresh, output
from helpers import processes_gone, with_copy
from pipemap.hooks.guidance import GuidanceHook
from pipemap.hooks.workers import ENV

ON_CPU = {"cuda:0": "cpu", "cuda:1": "cpu"}
STEPS = 3


@pytest.mark.slow
def test_qwen_image_s_second_branch_runs_on_a_worker_equals_plain_and_a_dead_worker_costs_only_a_miss(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)  # as a user runs it: ranks="auto", worker processes
    pipe, call = families.true_cfg("qwen_image", STEPS)
    plain = output(pipe(**fresh(call)))
    plan = with_copy(pipe, "guidance")
    dry = pipemap.simulate(pipe, plan, steps=2, advice=False,
                           **{k: v for k, v in fresh(call).items() if k not in ("generator", "num_inference_steps")})
    pipemap.dispatch(pipe, plan.remap(ON_CPU))
    hook = pipe.transformer._hf_hook
    assert isinstance(hook, GuidanceHook) and hook.runtime == "process"
    assert hook.replicas == [] and hook.ranks is not None
    # what the worker holds on its device is what the dry run's stand-in for cuda:1 held, and the plan's figure
    assert hook.ranks.held() == [dry.weights_held("cuda:1")] == [plan.placement("transformer").bytes]
    (pid,) = hook.pids()
    assert pid != os.getpid()
    torch.testing.assert_close(output(pipe(**fresh(call))), plain, atol=1e-4, rtol=0)
    assert (hook.hits, hook.misses) == (STEPS - 1, 0)  # the first step has no step before it to predict from
    assert hook.ranks.served == [pid] * (STEPS - 1)  # each later step's second branch computed by the worker

    def kill_once(module, args):  # a step's first branch runs here while its second was sent: kill the worker
        if hook.hits + hook.misses == 1:
            handle.remove()
            os.kill(pid, signal.SIGKILL)

    handle = pipe.transformer.register_forward_pre_hook(kill_once)
    hook.hits = hook.misses = 0
    torch.testing.assert_close(output(pipe(**fresh(call))), plain, atol=1e-4, rtol=0)  # the branch ran here
    assert hook.misses >= 1 and processes_gone([pid])
    (second,) = hook.pids()  # a later step started a new worker
    assert second != pid
    pipemap.reset(pipe)
    assert processes_gone([second]) and not hasattr(pipe.transformer, "_hf_hook")


@pytest.mark.slow
def test_wan_planned_parallel_runs_its_second_branch_on_a_worker_and_equals_plain(monkeypatch):
    # the planner's own parallel plan (not a hand-made one): Wan calls its transformer once per guidance branch
    monkeypatch.delenv(ENV, raising=False)  # as a user runs it: ranks="auto", worker processes
    pipe, call = families.true_cfg("wan_t2v", STEPS)
    plain = output(pipe(**fresh(call)))
    plan = pipemap.plan(pipe, hardware="2x64MiB,cpu=1GiB", strategy="parallel", headroom=0.0)
    assert (plan.placement("transformer").mode, plan.placement("transformer").replicas) == ("guidance", ("cuda:1",))
    pipemap.dispatch(pipe, plan.remap(ON_CPU))
    hook = pipe.transformer._hf_hook
    assert isinstance(hook, GuidanceHook) and hook.runtime == "process"
    (pid,) = hook.pids()
    torch.testing.assert_close(output(pipe(**fresh(call))), plain, atol=1e-4, rtol=0)
    assert (hook.hits, hook.misses) == (STEPS - 1, 0) and hook.ranks.served == [pid] * (STEPS - 1)
    assert pid != os.getpid()
    pipemap.reset(pipe)
    assert processes_gone([pid])
