"""Guidance branches at once, each split by its tokens (``hooks/guidance_sequence.py``, mode
``"guidance_sequence"``): on four stand-in GPUs (the dry run), remapped onto the CPU (outputs equal the plain
pipeline's), under the fake CUDA with four GPUs (no race), and planned by strategy ``"parallel"`` on four GPUs.

On worker processes (the tests below the line): a plan for four GPUs remapped onto the CPU keeps one rank per planned
GPU, this process and three workers, each half a gloo group of its own; outputs equal the plain pipeline's."""

from __future__ import annotations

import copy
import os
import signal
import threading
import time

import pytest
import torch

import families
import pipemap
from families import fresh, output
from helpers import pipeline_state, processes_gone, split_tolerance, with_copy
from pipemap import tiny
from pipemap.hooks.guidance_sequence import GuidanceSequenceHook
from pipemap.hooks.launch import TIMEOUT_ENV
from pipemap.hooks.workers import ENV
from pipemap.modes import facts

FOUR = "4x64MiB,cpu=1GiB"
ON_CPU = {f"cuda:{i}": "cpu" for i in range(4)}
STEPS = 3
TOLERANCE = split_tolerance(operation="attention")  # attention in shards sums in another order


def four_gpus(pipe):
    """Everything on cuda:0, the transformer's first branch split over cuda:0 and cuda:1, its second over cuda:2
    and cuda:3."""
    return with_copy(pipe, "guidance_sequence", hardware=FOUR, copies=3)


def flux_true_cfg():
    pipe = tiny.build("flux")  # 2 attention heads: one for each GPU of a half
    pipe.set_progress_bar_config(disable=True)
    call = dict(tiny.default_call(pipe, "flux", output_type="pt"), negative_prompt="blurry", true_cfg_scale=2.0,
                num_inference_steps=STEPS)
    return pipe, call


def _tokens_seen(branches: list[list[torch.nn.Module]], seen: list[tuple[int, int, str, int]]) -> list:
    """A forward pre-hook on each rank's copy: (its branch, its rank, the thread, the tokens of its share)."""
    def record(branch, rank):
        return lambda m, a, k: seen.append((branch, rank, threading.current_thread().name, _tokens(a, k)))

    return [_share_point(copy).register_forward_pre_hook(record(branch, rank), with_kwargs=True)
            for branch, ranks in enumerate(branches) for rank, copy in enumerate(ranks)]


def _share_point(model: torch.nn.Module) -> torch.nn.Module:
    """The output projection: its input is this rank's share of the tokens (the ``_cp_plan`` of Flux and Wan
    gathers them after it)."""
    return model.proj_out


def _tokens(args, kwargs) -> int:
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    return int(hidden.shape[1]) if hidden is not None else -1


# ---- on four stand-in GPUs ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_dry_run_computes_both_halves_on_their_stand_ins_within_budget():
    pipe, call = families.true_cfg("wan_t2v", STEPS)
    plan = four_gpus(pipe)
    extra = {k: v for k, v in call.items() if k not in ("prompt", "generator", "output_type", "num_inference_steps")}
    report = pipemap.simulate(pipe, plan, steps=STEPS, **extra)
    assert report.ok, report.error
    copy = plan.placement("transformer").bytes
    for gpu in ("cuda:1", "cuda:2", "cuda:3"):  # a copy on each, and each computed its share of a branch
        assert report.weight_bytes[gpu] >= copy
        assert report.activation_bytes[gpu] > 0 and report.peak_phase[gpu].startswith("denoising")
    for device in plan.devices:
        assert report.peak_bytes[device.device] <= device.budget


# ---- remapped onto the CPU ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("build", [lambda: families.true_cfg("wan_t2v", STEPS), flux_true_cfg],
                         ids=["wan_t2v", "flux_true_cfg"])
def test_each_branch_splits_over_its_half_and_equals_plain(build):
    pipe, call = build()
    whole: list[int] = []
    handle = _share_point(pipe.transformer).register_forward_pre_hook(
        lambda m, a, k: whole.append(_tokens(a, k)), with_kwargs=True)
    plain = output(pipe(**fresh(call)))
    handle.remove()
    before = pipeline_state(pipe)
    pipemap.dispatch(pipe, four_gpus(pipe).remap(ON_CPU))
    hook = pipe.transformer._hf_hook
    assert isinstance(hook, GuidanceSequenceHook) and hook.share == 2
    assert [len(ranks) for ranks in hook.branches] == [2, 2] and len(hook.replicas) == 3
    seen: list[tuple[int, int, str, int]] = []
    handles = _tokens_seen(hook.branches, seen)
    torch.testing.assert_close(output(pipe(**fresh(call))), plain, **TOLERANCE)
    assert (hook.hits, hook.misses, hook.whole) == (STEPS - 1, 0, 0)  # the first step has none before it
    # the first half ran both calls of the first step and the first call of each later one, on both its ranks; the
    # second half each later step's second call, started ahead
    assert [sum(1 for b, *_ in seen if b == branch) for branch in (0, 1)] == [2 * (STEPS + 1), 2 * (STEPS - 1)]
    assert len(whole) == 2 * STEPS and {tokens for *_, tokens in seen} == {whole[0] // 2}  # half the tokens each
    threads = {(b, r): {t for b2, r2, t, _ in seen if (b2, r2) == (b, r)} for b in (0, 1) for r in (0, 1)}
    assert threads.pop((0, 0)) == {threading.current_thread().name}  # rank 0 of the first half: the caller's
    assert all(t.startswith("pipemap-transformer") for names in threads.values() for t in names)
    for handle in handles:
        handle.remove()
    pipemap.reset(pipe)
    assert pipeline_state(pipe) == before


@pytest.mark.parametrize("name", ["wan_i2v", "flux_kontext"])
def test_more_families_calling_once_per_branch_with_a_context_parallel_plan_equal_plain(name):
    pipe, call = families.true_cfg(name, STEPS)
    if name == "flux_kontext":
        call = dict(call, negative_prompt="blurry", true_cfg_scale=3.0)
    plain = output(pipe(**fresh(call)))
    pipemap.dispatch(pipe, four_gpus(pipe).remap(ON_CPU))
    torch.testing.assert_close(output(pipe(**fresh(call))), plain, **TOLERANCE)
    hook = pipe.transformer._hf_hook
    assert (hook.hits, hook.whole) == (STEPS - 1, 0)


def _halving_the_output_projection(pipe, step, timestep, tensors):
    with torch.no_grad():
        pipe.transformer.proj_out.weight.mul_(0.5)  # in place, between steps (a weight edit, a fused LoRA)
    return {}


def test_weights_changed_by_a_step_callback_reach_every_rank_and_equal_plain():
    pipe, call = families.true_cfg("wan_t2v", STEPS)
    call = dict(call, callback_on_step_end=_halving_the_output_projection)
    twin = copy.deepcopy(pipe)
    plain = output(twin(**fresh(call)))
    pipemap.dispatch(pipe, four_gpus(pipe).remap(ON_CPU))
    torch.testing.assert_close(output(pipe(**fresh(call))), plain, **TOLERANCE)
    torch.testing.assert_close(pipe.transformer.proj_out.weight, twin.transformer.proj_out.weight, atol=0, rtol=0)


def test_requests_overlapped_by_run_many_keep_their_own_branches_and_halves():
    pipe, call = families.true_cfg("wan_t2v", STEPS)
    calls = [dict(call, prompt=p) for p in ("a tiny cat", "a tiny dog", "a tiny bird")]
    plain = [output(pipe(**fresh(c))) for c in calls]
    pipemap.dispatch(pipe, four_gpus(pipe).remap(ON_CPU))
    results = pipemap.run_many(pipe, [fresh(c) for c in calls], workers=2)
    for got, want in zip(results, plain, strict=True):
        torch.testing.assert_close(output(got), want, **TOLERANCE)
    hook = pipe.transformer._hf_hook
    assert hook.hits > 0 and hook.whole == 0


def test_a_call_whose_tokens_do_not_divide_runs_whole_and_equals_plain():
    pipe, call = flux_true_cfg()
    call = dict(call, max_sequence_length=31)  # 31 text tokens: no even share for the two GPUs of a half
    plain = output(pipe(**fresh(call)))
    pipemap.dispatch(pipe, four_gpus(pipe).remap(ON_CPU))
    hook = pipe.transformer._hf_hook
    torch.testing.assert_close(output(pipe(**fresh(call))), plain, **TOLERANCE)
    # every call ran whole here: the first branch's own, and the second branch's after its call ahead missed
    assert hook.whole == 2 * STEPS and (hook.hits, hook.misses) == (0, STEPS - 1)


def test_dispatch_refuses_heads_that_do_not_divide_among_a_half_and_leaves_the_pipeline_as_it_was():
    pipe, _ = families.build("qwen_image")  # 3 attention heads: no even share for the two GPUs of a half
    before = pipeline_state(pipe)
    with pytest.raises(pipemap.errors.DispatchError, match="3 attention heads do not divide among 2 GPUs"):
        pipemap.dispatch(pipe, four_gpus(pipe).remap(ON_CPU))
    assert pipeline_state(pipe) == before


# ---- under the fake CUDA (tests/fakecuda.py) ----------------------------------------------------------------------


@pytest.mark.slow
def test_the_tiny_flux_over_four_fake_gpus_equals_plain_with_no_race(fake_cuda):
    import fakecuda

    fake_cuda.gpus = 4
    pipe, call = flux_true_cfg()
    plain = output(pipe(**fresh(call)))
    pipemap.dispatch(pipe, four_gpus(pipe))
    hook = pipe.transformer._hf_hook
    assert [[str(next(r.parameters()).device) for r in ranks] for ranks in hook.branches] == [
        ["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]]
    result = output(pipe(**fresh(call)))
    assert (hook.hits, hook.whole) == (STEPS - 1, 0)  # the second half's results used, every call split
    torch.testing.assert_close(fakecuda.host(result), plain, **TOLERANCE)
    pipemap.reset(pipe)


# ---- planned ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("hardware", "mode", "copies"), [
    ("2x141GiB,cpu=1TiB", "guidance", ("cuda:1",)),
    ("4x141GiB,cpu=1TiB", "guidance_sequence", ("cuda:1", "cuda:2", "cuda:3")),
])
def test_parallel_plans_wan_s_branches_split_on_four_gpus(hardware, mode, copies):
    plan = pipemap.plan("wan2.1-t2v-14b", hardware=hardware, strategy="parallel")
    placement = plan.placement("transformer")
    assert (placement.mode, placement.replicas) == (mode, copies)
    assert pipemap.Plan.from_json(plan.to_json()) == plan
    if mode == "guidance_sequence":
        assert "cuda:0, cuda:1 run each step's first call (conditional), cuda:2, cuda:3 its second" in plan.notes[-1]
        assert "1st branch's tokens split over cuda:0, cuda:1, 2nd's over cuda:2, cuda:3" in facts(mode).text(placement)
        for gpu in copies:  # a whole copy on each GPU
            assert next(d for d in plan.devices if d.device == gpu).used >= placement.bytes


# ---- on worker processes
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

